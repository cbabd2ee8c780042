"""Loading checkpoints from the internet without executing them.

fairseq checkpoints are pickles. `torch.load(weights_only=True)` unpickles only tensors, containers
and primitive types; on top of that we allow the few harmless classes fairseq writes (the argparse
Namespace of pre-hydra checkpoints, numpy scalars in `extra_state`). Anything else (a function, a
class with a `__reduce__`) is refused before any of it is called.
"""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import numpy as np
import torch


class UnsafeCheckpointError(ValueError):
    """The file asks the unpickler for something outside the allow-list; nothing was executed."""


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


def load_untrusted(path: str | Path) -> dict:
    """torch.load with weights_only=True and our allow-list; a refused global is named in the error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        with torch.serialization.safe_globals(ALLOWED_GLOBALS):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        try:
            found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
            refused = sorted(set(found) - set(_allowed_names()))
        except Exception:  # legacy (non-zip) format: the listing is not available, torch's text is
            refused = [str(err).split("GLOBAL ")[-1].split(" ")[0]] if "GLOBAL " in str(err) else []
        what = ", ".join(refused) or str(err).splitlines()[0]
        raise UnsafeCheckpointError(
            f"{path}: refused to load: the pickle references {what}, which is not on the allow-list "
            f"of plain data types ({', '.join(_allowed_names())}); nothing from the file was executed. "
            f"A genuine fairseq checkpoint contains only tensors, dicts and these types") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a checkpoint dict, got {type(obj).__name__}")
    return obj
