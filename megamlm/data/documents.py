"""Documents from the corpus files `megamlm shards build` reads: jsonl (the Pile's layout: "text"
and "meta.pile_set_name"), jsonl.zst (any number of zstd frames) and plain text (one document per
blank-line-separated paragraph, or per line). Problems in a line (malformed JSON, no "text", empty,
invalid UTF-8) are counted in `BuildStats.skipped`, the first of each kind kept with its file, line and
what is wrong (the build's summary and manifest show it), or fatal with `strict`; a damaged file (a
truncated or corrupt zstd stream) is always an error naming it."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from megamlm.errors import MegamlmError


class ShardError(MegamlmError):
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
    first_skipped: dict = field(default_factory=dict)    # kind -> "file:line: what", the first of each kind

    def skip(self, kind: str, source: Path, line: int, detail: str) -> str:
        """Count a skipped line; its "file:line: what" (kept for the first of its kind)."""
        where = f"{source}:{line}: {detail}"
        self.skipped[kind] += 1
        self.first_skipped.setdefault(kind, where)
        return where


def skipped_summary(counts: dict, first: dict) -> str:
    """Each kind's count and first line, "missing_text 2 (first at bad.jsonl:2: no string 'text' field
    (keys: content)), ...", or "none" (a manifest from before `first_skipped` has the counts only)."""
    return ", ".join(f"{kind} {n}" + (f" (first at {first[kind]})" if kind in first else "")
                     for kind, n in sorted(counts.items())) or "none"


def _zstd_lines(path: Path, chunk: int = 1 << 20) -> Iterator[bytes]:
    """Lines of a (multi-frame) zstd file; a file that ends inside a frame is an error, never a
    silently shorter input."""
    import zstandard

    pending, started = b"", False
    decompressor = zstandard.ZstdDecompressor().decompressobj()
    with open(path, "rb") as raw:
        while data := raw.read(chunk):
            while data:
                try:
                    pending += decompressor.decompress(data)
                except zstandard.ZstdError as err:
                    raise ShardError(f"{path}: corrupt zstd data ({err})") from None
                started = True
                data = b""
                if decompressor.eof:  # next frame
                    data = decompressor.unused_data
                    decompressor, started = zstandard.ZstdDecompressor().decompressobj(), False
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line + b"\n"
    if started:
        raise ShardError(f"{path}: truncated zstd file (it ends inside a compressed frame); "
                         f"re-download or re-compress it")
    if pending:
        yield pending


def _binary_lines(path: Path) -> Iterator[bytes]:
    if path.name.endswith(".zst"):
        yield from _zstd_lines(path)
    else:
        with open(path, "rb") as f:
            yield from f


def read_documents(path: Path, text_mode: str, stats: BuildStats, strict: bool) -> Iterator[Document]:
    """Documents of one input file; problems are counted (or fatal with strict)."""

    def problem(kind: str, line: int, detail: str) -> None:
        where = stats.skip(kind, path, line, detail)
        if strict:
            raise ShardError(where)

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
                # what the record holds instead: a corpus whose text is under another key shows it at once
                holds = (f"a JSON {type(record).__name__}, not an object" if not isinstance(record, dict)
                         else f"its 'text' is {json.dumps(record['text'])[:40]}" if "text" in record
                         else f"keys: {', '.join(list(record)[:8]) or 'none'}")
                problem("missing_text", number, f"no string 'text' field ({holds})")
                continue
            if not record["text"].strip():
                stats.skip("empty", path, number, "blank 'text'")  # not an error, even with strict
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
