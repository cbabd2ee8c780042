#!/usr/bin/env python
"""What a shard build spends per document, and where: tokenizing (parallel over --workers, with the long-document
policy and each piece's `.npy` bytes: data/shard_writer.py StoredPieces) against the builder's own serial work (reading,
writing each document's two tar members), with tarfile's member writing side by side with ours (ShardWriter; the
same bytes), and the build's own process's CPU time per document: the serial part, which bounds a build at any
worker count.

    PYTHONPATH=. python benchmarks/shard_build.py [--copies 40] [--workers 1,2] [--paragraphs 1] [--tree DIR]

Corpus: the bundled WikiText-103 valid+test text (a document per --paragraphs blank-line blocks: 1 gives ~1 kB
documents, as most of the Pile's are; 4 gives ~3.9 kB, near the Pile's mean) repeated --copies times into one
jsonl.zst. The serial part bounds a build at any worker count: documents/s ≤ 1 / (its seconds per document); the
build's main thread is that part (the reader thread decompresses without the GIL). --tree DIR: the builds of the
megamlm in DIR (a checkout or `git worktree` of another commit), side by side with this one's when run
alternately; the writer rows need this tree.
"""

from __future__ import annotations

import sys

if "--tree" in sys.argv:  # before megamlm is imported: the builds of another checkout
    sys.path.insert(0, sys.argv[sys.argv.index("--tree") + 1])

import argparse  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tarfile  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import zstandard  # noqa: E402

from megamlm.data.documents import BuildStats, read_documents  # noqa: E402
from megamlm.data.shards import BuildOptions, ShardWriter, build_shards  # noqa: E402 (ShardWriter: also --tree 99392d1)
from megamlm.data.tokenizer import Tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CORPUS = [ROOT / "data/wikitext-103/valid.txt", ROOT / "data/wikitext-103/test.txt"]


class TarfileWriter(ShardWriter):
    """The writer as it was before session 51: tarfile's addfile per member (its header built twice)."""

    def _open(self) -> None:
        super()._open()
        self._tar.close()
        self._tar = tarfile.open(self._tmp, "w", format=tarfile.USTAR_FORMAT)

    def _member(self, name: str, payload: bytes) -> int:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(payload), 0, 0o644
        data_offset = self._tar.offset + len(info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict"))
        self._tar.addfile(info, io.BytesIO(payload))
        return data_offset

    def add(self, key: str, piece: tuple, meta: bytes) -> None:
        if self._tar is None:
            self._open()
        payload, tokens, crc = piece
        offset = self._member(f"{key}.ids.npy", payload)
        self._member(f"{key}.json", meta)
        self._tokens += tokens
        self._index.append((offset, len(payload), tokens, crc))
        if self._tokens >= self.max_tokens:
            self.close()

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None


def write_seconds(writer_type, out: Path, pieces: list[tuple]) -> float:
    from megamlm.data.shard_writer import meta_json

    out.mkdir()
    writer = writer_type(out, "train", 20_000_000)
    start = time.perf_counter()
    for i, piece in enumerate(pieces):
        writer.add(f"{i:010d}", piece, meta_json("x.jsonl", i + 1, "Wikipedia (en)", piece[1], "kept", 0))
    writer.close()
    return time.perf_counter() - start


def writer_rows(tokenizer: Tokenizer, texts: list[str], tmp: Path) -> None:
    """Per document: tokenizing, the pieces' bytes, and writing them through tarfile and ShardWriter."""
    from megamlm.data.shard_writer import StoredPieces

    start = time.perf_counter()
    encoded = [ids for i in range(0, len(texts), 256) for ids in tokenizer.encode_batch(texts[i:i + 256])]
    encode = time.perf_counter() - start
    stored = StoredPieces(capacity=1 << 30, policy="split", dtype=np.dtype(np.uint16).str)
    start = time.perf_counter()
    pieces = [piece for ids in encoded for piece in stored(ids)[1]]
    prepare = time.perf_counter() - start
    docs = len(encoded)
    print(f"{'per document (one pass of the text)':<44} {'us':>8}")
    print(f"{'tokenize (encode_batch, its threads)':<44} {encode / docs * 1e6:8.1f}")
    print(f"{'pieces: policy, .npy bytes, CRC (StoredPieces)':<44} {prepare / docs * 1e6:8.1f}")
    tar_s = write_seconds(TarfileWriter, tmp / "tarfile", pieces)
    ours_s = write_seconds(ShardWriter, tmp / "ours", pieces)
    print(f"{'write, tarfile addfile (before)':<44} {tar_s / docs * 1e6:8.1f}")
    print(f"{'write, ShardWriter':<44} {ours_s / docs * 1e6:8.1f}   ({tar_s / ours_s:.2f}x)")
    same = (tmp / "tarfile/train-000000.tar.tmp").read_bytes() == (tmp / "ours/train-000000.tar").read_bytes()
    print(f"same tar bytes: {same}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=40)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--paragraphs", type=int, default=1, help="blank-line blocks per document")
    parser.add_argument("--tree", help="build with the megamlm of this checkout (the writer rows are left out)")
    args = parser.parse_args()
    tokenizer = Tokenizer.gpt2()
    blocks = [d.text for path in CORPUS for d in read_documents(path, "paragraphs", BuildStats(), False)]
    texts = ["\n\n".join(blocks[i:i + args.paragraphs]) for i in range(0, len(blocks), args.paragraphs)]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.jsonl.zst"
        lines = "".join(json.dumps({"text": t}) + "\n" for t in texts) * args.copies
        corpus.write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
        docs = len(texts) * args.copies
        import megamlm
        print(f"megamlm from {Path(megamlm.__file__).parent.parent}; corpus: {docs:,} documents of "
              f"{sum(map(len, texts)) / len(texts):,.0f} characters, {len(lines) / 1e6:.1f} MB\n")
        if args.tree is None:
            writer_rows(tokenizer, texts, tmp)
        print(f"{'build (shards build --seq-length 512)':<40} {'tokens/s':>10} {'docs/s':>8} "
              f"{'us/doc: own CPU':>16} {'main thread':>12}")
        for workers in (int(w) for w in args.workers.split(",")):
            out = tmp / f"build-{workers}"
            # process_time: this process's threads (decompressing, the pool's); thread_time: the main thread's
            start, cpu, main_thread = time.perf_counter(), time.process_time(), time.thread_time()
            manifest = build_shards(BuildOptions([str(corpus)], str(out), seq_length=512, long_docs="split",
                                                 workers=workers), tokenizer, progress=False)
            seconds = time.perf_counter() - start
            cpu, main_thread = time.process_time() - cpu, time.thread_time() - main_thread
            built = sum(s["tokens"] for s in manifest["splits"].values())
            print(f"{f'--workers {workers}':<40} {built / seconds:10,.0f} {docs / seconds:8,.0f} "
                  f"{cpu / docs * 1e6:16.1f} {main_thread / docs * 1e6:12.1f}")
            shutil.rmtree(out)


if __name__ == "__main__":
    main()
