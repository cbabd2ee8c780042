"""Field checking shared by every config section: types, allowed values, one-line errors."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

from megamlm.errors import MegamlmError, check_ranges, did_you_mean

ARCHITECTURE = {"architecture": True}
"""Field metadata of the ModelConfig fields that define the weights."""


class ConfigError(MegamlmError):
    """A configuration mistake, reported as one line that names the key."""


def _divisors(n: int, upto: int | None = None) -> str:
    found = [d for d in range(1, n + 1) if n % d == 0 and (upto is None or d <= upto)]
    return ", ".join(map(str, found))


UNIONS = (typing.Union, types.UnionType)
"""`Optional[X]` and `X | None` (PEP 604) are both unions."""


def describe_type(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in UNIONS:
        return " or ".join(describe_type(a) for a in args if a is not type(None)) + " or null"
    if origin is tuple:
        return "[" + ", ".join(describe_type(a) for a in args) + "]"
    if origin is list:
        return f"list of {describe_type(args[0])}"
    return tp.__name__


def _choices(tp: Any) -> tuple:
    """The values a Literal type (also inside a union: `Literal[...] | None`) names; () for other types."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return args
    if origin in UNIONS:
        return tuple(value for arg in args for value in _choices(arg))
    return ()


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """(ok, value converted to tp). Ints and numeric strings are accepted for floats, whole numbers written as
    floats (1e5, 2.0) for ints; bools never count as numbers."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in UNIONS:
        if value is None and type(None) in args:
            return True, None
        for arg in args:
            if arg is not type(None):
                ok, converted = _coerce(value, arg)
                if ok:
                    return True, converted
        return False, value
    if origin is Literal:
        return value in args, value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            return False, value
        items = [_coerce(v, args[0]) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            return False, value
        items = [_coerce(v, a) for v, a in zip(value, args)]
        return all(ok for ok, _ in items), tuple(v for _, v in items)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str):  # YAML 1.1 reads `6e-4` (no dot) as a string
            try:
                return True, float(value)
            except ValueError:
                pass
        return False, value
    if tp is int:
        if isinstance(value, (float, str)):  # `steps: 1e5` (a string to YAML 1.1) or 1.0e5 is an int to a user
            ok, number = _coerce(value, float)
            if ok and number.is_integer() and abs(number) <= 2 ** 53:  # beyond, a float misses integers
                return True, int(number)
        return isinstance(value, int) and not isinstance(value, bool), value
    return isinstance(value, tp), value


def check_bounds(section_obj: Any, section: str, bounds: dict[str, str]) -> None:
    """bounds: field -> ">= 0", "> 1" or an interval "[0, 1)" (errors.check_ranges); a value outside its
    bound is refused in one line naming the key: "train.seed=-1 must be >= 0"."""
    values = {key: getattr(section_obj, key) for key in bounds}
    check_ranges([(f"{section}.{key}={list(value) if isinstance(value, tuple) else value}", value, bounds[key])
                  for key, value in values.items()], ConfigError)


def unmet(requirements: tuple[tuple[str, Any, bool], ...]) -> str:
    """"key=value, ..." of the (key, value, met) requirements that are not met; "" when all are."""
    return ", ".join(f"{key}={value}" for key, value, met in requirements if not met)


def field_default(cls: type, key: str) -> Any:
    """The value field `key` of config dataclass `cls` has when no file or override sets it."""
    f = cls.__dataclass_fields__[key]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def check_fields(section_obj: Any, section: str) -> None:
    """Type-check (and normalize, e.g. int -> float) every field of a config dataclass."""
    hints = typing.get_type_hints(type(section_obj))
    for f in dataclasses.fields(section_obj):
        value = getattr(section_obj, f.name)
        ok, converted = _coerce(value, hints[f.name])
        if not ok:
            hint = did_you_mean(value, _choices(hints[f.name])) if isinstance(value, str) else ""
            # null, true, false as YAML and the command line write them; other values quoted as Python does
            shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)
            raise ConfigError(f"{section}.{f.name}={shown} is invalid; allowed: {describe_type(hints[f.name])}{hint}")
        object.__setattr__(section_obj, f.name, converted)


