"""The one base class of every error a user can cause (bad input, a refused action, a corrupt file).

The CLI prints such an error as one line (`megamlm: <verb>: <message>`) and exits 2; anything else
is a bug and is reported as one line too, with the traceback under `--debug` / `MEGAMLM_DEBUG=1`.
Each layer subclasses it (ConfigError, ShardError, TokenizerError, ConversionError, ...), so a
lower layer never needs to know the CLI exists. megamlm's warnings are one line too (`warnings_as_lines`).
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import os
import re
import warnings
from pathlib import Path


class MegamlmError(ValueError):
    """Bad input or a refused action; the message names the file, line or key and what to do."""


class CorruptFileError(MegamlmError):
    """A file megamlm wrote no longer matches the size or hash it recorded when writing it."""


def _within(value: float, bound: str) -> bool:
    """bound: ">= a", "> a", or an interval "[a, b)" / "(a, b]" / "[a, b]" / "(a, b)"; a note in
    parentheses may follow it ("> 0 (GiB per GPU)")."""
    if bound[0] in "[(":
        close = min(i for i in (bound.find("]"), bound.find(")")) if i > 0)
        low, high = (float(end) for end in bound[1:close].split(","))
        above = low <= value if bound[0] == "[" else low < value
        return above and (value <= high if bound[close] == "]" else value < high)
    relation, limit = bound.split()[:2]
    return value >= float(limit) if relation == ">=" else value > float(limit)


def check_ranges(checks, error: type[MegamlmError] = MegamlmError) -> None:
    """checks: (what, value, bound) triples; `what` names the value as the message shows it
    ("--workers 0", "train.seed=-1"), `bound` as `_within` reads it. The first value outside its bound
    (None: not set, not checked; a tuple: each item) raises `error` in one line: "--workers 0 must be
    >= 1", "data.valid_fraction=1.5 must be in [0, 1)"."""
    for what, value, bound in checks:
        items = value if isinstance(value, tuple) else () if value is None else (value,)
        if not all(_within(item, bound) for item in items):
            raise error(f"{what} must be {'in ' if bound[0] in '[(' else ''}{bound}")


def did_you_mean(name, allowed) -> str:
    """"; did you mean 'x'?" where one of the `allowed` names is close to a mistyped `name` in any case
    (difflib's ratio >= 0.75: one letter dropped, doubled or swapped in a word), else "". Ends a message
    that lists the allowed names, so the likely one is not lost in a list of 50 keys."""
    spelled = {str(a).lower(): str(a) for a in allowed}
    close = difflib.get_close_matches(str(name).lower(), spelled, n=1, cutoff=0.75)
    return f"; did you mean '{spelled[close[0]]}'?" if close else ""


def error_line(err: BaseException) -> str:
    """One line for an error: OSErrors as "<file>: <reason>", others by their message, or by their
    type where the message is empty (a bare StopIteration, an assert); a write that found no room with
    what to do."""
    where = f"{err.filename}: " if isinstance(err, OSError) and err.filename is not None else ""
    if not isinstance(err, MegamlmError) and (number := room_errno(err)) is not None:  # ours say where already
        return f"{where}{os.strerror(number)}: {MAKE_ROOM}"
    if where and err.strerror:
        return f"{where}{err.strerror}"
    text = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
    return " ".join(text.split()) or type(err).__name__


OUT_OF_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""A write that found no room: the device full, the user's quota spent, a file past a size limit (`ulimit -f`)."""
MAKE_ROOM = "make room (free space on its device, a quota, `ulimit -f`) or write elsewhere, and run the command again"


def room_errno(err: BaseException) -> int | None:
    """The errno of a write that found no room (OUT_OF_ROOM), or None: an OSError's, or one a library in Rust
    (safetensors, tokenizers) gives only in its message, as "(os error 28)"."""
    number = err.errno if isinstance(err, OSError) else \
        int(found[1]) if (found := re.search(r"\(os error (\d+)\)", str(err))) else None
    return number if number in OUT_OF_ROOM else None


PEER_GONE_MARKS = ("Connection closed by peer", "Connection reset by peer")
"""What gloo's and the TCP store's errors say when another rank's process has ended."""


def peer_gone(err: BaseException) -> str | None:
    """What `err` says of another rank's process having ended (it failed or was stopped), when a
    collective or the rendezvous store failed for that: not this rank's fault; the other rank's line says
    why. None for any other error."""
    if isinstance(err, RuntimeError):
        return next((mark for mark in PEER_GONE_MARKS if mark in str(err)), None)
    return None


_PACKAGE = Path(__file__).resolve().parent
"""megamlm's source: a warning raised in it is megamlm's own."""


@contextlib.contextmanager
def warnings_as_lines(verb: str):
    """megamlm's own warnings as one line, `megamlm: <verb>: warning: <message>`, as its errors are: Python's
    format adds the file, line and category and a second line quoting the `warnings.warn` call, which tells
    a user nothing. Other packages' warnings keep that format (their file and line help a report to them)."""
    python_format = warnings.formatwarning

    def one_line(message, category, filename, lineno, line=None):
        if Path(filename).resolve().is_relative_to(_PACKAGE):
            return f"megamlm: {verb}: warning: {' '.join(str(message).split())}\n"
        return python_format(message, category, filename, lineno, line)

    warnings.formatwarning = one_line
    try:
        yield
    finally:
        warnings.formatwarning = python_format
