"""Reading users' files and writing our own, under one rule: megamlm never deletes or overwrites a
file it did not write.

- `read_text`: a user's text file, or one line that names it (missing, a directory, not UTF-8).
- Every output folder megamlm writes (model folders, Hugging Face exports) carries `RECORD`
  (megamlm-files.json): each file it wrote, with size and sha256. The record tells our folders from
  a user's (a folder is replaced only when everything in it is listed) and lets readers verify what
  they load (`verify_record`).
- `staged_output`: write into a hidden sibling, record, then swap it in; a failure leaves the old
  folder as it was and removes only the staging folder.
- `check_writable`: probe an output location before long work starts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from megamlm.errors import MAKE_ROOM, CorruptFileError, MegamlmError, room_errno

RECORD = "megamlm-files.json"
RUN_CHECKPOINTS, RUN_FINAL = "checkpoints", "final"
"""A training run's folders in train.run_dir: its checkpoints, and the model folder it exports at the end."""
CHECKPOINT_META, CHECKPOINT_LATEST = "megamlm.json", "latest"
"""A training checkpoint's record (its update, data position, config and files' hashes), and the file of a run's
checkpoints folder that names its newest checkpoint."""
# what a model folder held before folders carried a record (sessions 1-4): still ours to replace
LEGACY_MODEL_FILES = ("config.yaml", "model.pt", "model-tp*-of-*.pt", "classification_heads.pt",
                      "fairseq_source.pt", "tokenizer", "tokenizer/dict.txt")


class OutputError(MegamlmError):
    """An output location that cannot or must not be written."""


def read_text(path: str | Path, what: str = "file") -> str:
    """The UTF-8 text of a user's file; one line naming the file when it cannot be that."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise MegamlmError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise MegamlmError(f"{what} {path} is a directory, not a file") from None
    except OSError as err:
        raise MegamlmError(f"cannot read {what} {path}: {err.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise MegamlmError(f"{what} {path} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset "
                           f"{err.start}): a binary file?") from None


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != RECORD)


def describe_files(folder: Path, names: list[str]) -> dict:
    """{name: {bytes, sha256}} of files in `folder`: what a record holds, and verify_files checks."""
    return {name: {"bytes": (folder / name).stat().st_size, "sha256": sha256_file(folder / name)}
            for name in names}


def write_record(folder: str | Path, kind: str) -> dict:
    """Hash every file under `folder` into its RECORD."""
    folder = Path(folder)
    files = describe_files(folder, _files(folder))
    record = {"written_by": "megamlm", "kind": kind, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
              "files": files}
    (folder / RECORD).write_text(json.dumps(record, indent=1))
    return record


def read_record(folder: str | Path) -> dict | None:
    path = Path(folder) / RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        if not isinstance(record.get("files"), dict):
            raise ValueError("no 'files'")
        return record
    except (ValueError, UnicodeDecodeError) as err:
        raise CorruptFileError(f"{path} is corrupt ({err})") from None


def verify_files(folder: str | Path, files: dict, names: list[str] | None = None, source: str = "",
                 hashes: bool = True) -> None:
    """Check `files` ({name: {bytes, sha256}}, or the `names` among them) in `folder`; raises
    CorruptFileError naming the first file that is missing or differs (in size only, without `hashes`)."""
    folder = Path(folder)
    for name in names if names is not None else files:
        path, expected = folder / name, files[name]
        if not path.is_file():
            raise CorruptFileError(f"{path} is missing (listed in {source or folder})")
        if path.stat().st_size != expected["bytes"]:
            raise CorruptFileError(f"{path} is corrupt: {path.stat().st_size} bytes, "
                                   f"{expected['bytes']} when written")
        if hashes and sha256_file(path) != expected["sha256"]:
            raise CorruptFileError(f"{path} is corrupt: its sha256 differs from the one recorded "
                                   f"when it was written")


def verify_record(folder: str | Path) -> bool:
    """Check every file of the folder's RECORD; raises CorruptFileError naming the first that
    differs. False when the folder has no record (written before records existed)."""
    record = read_record(folder)
    if record is None:
        return False
    verify_files(folder, record["files"], source=str(Path(folder) / RECORD))
    return True


def foreign_entries(folder: Path) -> list[str]:
    """What in `folder` megamlm did not write: files not in its record, folders holding none of
    the recorded files (empty ones included). Without a record, everything not in a legacy model
    folder's layout."""
    record = read_record(folder)
    ours = set(record["files"]) if record else None
    foreign = []
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        if name == RECORD:
            continue
        if ours is None:
            if not any(path.relative_to(folder).match(pattern) for pattern in LEGACY_MODEL_FILES):
                foreign.append(name + ("/" if path.is_dir() else ""))
        elif path.is_dir() and not any(f.startswith(name + "/") for f in ours):
            foreign.append(name + "/")
        elif path.is_file() and name not in ours:
            foreign.append(name)
    return [f for f in foreign if not any(f.startswith(d) for d in foreign if d.endswith("/") and d != f)]


def _listing(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_writable(path: str | Path, what: str = "output") -> None:
    """Raise OutputError now if `path` (a folder, created later if missing) cannot be written."""
    path = Path(path).absolute()
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise OutputError(f"cannot create {what} {path}: {existing} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".megamlm-write-probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise OutputError(f"cannot write {what} {path}: {existing}: {err.strerror}") from None


def check_output_folder(folder: str | Path, overwrite: bool, what: str = "output folder",
                        how: str = "pass --overwrite to replace it") -> None:
    """Refuse, before any work, a folder that holds anything megamlm did not write, or (unless
    `overwrite`) one of ours; check that it can be written."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"{what} {folder} is a file, not a folder")
    if folder.is_dir() and any(folder.iterdir()):
        foreign = foreign_entries(folder)
        if foreign:
            raise OutputError(f"{what} {folder} holds files megamlm did not write ({_listing(foreign)}); "
                              f"choose an empty or new folder (megamlm never deletes files it did not write)")
        if not overwrite:
            record = read_record(folder)
            when = f", written {record['time']}" if record else ""
            raise OutputError(f"{what} {folder} already holds a megamlm {record['kind'] if record else 'model'} "
                              f"folder{when}; {how}")
    check_writable(folder, what)


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def staging_sibling(folder: Path, check: Callable[[], None], name: str = "staging") -> Iterator[Path]:
    """Yield a hidden folder `.<folder name>.<name>-XXXX` beside `folder`; when the block succeeds,
    run `check` again (nothing of a user's appeared meanwhile) and swap it in place of `folder` (an
    existing one, which `check` allowed, is removed after the swap). On error only the staging
    folder is removed. `check` runs first too, before any work."""
    check()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.{name}-", dir=folder.parent))
    os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp's 0700 would outlive the rename
    try:
        yield tmp
        check()
        old = None
        if folder.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.replaced-", dir=folder.parent))
            os.replace(folder, old)
        os.replace(tmp, folder)
        if old is not None:
            shutil.rmtree(old)
    except BaseException as err:
        _raise_without(tmp, err, folder)
        raise


@contextlib.contextmanager
def staged_files(folder: Path) -> Iterator[Path]:
    """Yield a hidden folder inside `folder` (made where missing) to write files into; when the block succeeds,
    move each into `folder` (os.replace: a reader sees a file whole or not at all), else remove them all. A
    tokenizer trainer that fails (a full disk) so leaves no half-written file, which would refuse the rerun."""
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".staging-", dir=folder))
    try:
        yield tmp
        for file in sorted(tmp.iterdir()):
            os.replace(file, folder / file.name)
        tmp.rmdir()
    except BaseException as err:
        try:
            _raise_without(tmp, err, folder)
        finally:
            if made:
                with contextlib.suppress(OSError):  # only where nothing else was put there meanwhile
                    folder.rmdir()
        raise


def _raise_without(tmp: Path, err: BaseException, folder: Path) -> None:
    """Remove the staging folder `tmp` of a write into `folder` that failed with `err`; where the write found no
    room, raise the OutputError that says how far it got and what to do (else the caller re-raises `err`)."""
    number = room_errno(err)
    written = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()) if number else 0
    shutil.rmtree(tmp, ignore_errors=True)
    if number is not None:
        after = f" after {written / 2**20:,.1f} MiB" if written else ""
        raise OutputError(f"writing {folder} stopped{after}: {os.strerror(number)}; nothing of it is kept: "
                          f"{MAKE_ROOM}") from None


@contextlib.contextmanager
def staged_output(folder: str | Path, kind: str, overwrite: bool = False) -> Iterator[Path]:
    """Yield a staging folder beside `folder`; when the block succeeds, record its files and swap it
    in (an existing folder of ours is replaced only with `overwrite`)."""
    folder = Path(folder)
    with staging_sibling(folder, lambda: check_output_folder(folder, overwrite)) as tmp:
        yield tmp
        write_record(tmp, kind)
