"""The one base class of every error a user can cause (bad input, a refused action, a corrupt file).

The CLI prints such an error as one line (`megamlm: <verb>: <message>`) and exits 2; anything else
is a bug and is reported as one line too, with the traceback under `--debug` / `MEGAMLM_DEBUG=1`.
Each layer subclasses it (ConfigError, ShardError, TokenizerError, ConversionError, ...), so a
lower layer never needs to know the CLI exists.
"""

from __future__ import annotations


class MegamlmError(ValueError):
    """Bad input or a refused action; the message names the file, line or key and what to do."""


class CorruptFileError(MegamlmError):
    """A file megamlm wrote no longer matches the size or hash it recorded when writing it."""


def check_minimums(bounds, error: type[MegamlmError] = MegamlmError) -> None:
    """bounds: (name, value, least) triples, e.g. ("--workers", 0, 1). The first value below its least
    (None: not set, not checked) raises `error`: "--workers 0 must be >= 1"."""
    for name, value, least in bounds:
        if value is not None and value < least:
            raise error(f"{name} {value} must be >= {least}")


def error_line(err: BaseException) -> str:
    """One line for an error: OSErrors as "<file>: <reason>", others by their message, or by their
    type where the message is empty (a bare StopIteration, an assert)."""
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        return f"{err.filename}: {err.strerror}"
    text = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
    return " ".join(text.split()) or type(err).__name__
