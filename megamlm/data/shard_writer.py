"""What a shard build stores of each document and how it writes it: the long-document policy's pieces and their
`.npy` bytes (`StoredPieces`, made in the tokenizer workers), each piece's `.json` member (`meta_json`), and the
tar shards with their index sidecars (`ShardWriter`), written byte for byte as tarfile and np.save write them
without their Python cost (the build's serial part: BENCHMARKS.md, "Where a shard build's time goes")."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megamlm.data.tokenizer import EOS


def apply_long_policy(ids: np.ndarray, capacity: int, policy: str) -> tuple[list[np.ndarray], str]:
    """ids (with </s>) -> (pieces that fit a sample, action taken: kept/dropped/truncated/split)."""
    if len(ids) <= capacity:
        return [ids], "kept"
    if policy == "drop":
        return [], "dropped"
    if policy == "truncate":
        return [np.append(ids[: capacity - 1], EOS)], "truncated"
    return [ids[i:i + capacity] for i in range(0, len(ids), capacity)], "split"


StoredPiece = tuple[bytes, int, int]
"""What a shard stores of one piece of a document: its `.npy` member's bytes, token count and CRC-32."""


@dataclass(frozen=True)
class StoredPieces:
    """A document's token ids (without </s>) -> (the long-document action, its StoredPieces): computed where
    the document was tokenized (data/tokenizing.py), so that the build's one serial process only writes."""

    capacity: int
    policy: str
    dtype: str

    def __call__(self, ids: np.ndarray) -> tuple[str, list[StoredPiece]]:
        pieces, action = apply_long_policy(np.append(ids, EOS), self.capacity, self.policy)
        payloads = [npy_bytes(piece.astype(self.dtype)) for piece in pieces]
        return action, [(payload, len(piece), zlib.crc32(payload)) for payload, piece in zip(payloads, pieces)]


TAR_BLOCK = 512
TAR_RECORD = 20 * TAR_BLOCK  # tarfile's RECORDSIZE: an archive ends on a multiple of it
_USTAR_TAIL = b"0" + bytes(100) + b"ustar\x0000" + bytes(32 + 32 + 8 + 8 + 155 + 12)
"""A member header after its name, mode, ids, size, mtime and checksum: a regular file, no link, ustar
magic, no owner names, no device numbers (empty, as tarfile leaves them for a file), no name prefix, the
block's padding."""
_USTAR_TAIL_SUM = sum(_USTAR_TAIL) + 8 * ord(" ")  # the checksum field counts as 8 spaces
_USTAR_MODE_IDS = b"0000644\x00" + b"0000000\x00" * 2  # mode 0o644, uid 0, gid 0
_NO_MTIME = b"00000000000\x00"
_NPY_MAGIC = b"\x93NUMPY\x01\x00"
_ZERO_BLOCK = bytes(TAR_BLOCK)


_USTAR_FIXED_SUM = sum(_USTAR_MODE_IDS) + sum(_NO_MTIME) + _USTAR_TAIL_SUM


def ustar_header(name: str, size: int) -> bytes:
    """The USTAR header tarfile writes for a regular file `name` of `size` bytes with mode 0o644, mtime 0 and
    no owner (tests/test_shards.py checks the bytes against tarfile's): tarfile builds it in ~60 us of Python,
    twice per member, which made the header half of a Pile build's serial time (BENCHMARKS.md)."""
    encoded = name.encode("utf-8")
    if len(encoded) > 100:
        raise ValueError(f"tar member name over 100 bytes: {name}")
    size_field = b"%011o\x00" % size
    checksum = sum(encoded) + sum(size_field) + _USTAR_FIXED_SUM  # the zero bytes add nothing
    return b"".join((encoded.ljust(100, b"\x00"), _USTAR_MODE_IDS, size_field, _NO_MTIME,
                     b"%06o\x00 " % checksum, _USTAR_TAIL))


def npy_bytes(ids: np.ndarray) -> bytes:
    """np.save's bytes of a 1-d array (format 1.0; checked against np.save), without its ~50 us of Python."""
    header = b"{'descr': '%s', 'fortran_order': False, 'shape': (%d,), }" % (ids.dtype.str.encode(), len(ids))
    pad = -(len(_NPY_MAGIC) + 2 + len(header) + 1) % 64  # numpy aligns the data to 64 bytes
    header += b" " * pad + b"\n"
    return _NPY_MAGIC + len(header).to_bytes(2, "little") + header + ids.tobytes()


_quoted = functools.lru_cache(maxsize=1 << 12)(json.dumps)
"""A string as JSON, once per source file, subset and action (not once per piece)."""


def meta_json(source: str, line: int, subset: str, tokens: int, action: str, part: int) -> bytes:
    """A piece's `.json` member: `json.dumps` of {source, line, subset, tokens, action, part} with sorted keys,
    byte for byte (tests/test_shards.py), from strings quoted once: json.dumps of a dict per piece was ~5 us
    of the build's serial part."""
    return (f'{{"action": {_quoted(action)}, "line": {line:d}, "part": {part:d}, "source": {_quoted(source)}, '
            f'"subset": {_quoted(subset)}, "tokens": {tokens:d}}}').encode()


class ShardWriter:
    """Deterministic tar shards (fixed mtime/owner) + index sidecars, renamed into place on close. The tar is
    written as tarfile writes it (USTAR members, two zero blocks, padding to a record), header by header."""

    def __init__(self, out_dir: Path, split: str, max_tokens: int):
        self.out_dir, self.split, self.max_tokens = out_dir, split, max_tokens
        self.shards: list[dict] = []
        self._tar = None

    def _open(self) -> None:
        name = f"{self.split}-{len(self.shards):06d}"
        self._name, self._tmp = name, self.out_dir / f"{name}.tar.tmp"
        self._tar = open(self._tmp, "wb", buffering=1 << 20)
        self._offset = 0
        self._index: list[tuple[int, int, int, int]] = []
        self._tokens = 0

    def _member(self, name: str, payload: bytes) -> tuple[bytes, bytes, bytes]:
        """A member's header, data and padding (its data starts TAR_BLOCK bytes after self._offset)."""
        padding = -len(payload) % TAR_BLOCK
        self._offset += TAR_BLOCK + len(payload) + padding
        return ustar_header(name, len(payload)), payload, _ZERO_BLOCK[:padding]

    def add(self, key: str, piece: StoredPiece, meta: bytes) -> None:
        """Write a document's piece (`StoredPieces`) and its meta_json as the members `key`.ids.npy, `key`.json."""
        if self._tar is None:
            self._open()
        payload, tokens, crc = piece
        offset = self._offset + TAR_BLOCK
        self._tar.write(b"".join((*self._member(f"{key}.ids.npy", payload), *self._member(f"{key}.json", meta))))
        self._index.append((offset, len(payload), tokens, crc))
        self._tokens += tokens
        if self._tokens >= self.max_tokens:
            self.close()

    def close(self) -> None:
        if self._tar is None:
            return
        end = self._offset + 2 * TAR_BLOCK  # the archive's two zero blocks, then zeros to a whole record
        self._tar.write(bytes(2 * TAR_BLOCK + -end % TAR_RECORD))
        self._tar.close()
        index = np.asarray(self._index, dtype=np.int64).reshape(-1, 4)
        index_path = self.out_dir / f"{self._name}.idx.npy"
        np.save(index_path, index)
        path = self.out_dir / f"{self._name}.tar"
        os.replace(self._tmp, path)
        self.shards.append({"name": path.name, "documents": len(index),
                            "tokens": int(index[:, 2].sum()), "bytes": path.stat().st_size,
                            "index_sha256": hashlib.sha256(index_path.read_bytes()).hexdigest()})
        self._tar = None
