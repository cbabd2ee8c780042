"""Loading checkpoints from the internet without executing them.

fairseq checkpoints are pickles. `torch.load(weights_only=True)` unpickles only tensors, containers
and primitive types; on top of that we allow the few harmless classes fairseq writes (the argparse
Namespace of pre-hydra checkpoints, numpy scalars in `extra_state`). Anything else (a function, a
class with a `__reduce__`) is refused before any of it is called.
"""

from __future__ import annotations

import argparse
import io
import pickle
import pickletools
import zipfile
from pathlib import Path

import numpy as np
import torch

from megamlm.errors import MegamlmError


class UnsafeCheckpointError(MegamlmError):
    """The file asks the unpickler for something outside the allow-list; nothing was executed."""


class NotACheckpointError(MegamlmError):
    """The file is not a torch checkpoint (a text file, random bytes, a list instead of a dict)."""


def _numpy_allow_list() -> list:
    types = [np.dtype, np.ndarray, type(np.dtype("float32")), type(np.dtype("float64")),
             type(np.dtype("int64"))]
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            mod = __import__(module, fromlist=["scalar", "_reconstruct"])
        except ImportError:
            continue
        types += [mod.scalar, mod._reconstruct]
        break
    return types


ALLOWED_GLOBALS = [argparse.Namespace, *_numpy_allow_list()]
"""Classes fairseq checkpoints contain besides tensors and builtins, all inert data holders."""


def _allowed_names() -> list[str]:
    return sorted({f"{t.__module__}.{t.__qualname__}" for t in ALLOWED_GLOBALS})


def pickle_globals(path: Path, max_pickles: int = 5) -> list[str]:
    """The classes and functions a plain (non-zip) pickle file references, read from its opcodes
    without executing anything ("module.name"). torch's legacy format is a few pickles in a row;
    raises NotACheckpointError when the file does not start as a pickle."""
    data = path.read_bytes()
    stream = io.BytesIO(data)
    found: list[str] = []
    for index in range(max_pickles):
        start = stream.tell()
        if start >= len(data):
            break
        strings: list[str] = []  # string pushes, for STACK_GLOBAL (module and name pushed before it)
        memo: dict[int, str] = {}
        try:
            for op, arg, _ in pickletools.genops(stream):
                if op.name in ("GLOBAL", "INST"):
                    found.append(arg.replace(" ", "."))
                elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                    found.append(f"{strings[-2]}.{strings[-1]}")
                elif isinstance(arg, str) and "UNICODE" in op.name:
                    strings.append(arg)
                elif op.name == "MEMOIZE" and strings:
                    memo[len(memo)] = strings[-1]
                elif op.name in ("BINGET", "LONG_BINGET", "GET") and arg in memo:
                    strings.append(memo[arg])
        except (ValueError, EOFError) as err:
            if index == 0 and (not data.startswith(b"\x80") or stream.tell() - start < 4):
                head = data[:16]
                raise NotACheckpointError(f"{path}: not a torch checkpoint (neither a zip archive nor a "
                                          f"pickle; it starts with {head!r})") from None
            if index == 0:
                raise NotACheckpointError(f"{path}: not a torch checkpoint (damaged pickle: {err})") from None
            break  # the raw tensor bytes after torch's legacy pickles
    return found


def _check_zip(path: Path) -> None:
    """torch's zip reader does not check CRCs: a flipped byte would load silently. Read every member
    once and compare (a full read of the file)."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        raise NotACheckpointError(f"{path}: damaged torch checkpoint ({err})") from None
    if bad is not None:
        raise NotACheckpointError(f"{path}: damaged torch checkpoint: member {bad} fails its CRC check "
                                  f"(the file changed after it was written)")


def load_untrusted(path: str | Path) -> dict:
    """torch.load with weights_only=True and our allow-list; a refused global is named in the error,
    a file that is no checkpoint at all is called that, a damaged archive is refused."""
    path = Path(path)
    if path.is_dir():
        raise NotACheckpointError(f"{path} is a directory; expected a checkpoint file (.pt)")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    is_zip = zipfile.is_zipfile(path)
    if is_zip:
        _check_zip(path)
    elif path.read_bytes()[:4] == b"PK\x03\x04":
        raise NotACheckpointError(f"{path}: damaged torch checkpoint (a truncated zip archive)")
    try:
        with torch.serialization.safe_globals(ALLOWED_GLOBALS):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if is_zip:
            try:
                found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
            except Exception:
                found = []
        else:  # a plain pickle or torch's legacy format: read the opcodes ourselves
            found = [g for g in pickle_globals(path) if not g.startswith(("torch.", "collections.", "builtins."))]
        refused = sorted(set(found) - set(_allowed_names()))
        if not refused:
            raise NotACheckpointError(f"{path}: not a readable torch checkpoint "
                                      f"({str(err).splitlines()[0]})") from None
        raise UnsafeCheckpointError(
            f"{path}: refused to load: the pickle references {', '.join(refused)}, which is not on the "
            f"allow-list of plain data types ({', '.join(_allowed_names())}); nothing from the file was "
            f"executed. A genuine fairseq checkpoint contains only tensors, dicts and these types") from None
    except Exception as err:  # damaged archives raise RuntimeError and others
        if not is_zip:
            pickle_globals(path)  # names a file that is no pickle at all as such
        raise NotACheckpointError(f"{path}: not a readable torch checkpoint "
                                  f"({str(err).splitlines()[0]})") from None
    if not isinstance(obj, dict):
        raise NotACheckpointError(f"{path}: expected a checkpoint dict, got {type(obj).__name__}")
    return obj
