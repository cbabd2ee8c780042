#!/usr/bin/env python
"""What a shard build spends per document, and where: tokenizing (parallel over --workers, with the long-document
policy and each piece's `.npy` bytes: data/shards.py StoredPieces) against the builder's own serial work (reading,
writing each document's two tar members), with tarfile's member writing side by side with ours (ShardWriter; the
same bytes), and the build's own process's CPU time per document: the serial part, which bounds a build at any
worker count.

    PYTHONPATH=. python benchmarks/shard_build.py [--copies 40] [--workers 1,2]

Corpus: the bundled WikiText-103 valid+test text (one document per blank-line block: short documents, as
most of the Pile's are) repeated --copies times into one jsonl.zst. The serial part bounds a build at any
worker count: documents/s ≤ 1 / (its seconds per document).
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import zstandard

from megamlm.data.documents import BuildStats, read_documents
from megamlm.data.shards import BuildOptions, ShardWriter, StoredPieces, build_shards, meta_json
from megamlm.data.tokenizer import Tokenizer

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
    out.mkdir()
    writer = writer_type(out, "train", 20_000_000)
    start = time.perf_counter()
    for i, piece in enumerate(pieces):
        writer.add(f"{i:010d}", piece, meta_json("x.jsonl", i + 1, "Wikipedia (en)", piece[1], "kept", 0))
    writer.close()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=40)
    parser.add_argument("--workers", default="1,2")
    args = parser.parse_args()
    tokenizer = Tokenizer.gpt2()
    texts = [d.text for path in CORPUS for d in read_documents(path, "paragraphs", BuildStats(), False)]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.jsonl.zst"
        lines = "".join(json.dumps({"text": t}) + "\n" for t in texts) * args.copies
        corpus.write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
        start = time.perf_counter()
        encoded = [ids for i in range(0, len(texts), 256) for ids in tokenizer.encode_batch(texts[i:i + 256])]
        encode = time.perf_counter() - start
        stored = StoredPieces(capacity=1 << 30, policy="split", dtype=np.dtype(np.uint16).str)
        start = time.perf_counter()
        pieces = [piece for ids in encoded for piece in stored(ids)[1]]
        prepare = time.perf_counter() - start
        docs, tokens = len(encoded), sum(len(e) + 1 for e in encoded)
        print(f"corpus: {docs * args.copies:,} documents, {tokens * args.copies:,} tokens "
              f"({tokens / docs:.0f} per document), {len(lines) / 1e6:.1f} MB\n")
        print(f"{'per document (one pass of the text)':<44} {'us':>8}")
        print(f"{'tokenize (encode_batch, its threads)':<44} {encode / docs * 1e6:8.1f}")
        print(f"{'pieces: policy, .npy bytes, CRC (StoredPieces)':<44} {prepare / docs * 1e6:8.1f}")
        tar_s = write_seconds(TarfileWriter, tmp / "tarfile", pieces)
        ours_s = write_seconds(ShardWriter, tmp / "ours", pieces)
        print(f"{'write, tarfile addfile (before)':<44} {tar_s / docs * 1e6:8.1f}")
        print(f"{'write, ShardWriter':<44} {ours_s / docs * 1e6:8.1f}   ({tar_s / ours_s:.2f}x)")
        same = (tmp / "tarfile/train-000000.tar.tmp").read_bytes() == (tmp / "ours/train-000000.tar").read_bytes()
        print(f"same tar bytes: {same}\n")
        print(f"{'build (shards build)':<44} {'tokens/s':>12} {'docs/s':>10} {'own CPU us/doc':>15}")
        for workers in (int(w) for w in args.workers.split(",")):
            out = tmp / f"build-{workers}"
            start, cpu = time.perf_counter(), time.process_time()  # process_time: this process's own
            manifest = build_shards(BuildOptions([str(corpus)], str(out), seq_length=512, long_docs="split",
                                                 workers=workers), tokenizer, progress=False)
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
            built = sum(s["tokens"] for s in manifest["splits"].values())
            n = sum(s["documents"] for s in manifest["splits"].values())
            print(f"{f'--workers {workers}':<44} {built / seconds:12,.0f} {n / seconds:10,.0f} "
                  f"{cpu / n * 1e6:15.1f}")
            shutil.rmtree(out)


if __name__ == "__main__":
    main()
