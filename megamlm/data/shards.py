"""Build webdataset shards of token ids from jsonl / jsonl.zst / plain text.

Output folder:
  train-000000.tar ...   webdataset tar: per document `<key>.ids.npy` (uint16 ids, or int32 for
                         dictionaries above 65535 symbols, `</s>` included) and `<key>.json`
                         (source file, line, Pile subset, tokens, long-document action)
  train-000000.idx.npy   [n_docs, 3] int64: data offset and size of each ids member, token count;
                         lets readers plan epochs and seek without scanning the tar
  valid-*.tar ...        with --valid-fraction
  manifest.json          written last: its absence means the build did not finish

Documents longer than a sample (`n + 1 > seq_length - 1` with `</s>`; the reference keeps
n <= 2046 at 2048) are dropped (the reference), truncated or split, and counted per Pile subset.
Malformed lines, missing "text", empty documents and invalid UTF-8 are counted, never silent.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from collections import Counter, defaultdict, deque
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from collections.abc import Iterator

import numpy as np

from megamlm.data.blocks import BLOCK_MODES, plan_blocks
from megamlm.data.tokenizer import EOS, Tokenizer

LONG_DOC_POLICIES = ("drop", "truncate", "split")
FORMAT_VERSION = 1


class ShardError(ValueError):
    """Bad input for the shard builder or reader (message names the file and line)."""


@dataclass
class Document:
    text: str
    source: str
    line: int
    subset: str


@dataclass
class BuildStats:
    documents: Counter = field(default_factory=Counter)  # per split
    tokens: Counter = field(default_factory=Counter)     # per split
    per_subset: dict = field(default_factory=lambda: defaultdict(Counter))
    skipped: Counter = field(default_factory=Counter)    # malformed_json, missing_text, empty, invalid_utf8


# ------------------------------------------------------------------------------------------------
# Reading inputs
# ------------------------------------------------------------------------------------------------


def _binary_lines(path: Path) -> Iterator[bytes]:
    if path.name.endswith(".zst"):
        import zstandard

        with open(path, "rb") as raw:
            reader = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))
            yield from reader
    else:
        with open(path, "rb") as f:
            yield from f


def read_documents(path: Path, text_mode: str, stats: BuildStats, strict: bool) -> Iterator[Document]:
    """Documents of one input file; problems are counted (or fatal with strict)."""

    def problem(kind: str, line: int, detail: str) -> None:
        stats.skipped[kind] += 1
        if strict:
            raise ShardError(f"{path}:{line}: {detail}")

    is_json = ".jsonl" in path.name or ".json" in path.suffixes
    paragraph: list[str] = []
    paragraph_line = 1
    for number, raw in enumerate(_binary_lines(path), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            problem("invalid_utf8", number, f"invalid UTF-8 ({err.reason} at byte {err.start})")
            continue
        if is_json:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                problem("malformed_json", number, f"malformed JSON ({err.msg}, column {err.colno})")
                continue
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                problem("missing_text", number, "no string 'text' field")
                continue
            if not record["text"].strip():
                stats.skipped["empty"] += 1
                continue
            meta = record.get("meta") or {}
            subset = meta.get("pile_set_name", "unknown") if isinstance(meta, dict) else "unknown"
            yield Document(record["text"], str(path), number, subset)
        elif text_mode == "lines":
            if line.strip():
                yield Document(line.rstrip("\n"), str(path), number, "text")
        else:  # paragraphs: blank-line-separated blocks
            if line.strip():
                if not paragraph:
                    paragraph_line = number
                paragraph.append(line)
            elif paragraph:
                yield Document("".join(paragraph).rstrip("\n"), str(path), paragraph_line, "text")
                paragraph = []
    if paragraph:
        yield Document("".join(paragraph).rstrip("\n"), str(path), paragraph_line, "text")


# ------------------------------------------------------------------------------------------------
# Tokenizing (optionally in worker processes; results keep input order)
# ------------------------------------------------------------------------------------------------

_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer


def _encode_chunk(texts: list[str]) -> list[np.ndarray]:
    return _WORKER_TOKENIZER.encode_batch(texts)


def _chunks(docs: Iterator[Document], size: int) -> Iterator[list[Document]]:
    chunk = []
    for doc in docs:
        chunk.append(doc)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def apply_long_policy(ids: np.ndarray, capacity: int, policy: str) -> tuple[list[np.ndarray], str]:
    """ids (with </s>) -> (pieces that fit a sample, action taken: kept/dropped/truncated/split)."""
    if len(ids) <= capacity:
        return [ids], "kept"
    if policy == "drop":
        return [], "dropped"
    if policy == "truncate":
        return [np.append(ids[: capacity - 1], EOS)], "truncated"
    return [ids[i:i + capacity] for i in range(0, len(ids), capacity)], "split"


# ------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------


class ShardWriter:
    """Deterministic tar shards (fixed mtime/owner) + index sidecars, renamed into place on close."""

    def __init__(self, out_dir: Path, split: str, max_tokens: int, dtype: np.dtype):
        self.out_dir, self.split, self.max_tokens, self.dtype = out_dir, split, max_tokens, dtype
        self.shards: list[dict] = []
        self._tar = None

    def _open(self) -> None:
        name = f"{self.split}-{len(self.shards):06d}"
        self._name, self._tmp = name, self.out_dir / f"{name}.tar.tmp"
        self._tar = tarfile.open(self._tmp, "w", format=tarfile.USTAR_FORMAT)
        self._index: list[tuple[int, int, int]] = []
        self._tokens = 0

    def _member(self, name: str, payload: bytes) -> int:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(payload), 0, 0o644
        data_offset = self._tar.offset + len(info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict"))
        self._tar.addfile(info, io.BytesIO(payload))
        return data_offset

    def add(self, key: str, ids: np.ndarray, meta: dict) -> None:
        if self._tar is None:
            self._open()
        buf = io.BytesIO()
        np.save(buf, ids.astype(self.dtype), allow_pickle=False)
        payload = buf.getvalue()
        offset = self._member(f"{key}.ids.npy", payload)
        self._member(f"{key}.json", json.dumps(meta, sort_keys=True).encode())
        self._index.append((offset, len(payload), len(ids)))
        self._tokens += len(ids)
        if self._tokens >= self.max_tokens:
            self.close()

    def close(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        index = np.asarray(self._index, dtype=np.int64).reshape(-1, 3)
        np.save(self.out_dir / f"{self._name}.idx.npy", index)
        path = self.out_dir / f"{self._name}.tar"
        os.replace(self._tmp, path)
        self.shards.append({"name": path.name, "documents": len(index),
                            "tokens": int(index[:, 2].sum()), "bytes": path.stat().st_size})
        self._tar = None


@dataclass
class BuildOptions:
    inputs: list[str]
    out_dir: str
    seq_length: int = 512
    long_docs: str = "drop"
    text_mode: str = "paragraphs"
    valid_fraction: float = 0.0
    shard_tokens: int = 20_000_000
    workers: int = 1
    seed: int = 1
    strict: bool = False

    def __post_init__(self):
        if self.long_docs not in LONG_DOC_POLICIES:
            raise ShardError(f"--long-docs {self.long_docs}; allowed: {', '.join(LONG_DOC_POLICIES)}")
        if self.text_mode not in ("lines", "paragraphs"):
            raise ShardError(f"--text-mode {self.text_mode}; allowed: lines, paragraphs")
        if not 0.0 <= self.valid_fraction < 1.0:
            raise ShardError(f"--valid-fraction {self.valid_fraction} must be in [0, 1)")
        if self.seq_length < 3:
            raise ShardError(f"--seq-length {self.seq_length} must be >= 3")
        for path in self.inputs:
            if not Path(path).is_file():
                raise ShardError(f"input not found: {path}")


def build_shards(options: BuildOptions, tokenizer: Tokenizer, progress: bool = True) -> dict:
    """Tokenize the inputs into shards under out_dir; returns the manifest."""
    from tqdm import tqdm

    out = Path(options.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "manifest.json").exists():
        raise ShardError(f"{out} already holds shards (manifest.json); choose an empty folder")
    dtype = np.uint16 if len(tokenizer.dictionary) <= np.iinfo(np.uint16).max + 1 else np.int32
    writers = {s: ShardWriter(out, s, options.shard_tokens, dtype) for s in ("train", "valid")}
    stats = BuildStats()
    capacity = options.seq_length - 1  # the sample's <s> takes one position
    split_rng = np.random.default_rng(options.seed)
    docs = (d for path in options.inputs
            for d in read_documents(Path(path), options.text_mode, stats, options.strict))
    pool = (get_context("spawn").Pool(options.workers, _init_worker, (tokenizer,))
            if options.workers > 1 else None)
    if pool is None:
        _init_worker(tokenizer)
    bar = tqdm(desc="tokenizing", unit=" docs", disable=not progress, file=sys.stderr)
    ordinal = 0
    queue: deque[list[Document]] = deque()  # chunks in flight, in input order

    def texts() -> Iterator[list[str]]:
        for chunk in _chunks(docs, 256):
            queue.append(chunk)
            yield [d.text for d in chunk]

    try:
        for encoded in (pool.imap if pool is not None else map)(_encode_chunk, texts()):
            chunk = queue.popleft()
            for doc, ids in zip(chunk, encoded):
                ids = np.append(ids, EOS)
                pieces, action = apply_long_policy(ids, capacity, options.long_docs)
                split = "valid" if split_rng.random() < options.valid_fraction else "train"
                subset = stats.per_subset[doc.subset]
                subset["documents"] += 1
                subset[action] += 1
                for part, piece in enumerate(pieces):
                    meta = {"source": doc.source, "line": doc.line, "subset": doc.subset,
                            "tokens": len(piece), "action": action, "part": part}
                    writers[split].add(f"{ordinal:010d}", piece, meta)
                    ordinal += 1
                    stats.documents[split] += 1
                    stats.tokens[split] += len(piece)
                    subset["tokens"] += len(piece)
            bar.update(len(chunk))
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    for writer in writers.values():
        writer.close()
    manifest = _manifest(options, tokenizer, writers, stats)
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / "manifest.json")
    return manifest


def _manifest(options: BuildOptions, tokenizer: Tokenizer, writers: dict, stats: BuildStats) -> dict:
    out = Path(options.out_dir)
    splits = {}
    for split, writer in writers.items():
        for shard in writer.shards:
            lengths = np.load(out / shard["name"].replace(".tar", ".idx.npy"))[:, 2]
            shard["blocks"] = {mode: len(plan_blocks(lengths, options.seq_length, mode))
                               for mode in BLOCK_MODES}
        if writer.shards:
            splits[split] = {"shards": writer.shards, "documents": stats.documents[split],
                             "tokens": stats.tokens[split]}
    return {
        "format": FORMAT_VERSION,
        "dictionary_sha256": tokenizer.dictionary.sha256,
        "dictionary_size": len(tokenizer.dictionary),
        "tokenizer_sha256": tokenizer.sha256,
        "seq_length": options.seq_length,
        # the recipe, not where or how fast it ran: same inputs + options -> identical bytes
        "options": {k: v for k, v in asdict(options).items() if k not in ("out_dir", "workers")},
        "splits": splits,
        "per_subset": {k: dict(v) for k, v in sorted(stats.per_subset.items())},
        "skipped": dict(stats.skipped),
    }


def summary_table(manifest: dict) -> str:
    """Per-subset counts as a table (printed after a build)."""
    rows = [f"{'subset':<24}{'documents':>11}{'tokens':>14}{'kept':>9}{'dropped':>9}"
            f"{'truncated':>11}{'split':>7}"]
    for name, c in manifest["per_subset"].items():
        rows.append(f"{name:<24}{c.get('documents', 0):>11,}{c.get('tokens', 0):>14,}"
                    f"{c.get('kept', 0):>9,}{c.get('dropped', 0):>9,}{c.get('truncated', 0):>11,}"
                    f"{c.get('split', 0):>7,}")
    for split, info in manifest["splits"].items():
        rows.append(f"{split}: {len(info['shards'])} shards, {info['documents']:,} stored documents, "
                    f"{info['tokens']:,} tokens")
    skipped = manifest["skipped"]
    rows.append("skipped inputs: " + (", ".join(f"{k} {v}" for k, v in sorted(skipped.items()))
                                      if skipped else "none"))
    return "\n".join(rows)


def ensure_shards(data, tokenizer: Tokenizer, progress: bool = True) -> Path:
    """data.shards, built from data.build_from first if it holds no finished build (call on one
    process; the others wait for it)."""
    if data.shards is None:
        raise ShardError("data.shards is not set: point it at a folder built by `megamlm shards build`")
    folder = Path(data.shards)
    if (folder / "manifest.json").exists():
        return folder
    if not data.build_from:
        raise ShardError(f"{folder}/manifest.json not found and data.build_from is empty: build the "
                         f"shards with `megamlm shards build ... --out {folder}`")
    if folder.exists():  # leftovers of an interrupted build
        for leftover in folder.glob("*"):
            leftover.unlink()
    manifest = build_shards(BuildOptions(inputs=list(data.build_from), out_dir=str(folder),
                                         seq_length=data.seq_length, long_docs=data.long_docs,
                                         text_mode=data.text_mode, valid_fraction=data.valid_fraction),
                            tokenizer, progress=progress)
    print(summary_table(manifest))
    return folder
