"""Loading: YAML files with `include:`, dotted overrides, origin-tagged errors."""

from __future__ import annotations

import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from megamlm.config.checks import ConfigError
from megamlm.config.sections import SECTION_KEYS, SECTIONS, Config, as_yaml
from megamlm.errors import MegamlmError, did_you_mean
from megamlm.files import read_text


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (YAML keeps the last one silently). A merge key
    (`<<: *defaults`) is not a key of the mapping: the keys written beside it override what it merges."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                break  # SafeLoader's construct_mapping refuses it: "found unhashable key"
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}' (first on line {seen[key] + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


class Origin(str):
    """Where a value was set as messages name it: a file's path (or "command line"), with `line`, the line of the
    key in the file (None elsewhere), which `config --explain` shows; messages and comparisons use the path."""

    line: int | None = None

    @classmethod
    def at(cls, path: str, line: int | None) -> Origin:
        origin = cls(path)
        origin.line = line
        return origin


def _key_lines(text: str) -> dict[str, int]:
    """"section.key", and "section" (or "include"), -> its line (1-based) in a YAML text that loaded as a
    mapping of sections."""
    sections = yaml.compose(text, Loader=yaml.SafeLoader).value
    return {**{section.value: section.start_mark.line + 1 for section, _ in sections},
            **{f"{section.value}.{key.value}": key.start_mark.line + 1
               for section, body in sections if isinstance(body, yaml.MappingNode) for key, _ in body.value}}


def _read_yaml(path: Path, seen: tuple[Path, ...]) -> dict[str, tuple[Any, str]]:
    """Flatten a YAML file (and its includes) to {"section.key": (value, origin)}."""
    # a file by its real path (an include cycle is a file met twice); a shell's `<(...)` is /dev/fd/N,
    # whose real path is "pipe:[...]", the name of nothing: it stays as given, and its includes are
    # relative to the directory the command runs in
    piped = not path.is_file()
    path = path.absolute() if piped else path.resolve()
    includes_base = Path.cwd() if piped else path.parent
    if path in seen:
        raise ConfigError(f"{path}: include cycle through {' -> '.join(map(str, seen))}")
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = read_text(path, "config file")
        doc = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except MegamlmError as err:
        raise ConfigError(str(err)) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({getattr(err, 'problem', err)})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    flat: dict[str, tuple[Any, str]] = {}
    lines = _key_lines(text) if doc else {}
    includes = doc.pop("include", [])
    includes = [includes] if isinstance(includes, str) else includes
    if not isinstance(includes, list) or not all(isinstance(inc, str) for inc in includes):
        raise ConfigError(f"{path}:{lines['include']}: include must be a path or a list of paths "
                          f"(relative to the file), not {as_yaml(includes)}")
    for inc in includes:
        included = includes_base / inc
        if not included.exists():  # named from the file that includes it, with the likely name beside it
            nearby = [str(Path(inc).parent / p.name) for p in included.parent.glob("*.y*ml")] if \
                included.parent.is_dir() else []
            raise ConfigError(f"{path}:{lines['include']}: include {inc}: config file not found: {included}"
                              f"{did_you_mean(inc, nearby)}")
        flat.update(_read_yaml(included, seen + (path,)))
    for section, body in doc.items():
        if section not in SECTIONS:
            raise ConfigError(f"{path}: unknown section '{section}'; allowed: include, {', '.join(SECTIONS)}"
                              f"{did_you_mean(section, ['include', *SECTIONS])}")
        if not isinstance(body, dict):
            raise ConfigError(f"{path}: section '{section}' must be a mapping")
        for key, value in body.items():
            flat[f"{section}.{key}"] = (value, Origin.at(str(path), lines.get(f"{section}.{key}")))
    return flat


def config_from_dict(values: dict, overrides: list[str] = (), origin: str = "config") -> Config:
    """A Config from nested {section: {key: value}} (e.g. a checkpoint's copy) plus dotted overrides,
    validated as if read from a file named `origin`."""
    flat = {f"{section}.{key}": (value, origin) for section, body in values.items() for key, value in body.items()}
    return build_config(_with_overrides(flat, overrides))


def replace_config(cfg: Config, overrides: list[str] = (), origin: str = "config") -> Config:
    """`cfg` with dotted overrides applied, validated again."""
    return config_from_dict(cfg.to_dict(), overrides, origin)


def parse_override(text: str) -> tuple[str, Any]:
    """`model.position=alibi` -> ("model.position", "alibi"); values are parsed as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or "." not in key:
        raise ConfigError(f"override '{text}' must look like section.key=value")
    try:
        return key.strip(), yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        return key.strip(), raw


def build_config(flat: dict[str, tuple[Any, str]]) -> Config:
    """Build and validate a Config from flattened, origin-tagged values."""
    per_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for dotted, (value, origin) in flat.items():
        section, _, key = dotted.partition(".")
        if section not in SECTIONS:
            raise ConfigError(f"{origin}: unknown section '{section}'; allowed: {', '.join(SECTIONS)}"
                              f"{did_you_mean(section, SECTIONS)}")
        allowed = SECTION_KEYS[section]
        if key not in allowed:
            raise ConfigError(f"{origin}: unknown key '{dotted}'; allowed: {', '.join(allowed)}"
                              f"{_likely_key(section, key)}")
        per_section[section][key] = value
    sections = {}
    for name, values in per_section.items():
        try:
            sections[name] = SECTIONS[name](**values)
        except ConfigError as err:
            raise ConfigError(_with_origin(err, flat)) from None
    try:
        return Config(**sections)
    except ConfigError as err:
        raise ConfigError(_with_origin(err, flat)) from None


def _likely_key(section: str, key: str) -> str:
    """The did-you-mean of an unknown key: the same key in the section that has it (`train.lr` ->
    `optim.lr`), else the section's key closest to it (`model.positon` -> `model.position`)."""
    elsewhere = [f"{other}.{key}" for other, keys in SECTION_KEYS.items() if key in keys]
    if elsewhere:
        return f"; did you mean '{elsewhere[0]}'?"
    return did_you_mean(f"{section}.{key}", [f"{section}.{name}" for name in SECTION_KEYS[section]])


def _with_origin(err: ConfigError, flat: dict[str, tuple[Any, str]]) -> str:
    """The message, prefixed with where its first-named key was set; where another key it names was set
    elsewhere, that too (a check across keys of two files, or of a file and the command line, would
    otherwise send the user to the file that did not change)."""
    message = str(err)
    named = dict.fromkeys(key for key in _CONFIG_KEY.findall(message) if key in flat)
    if not named:
        return message
    first, *others = named
    origin = flat[first][1]
    elsewhere = [f"{key} set {where_set(flat[key][1])}" for key in others if flat[key][1] != origin]
    return f"{origin}: {message}" + (f" ({'; '.join(elsewhere)})" if elsewhere else "")


_CONFIG_KEY = re.compile(r"\b[a-z_]+\.[a-z_0-9]+\b")
"""A dotted name in a message: a config key where the flattened config has it."""


def where_set(origin: str) -> str:
    """How a message says where a value was set: "on the command line", "in <file>"."""
    return "on the command line" if origin == "command line" else f"in {origin}"


def _with_overrides(flat: dict[str, tuple[Any, str]], overrides: list[str]) -> dict[str, tuple[Any, str]]:
    """`flat` with the dotted overrides applied last (origin "command line")."""
    for text in overrides:
        key, value = parse_override(text)
        flat[key] = (value, "command line")
    return flat


def _flat_config(paths: str | Path | list, overrides: list[str]) -> dict[str, tuple[Any, str]]:
    """{"section.key": (value, where it was set)} of YAML files merged in order, then dotted overrides."""
    flat: dict[str, tuple[Any, str]] = {}
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        flat.update(_read_yaml(Path(path), ()))
    return _with_overrides(flat, overrides)


def load_config(paths: str | Path | list = (), overrides: list[str] = ()) -> Config:
    """Merge YAML files in order (later files win; none = the defaults), then dotted overrides."""
    return build_config(_flat_config(paths, overrides))


def load_config_and_origins(paths: str | Path | list = (), overrides: list[str] = ()) -> tuple[Config, dict[str, str]]:
    """`load_config`'s Config and {"section.key": where the files and overrides set it last: a file's path (an
    include's own) or "command line"}; keys none of them sets have their defaults and are absent. The files
    are read once (a shell's `<(...)` cannot be read twice)."""
    flat = _flat_config(paths, overrides)
    return build_config(flat), {key: origin for key, (_, origin) in flat.items()}
