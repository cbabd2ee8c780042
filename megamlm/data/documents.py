"""Documents from the corpus files `megamlm shards build` reads: jsonl (the Pile's layout: "text" and
"meta.pile_set_name") and plain text (one document per blank-line-separated paragraph, or per line), either one
compressed or not (data/compression.py: zstd with any number of frames, gzip, bzip2, xz), and Parquet (a "text"
column: data/parquet_files.py). Problems in a line (malformed JSON, no "text", empty, invalid UTF-8) are counted
in `BuildStats.skipped`, the first of each kind kept with its file, line and what is wrong (the build's summary
and manifest show it), or fatal with `strict`; a damaged file (a truncated or corrupt compressed stream) is
always an error naming it."""

from __future__ import annotations

import glob
import json
import queue
import threading
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from megamlm.data.compression import codec_of, text_head
from megamlm.data.parquet_files import check_parquet, is_parquet, parquet_rows
from megamlm.data.progress import progress_bar
from megamlm.errors import MegamlmError


class ShardError(MegamlmError):
    """Bad input for the shard builder or reader (message names the file and line)."""


@dataclass
class Document:
    text: str | bytes
    """The document's text, or (subset None) its jsonl line's bytes, unparsed (`json_document`)."""
    source: str
    line: int
    subset: str | None


@dataclass
class BuildStats:
    documents: Counter = field(default_factory=Counter)  # per split
    tokens: Counter = field(default_factory=Counter)     # per split
    per_subset: dict = field(default_factory=lambda: defaultdict(Counter))
    skipped: Counter = field(default_factory=Counter)    # malformed_json, missing_text, empty, invalid_utf8
    first_skipped: dict = field(default_factory=dict)    # kind -> "file:line: what", the first of each kind

    def skip(self, kind: str, source: Path | str, line: int, detail: str) -> str:
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


READ_AHEAD_BLOCKS = 4
"""Decompressed blocks (of ~1 MB of input each) a reader thread keeps ready."""


def read_ahead(blocks: Iterator[bytes], depth: int = READ_AHEAD_BLOCKS) -> Iterator[bytes]:
    """`blocks`, made on a thread of their own up to `depth` ahead: zstandard (and zlib, bz2, lzma) decompress
    without the GIL, so a build's process writes shards meanwhile (decompressing zstd was ~25% of its time at
    the Pile's document sizes). What the blocks raise is raised here, in order; a consumer that stops early
    stops the thread."""
    ready: queue.Queue = queue.Queue(depth)
    stop = threading.Event()

    def offer(item: tuple) -> bool:
        """Put `item` once there is room; False when the consumer stopped first."""
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for block in blocks:
                if not offer((block, None)):
                    return
            offer((None, None))
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, which raises it
            offer((None, err))

    thread = threading.Thread(target=produce, name="megamlm-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            block, err = ready.get()
            if err is not None:
                raise err
            if block is None:
                return
            yield block
    finally:
        stop.set()
        thread.join()


def _lines(blocks: Iterator[bytes]) -> Iterator[bytes]:
    """The lines (each with its newline; the last one may lack it) of a file given as blocks of its bytes."""
    pending = b""
    for block in blocks:
        *lines, pending = (pending + block).split(b"\n")
        for line in lines:
            yield line + b"\n"
    if pending:
        yield pending


def _binary_lines(path: Path) -> Iterator[bytes]:
    """The lines of a file's content, decompressed (compression.CODECS) on a thread of their own."""
    if codec := codec_of(path):
        yield from _lines(read_ahead(codec.blocks(path)))
    else:
        with open(path, "rb") as f:
            yield from f


class Problem(NamedTuple):
    """Why a line is not a document: its kind (a BuildStats.skipped key) and what is wrong."""

    kind: str
    detail: str

    @property
    def fatal(self) -> bool:
        """An error with --strict (a blank 'text' is never one)."""
        return self.kind != "empty"


def decoded(raw: bytes) -> str | Problem:
    """A line's text, or the Problem of its bytes that are not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return Problem("invalid_utf8", f"invalid UTF-8 ({err.reason} at byte {err.start})")


def json_document(raw: bytes) -> tuple[str, str] | Problem | None:
    """A jsonl line -> (its text, its Pile subset), the Problem that makes it no document, or None for a blank
    line. Picklable and pure, so that it runs where the document is tokenized (data/tokenizing.py): parsing a
    Pile document's JSON (~13 us at 4.5 kB) was the largest part of a build's serial process."""
    line = decoded(raw)
    if isinstance(line, Problem):
        return line
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        return Problem("malformed_json", f"malformed JSON ({err.msg}, column {err.colno})")
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        # what the record holds instead: a corpus whose text is under another key shows it at once
        holds = (f"a JSON {type(record).__name__}, not an object" if not isinstance(record, dict)
                 else f"its 'text' is {json.dumps(record['text'])[:40]}" if "text" in record
                 else f"keys: {', '.join(list(record)[:8]) or 'none'}")
        return Problem("missing_text", f"no string 'text' field ({holds})")
    if not record["text"].strip():
        return Problem("empty", "blank 'text'")
    return record["text"], pile_subset(record.get("meta"))


def pile_subset(meta) -> str:
    """A document's Pile subset from its metadata (a jsonl line's "meta", a Parquet row's): its `pile_set_name`,
    "unknown" where it has none (or null: a Parquet struct column has every field in every row). A Parquet
    file may hold the metadata as a JSON string."""
    if isinstance(meta, str):
        try:
            meta = json.loads(meta)
        except json.JSONDecodeError:
            return "unknown"
    subset = meta.get("pile_set_name") if isinstance(meta, dict) else None
    if subset is None:
        return "unknown"
    # a subset that is not a string (a number, a list) is named by its JSON: a list was a traceback
    return subset if isinstance(subset, str) else json.dumps(subset)


def is_jsonl(path: Path) -> bool:
    return ".jsonl" in path.name or ".json" in path.suffixes


def holds_documents(path: Path) -> bool:
    """A jsonl or Parquet file: documents with a "text" each, not lines of plain text."""
    return is_jsonl(path) or is_parquet(path)


def document_lines(path: Path, text_mode: str, stats: BuildStats, strict: bool) -> Iterator[Document]:
    """The documents of one input file, those of a jsonl file unparsed: their `text` is the line's bytes and
    their subset None, for `json_document` to parse; a plain-text file's lines and a Parquet file's rows are
    read here (problems counted or, with strict, fatal: `skip`)."""
    source = str(path)
    if is_parquet(path):
        for row, text, meta in parquet_rows(path):
            if text is None or not text.strip():
                skip(stats, path, row, Problem("missing_text", "null 'text'") if text is None
                     else Problem("empty", "blank 'text'"), strict)
            else:
                yield Document(text, source, row, pile_subset(meta))
        return
    if is_jsonl(path):
        for number, raw in enumerate(_binary_lines(path), 1):
            yield Document(raw, source, number, None)
        return
    paragraph: list[str] = []
    paragraph_line = 1
    for number, raw in enumerate(_binary_lines(path), 1):
        line = decoded(raw)
        if isinstance(line, Problem):
            skip(stats, path, number, line, strict)
            continue
        if text_mode == "lines":
            if line.strip():
                yield Document(line.rstrip("\n"), source, number, "text")
        else:  # paragraphs: blank-line-separated blocks
            if line.strip():
                if not paragraph:
                    paragraph_line = number
                paragraph.append(line)
            elif paragraph:
                yield Document("".join(paragraph).rstrip("\n"), source, paragraph_line, "text")
                paragraph = []
    if paragraph:
        yield Document("".join(paragraph).rstrip("\n"), source, paragraph_line, "text")


def skip(stats: BuildStats, path: Path | str, line: int, problem: Problem, strict: bool) -> None:
    """Count a line that is no document; with strict, a fatal problem ends the build naming it."""
    where = stats.skip(problem.kind, path, line, problem.detail)
    if strict and problem.fatal:
        raise ShardError(where)


def parsed(doc: Document, stats: BuildStats, strict: bool) -> Document | None:
    """`doc` as read (document_lines), its jsonl line parsed; None when the line is no document (a Problem is
    counted, as `skip`)."""
    if doc.subset is not None:
        return doc
    result = json_document(doc.text)
    if isinstance(result, Problem):
        skip(stats, doc.source, doc.line, result, strict)
        return None
    return None if result is None else Document(result[0], doc.source, doc.line, result[1])


def read_documents(path: Path, text_mode: str, stats: BuildStats, strict: bool) -> Iterator[Document]:
    """Documents of one input file, parsed; problems are counted (or fatal with strict)."""
    for doc in document_lines(path, text_mode, stats, strict):
        if (doc := parsed(doc, stats, strict)) is not None:
            yield doc


def corpus_paths(entries: list[str | Path]) -> list[str]:
    """The files `entries` name, in order: each a path, or a glob pattern (`pile/train/*.jsonl.zst`, `**` for any
    depth of folders) expanded to its files in sorted order, as a shell would (a config's data.build_from, a quoted
    argument, is no shell); a pattern that matches no file is an error. A file whose name holds `*?[` is itself."""
    paths = []
    for entry in map(str, entries):
        if not any(c in entry for c in "*?[") or Path(entry).exists():
            paths.append(entry)
            continue
        files = [match for match in sorted(glob.glob(entry, recursive=True)) if Path(match).is_file()]
        if not files:
            raise ShardError(f"input pattern {entry} matches no file{_read_from(entry)}")
        paths += files
    return paths


def _read_from(path: str | Path) -> str:
    """Where a relative path is read from (the working directory of the command), for a message."""
    return "" if Path(path).is_absolute() else f" (relative to the working directory {Path.cwd()})"


def check_input(path: str | Path) -> None:
    """Raise ShardError (or compression.InputError) naming `path` unless it is a readable corpus file: one that
    exists, is no folder and holds text (compression.text_head); a jsonl file's must be JSON lines, one object
    per line, not a JSON array or pretty-printed JSON (each of whose lines would be skipped as malformed)."""
    file = Path(path)  # the messages name `path` as it was given
    if file.is_dir():
        raise ShardError(f"input {path} is a directory; pass the files in it")
    if not file.is_file():
        raise ShardError(f"input not found: {path}{_read_from(path)}")
    if is_parquet(file):
        return check_parquet(file)
    head = text_head(file)
    first = next((line.strip() for line in head.split(b"\n") if line.strip()), b"")
    if is_jsonl(file) and (first.startswith(b"[") or first == b"{"):
        shape, flatten = ("a JSON array", "'.[]'") if first.startswith(b"[") else ("pretty-printed JSON", ".")
        raise ShardError(f"input {path} is {shape}, not JSON lines (one object per line, each with its \"text\"); "
                         f"`jq -c {flatten}` writes them")
    if not is_jsonl(file) and first.startswith(b"{") and not isinstance(json_document(first), Problem):
        warnings.warn(f"input {path} is read as plain text (its name has no .jsonl or .json), but its first line is "
                      f"a JSON object with a \"text\": name it *.jsonl to read each line's text instead of its JSON")


def text_lines(paths: list[str | Path], stats: BuildStats) -> Iterator[str]:
    """The text of corpus files as a tokenizer is trained on it: a plain file's lines, a jsonl file's documents'
    lines (their "text", not the JSON around it), each with its newline, decompressed; the lines that are no
    text (invalid UTF-8, malformed JSON...) are counted in `stats`, as a shard build counts them."""
    for path in map(Path, paths):
        if holds_documents(path):
            for doc in read_documents(path, "lines", stats, strict=False):
                *lines, last = doc.text.split("\n")
                yield from (line + "\n" for line in lines)
                if last:
                    yield last
            continue
        for number, raw in enumerate(_binary_lines(path), 1):
            line = decoded(raw)
            if isinstance(line, Problem):
                skip(stats, path, number, line, strict=False)
            else:
                yield line


def train_tokenizer_on(paths: list[str | Path], train: Callable[[Iterator[str]], None]) -> None:
    """Run `train` (a `tokenizers` trainer's train_from_iterator) on the files' text_lines: every input checked
    before any work (check_input), the skipped lines warned of, no text at all an error."""
    for path in paths:
        check_input(path)
    stats, seen = BuildStats(), Counter()

    def counted() -> Iterator[str]:
        for line in progress_bar(text_lines(paths, stats), desc="training", unit=" lines"):
            seen["lines"] += 1
            yield line

    train(counted())
    skipped = skipped_summary(stats.skipped, stats.first_skipped)
    if not seen:
        raise ShardError(f"no text in {', '.join(map(str, paths))} (skipped lines: {skipped})")
    if stats.skipped:
        warnings.warn(f"trained on {seen['lines']:,} lines; skipped: {skipped}")
