"""A run's checkpoints as folders on disk, before any engine or rank is involved: which are complete (their save
finished: a `complete` file), which is the newest, whether one is as written (its megamlm.json and its files'
sizes and hashes), and what its megamlm.json says. train/checkpoint.py writes them and loads them into an
engine; train/preflight.py asks these questions before the ranks start."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from megamlm.errors import CorruptFileError, MegamlmError
from megamlm.files import CHECKPOINT_LATEST, CHECKPOINT_META, verify_files

COMPLETE_FILE = "complete"
META_KEYS = ("step", "position", "config")
"""What every megamlm.json holds (also those written before files were hashed)."""


class RunDirError(MegamlmError):
    """train.run_dir cannot be used as asked (it holds another run, or files of a user's)."""


def written_zero_stage(meta: dict) -> int:
    """The ZeRO stage of the engine that wrote a checkpoint (older ones record only the config's)."""
    return meta.get("zero_stage", meta["config"]["train"]["zero_stage"])


def checkpoint_problem(folder: Path, mine: Callable[[list[str]], list[str]] = list, hashes: bool = True) -> str | None:
    """None if checkpoint `folder`'s megamlm.json is the one its `complete` file hashes (or predates
    hashes) and its files (those `mine` picks of the sorted names: a rank's share) are as written, in
    size and (with `hashes`) sha256; else one line naming the first damage."""
    try:
        text = (folder / CHECKPOINT_META).read_text()
        expected = (folder / COMPLETE_FILE).read_text().strip()
        if expected and hashlib.sha256(text.encode()).hexdigest() != expected:
            raise CorruptFileError(f"{folder / CHECKPOINT_META} differs from the hash in {COMPLETE_FILE}")
        meta = json.loads(text)
        if not isinstance(meta, dict) or (missing := [key for key in META_KEYS if key not in meta]):
            what = f"no {', '.join(missing)}" if isinstance(meta, dict) else "not a JSON object"
            raise CorruptFileError(f"{folder / CHECKPOINT_META} is not a checkpoint's record ({what})")
        files = meta.get("files", {})
        verify_files(folder, files, mine(sorted(files)), source=str(folder / CHECKPOINT_META), hashes=hashes)
    except (OSError, ValueError) as err:  # CorruptFileError, unreadable or invalid JSON
        return str(err) if isinstance(err, CorruptFileError) else f"{folder / CHECKPOINT_META}: {err}"
    return None


def newest_intact(root: Path) -> tuple[str | None, list[str]]:
    """Before the ranks start, in one process: the checkpoint `--resume auto` resumes (the ranks'
    `Checkpoints.newest_verified`) as far as what is cheap to check tells (megamlm.json and the
    files' sizes; the ranks also hash every file), and a line per newer one that is damaged."""
    return first_intact(root, lambda tag: checkpoint_problem(root / tag, hashes=False))


def first_intact(root: Path, problem_of: Callable[[str], str | None]) -> tuple[str | None, list[str]]:
    """(the first of the newest complete checkpoint, then the others newest first, whose
    `problem_of(tag)` is None, a line per one before it that had a problem)."""
    skipped = []
    newest = newest_complete(root)
    for tag in ([newest] if newest else []) + [t for t in reversed(complete_tags(root)) if t != newest]:
        problem = problem_of(tag)
        if problem is None:
            return tag, skipped
        skipped.append(f"checkpoint {tag} is damaged: {problem}")
    return None, skipped


def newest_complete(root: Path) -> str | None:
    """The `latest` checkpoint under `root` if complete, else the newest complete one, else None."""
    pointer = root / CHECKPOINT_LATEST
    if pointer.exists():
        tag = pointer.read_text().strip()
        if (root / tag / "complete").exists():
            return tag
    complete = complete_tags(root)
    return complete[-1] if complete else None


def read_meta(root: Path, tag: str) -> dict:
    return json.loads((require_complete(root, tag) / CHECKPOINT_META).read_text())


def require_complete(root: Path, tag: str) -> Path:
    """The folder of checkpoint `tag` under `root`; refused unless its save finished."""
    if not (root / tag / COMPLETE_FILE).exists():
        available = ", ".join(complete_tags(root)) or "none"
        raise RunDirError(f"no complete checkpoint {tag} in {root} (complete ones: {available}; or --resume auto)")
    return root / tag


def complete_tags(root: Path) -> list[str]:
    """The checkpoints under `root` whose save finished, oldest first."""
    return sorted(p.name for p in root.glob("step*") if (p / COMPLETE_FILE).exists())
