"""What a corpus file is before it is text: its compression (zstd, gzip, bzip2, xz), recognised by its first
bytes rather than its name, and the formats that hold no text to read (zip, tar, Arrow, NumPy, Megatron's
indexed datasets, anything with NUL bytes; a compressed Parquet file: Parquet is read as it is, by
parquet_files.py). `megamlm shards build`, data.build_from and the tokenizer trainers read any of the
compressions and refuse the others before any work, naming the file and what it is: read as lines of text, a
Parquet file was a handful of garbage "documents" and a .jsonl.gz one invalid-UTF-8 line after another."""

from __future__ import annotations

import bz2
import gzip
import lzma
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from megamlm.errors import MegamlmError

BLOCK_BYTES = 1 << 20
"""Compressed bytes read at a time."""

SNIFF_BYTES = 1 << 16
"""Leading (decompressed) bytes looked at to tell text from the formats that are none."""


class InputError(MegamlmError):
    """An input file that is no text megamlm can read, or a damaged compressed one (names the file)."""


def _zstd_blocks(path: Path) -> Iterator[bytes]:
    """The decompressed bytes of a (multi-frame) zstd file, block by block; a file that ends inside a frame is
    an error, never a silently shorter input."""
    import zstandard

    started = False
    decompressor = zstandard.ZstdDecompressor().decompressobj()
    with open(path, "rb") as raw:
        while data := raw.read(BLOCK_BYTES):
            while data:
                try:
                    yield decompressor.decompress(data)
                except zstandard.ZstdError as err:
                    raise InputError(f"{path}: corrupt zstd data ({err})") from None
                started = True
                data = b""
                if decompressor.eof:  # next frame
                    data = decompressor.unused_data
                    decompressor, started = zstandard.ZstdDecompressor().decompressobj(), False
    if started:
        raise InputError(f"{path}: truncated zstd file (it ends inside a compressed frame); "
                         f"re-download or re-compress it")


def _stdlib_blocks(name: str, opener: Callable) -> Callable[[Path], Iterator[bytes]]:
    """A reader of `opener`'s format (gzip.open, bz2.open, lzma.open: each reads concatenated streams), its
    errors named as _zstd_blocks names zstd's."""

    def blocks(path: Path) -> Iterator[bytes]:
        try:
            with opener(path, "rb") as stream:
                while block := stream.read(BLOCK_BYTES):
                    yield block
        except EOFError:  # how all three say that the data stops inside a stream
            raise InputError(f"{path}: truncated {name} file (it ends inside a compressed stream); "
                             f"re-download or re-compress it") from None
        except (OSError, zlib.error, lzma.LZMAError) as err:  # BadGzipFile, bz2's "Invalid data stream"
            raise InputError(f"{path}: corrupt {name} data ({err})") from None

    return blocks


class Codec(NamedTuple):
    name: str
    magic: bytes
    """How a file of this compression begins."""
    blocks: Callable[[Path], Iterator[bytes]]
    """path -> its decompressed bytes, block by block."""


CODECS = (
    Codec("zstd", b"\x28\xb5\x2f\xfd", _zstd_blocks),
    Codec("gzip", b"\x1f\x8b\x08", _stdlib_blocks("gzip", gzip.open)),
    Codec("bzip2", b"BZh", _stdlib_blocks("bzip2", bz2.open)),
    Codec("xz", b"\xfd7zXZ\x00", _stdlib_blocks("xz", lzma.open)),
)

NOT_TEXT = (
    # (where, magic, what the file is, what to do instead)
    (0, b"PAR1", "a Parquet file", "decompress it (megamlm reads Parquet files as they are)"),
    (0, b"ARROW1", "an Arrow file", "write its text column as jsonl (datasets: Dataset.from_file(f).to_json(out))"),
    (0, b"PK\x03\x04", "a zip archive", "unzip it and pass the files in it"),
    (257, b"ustar", "a tar archive", "extract it and pass the files in it (shards a build wrote are trained "
                                     "on with data.shards=<their folder>, not built again)"),
    (0, b"\x93NUMPY", "a NumPy array", "megamlm tokenizes text itself: pass the corpus's text"),
    (0, b"MMIDIDX", "a Megatron indexed dataset", "megamlm tokenizes text itself: pass the corpus's text"),
)


def codec_of(path: Path) -> Codec | None:
    """The compression of the file at `path`, told by its first bytes, or None (plain)."""
    with open(path, "rb") as f:
        head = f.read(8)
    for codec in CODECS:
        if head.startswith(codec.magic) and (codec.name != "bzip2" or head[3:4].isdigit()):
            return codec
    return None


def _leading_bytes(path: Path, codec: Codec | None) -> bytes:
    """The first SNIFF_BYTES of the file's (decompressed) content, or all of it when shorter."""
    if codec is None:
        with open(path, "rb") as f:
            return f.read(SNIFF_BYTES)
    head = b""
    blocks = codec.blocks(path)
    try:
        for block in blocks:
            head += block
            if len(head) >= SNIFF_BYTES:
                break
    finally:
        blocks.close()
    return head[:SNIFF_BYTES]


def text_head(path: Path) -> bytes:
    """The first SNIFF_BYTES of the file's text (decompressed); InputError naming `path` when it is none of:
    text, or text in one of CODECS (a damaged compressed file is named when its first block cannot be read)."""
    codec = codec_of(path)
    head = _leading_bytes(path, codec)
    packed = f" ({codec.name}-compressed)" if codec else ""
    for offset, magic, what, instead in NOT_TEXT:
        if head[offset:offset + len(magic)] == magic:
            raise InputError(f"input {path} is {what}{packed}, not text: {instead}")
    if (nul := head.find(b"\x00")) >= 0:
        raise InputError(f"input {path} is binary{packed}, not text (a NUL byte at offset {nul}); inputs are "
                         f"jsonl or plain text, optionally compressed with {', '.join(c.name for c in CODECS)}")
    return head
