"""`megamlm config --explain [NAME]`: each key's value, where it was set, its default, allowed values and
documentation, read from the config dataclasses themselves.

Every field is documented by the string literal under it (litgpt's convention), so the text shown here
is the one in the code, written once; `field_docs` reads it with `ast`. NAME is a section (`train`), a
key (`model.position`) or the start of keys (`train.spike`); none: every key.

    model.head = clap  (set in configs/variants/learned-clap.yaml:5; default roberta; allowed: roberta | clap)
        roberta: dense -> GELU -> LayerNorm -> tied weight + bias; clap: beta * <h, normalize(E)>.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import textwrap
import typing
from pathlib import Path

from megamlm.config.checks import ConfigError, describe_type, field_default
from megamlm.config.loading import where_set
from megamlm.config.model import ModelConfig
from megamlm.config.sections import SECTION_KEYS, SECTIONS, Config, as_yaml
from megamlm.errors import did_you_mean


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field: its docstring} of a dataclass: the string literal right after each annotated field ({} where
    the package was installed without its sources: the keys are then shown without their text)."""
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    except OSError:
        return {}
    return {field.target.id: inspect.cleandoc(doc.value.value) for field, doc in zip(body, body[1:])
            if isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)}


def selected_keys(names: list[str]) -> list[tuple[str, str]]:
    """(section, key) pairs of the names, in the dataclasses' order: a section's keys, a key, or the keys a
    dotted name starts; no names (or ""): every key. A name that is none of these is one line."""
    every = [(section, key) for section, keys in SECTION_KEYS.items() for key in keys]
    chosen: dict[tuple[str, str], None] = {}
    for name in names or [""]:
        found = ([(s, k) for s, k in every if f"{s}.{k}" == name]  # a key, though others start so (model.head)
                 or [(s, k) for s, k in every if not name or name == s or "." in name and f"{s}.{k}".startswith(name)])
        if not found and "=" in name:
            raise ConfigError(f"--explain {name}: --explain takes a section or key; put overrides before it "
                              f"(megamlm config {name} --explain ...)")
        if not found:
            known = [*SECTIONS, *(f"{s}.{k}" for s, k in every)]
            raise ConfigError(f"--explain {name}: no section or key of that name; sections: "
                              f"{', '.join(SECTIONS)}{did_you_mean(name, known)}")
        chosen.update(dict.fromkeys(found))
    return [pair for pair in every if pair in chosen]


def _set_where(origin: str | None) -> str:
    """"set in configs/x.yaml:7; " (the key's line; the path relative to the working directory where it is
    below it), "set on the command line; ", or "" for a default."""
    if origin is None:
        return ""
    line = getattr(origin, "line", None)  # loading.Origin: a file's
    with contextlib.suppress(ValueError):
        origin = str(Path(origin).relative_to(Path.cwd()))
    return f"set {where_set(origin)}{f':{line}' if line else ''}; "


def explain(cfg: Config, names: list[str] = (), origins: dict[str, str] | None = None) -> str:
    """The text of `megamlm config --explain`: a paragraph per key (its value in cfg, where it was set
    (`origins`: load_config_and_origins'), its default, its type or allowed values, its documentation)."""
    origins = origins or {}
    paragraphs = []
    for section, key in selected_keys(list(names)):
        cls = SECTIONS[section]
        value, default = getattr(getattr(cfg, section), key), field_default(cls, key)
        kind = describe_type(typing.get_type_hints(cls)[key])
        allowed = f"allowed: {kind}" if " | " in kind else kind
        if cls is ModelConfig and key in ModelConfig.architecture_fields():
            allowed += "; architecture: a model folder's weights load only where it agrees"
        doc = textwrap.indent(field_docs(cls).get(key, "(no text: megamlm's sources are not installed)"), "    ")
        where = _set_where(origins.get(f"{section}.{key}"))
        paragraphs.append(f"{section}.{key} = {as_yaml(value)}  ({where}default {as_yaml(default)}; {allowed})\n"
                          f"{doc}\n")
    return "\n".join(paragraphs)
