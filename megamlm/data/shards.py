"""Build webdataset shards of token ids from jsonl or plain text, compressed (zstd, gzip, bzip2, xz) or not.

Output folder:
  train-000000.tar ...   webdataset tar: per document `<key>.ids.npy` (uint16 ids, or int32 for
                         dictionaries above 65535 symbols, `</s>` included) and `<key>.json`
                         (source file, line, Pile subset, tokens, long-document action)
  train-000000.idx.npy   [n_docs, 4] int64: data offset and size of each ids member, token count,
                         CRC-32 of the member's bytes; lets readers plan epochs, seek without
                         scanning the tar and detect damaged documents (format 1: 3 columns, no CRC)
  valid-*.tar ...        with --valid-fraction
  manifest.json          per shard its size and the index's sha256; written last

The build happens in a hidden sibling folder that is renamed to the output folder when it is
complete, so an interrupted build leaves the output folder as it was. The output folder must be new
or empty: the builder never deletes or overwrites anything it did not write.

Documents longer than a sample (`n + 1 > seq_length - 1` with `</s>`; the reference keeps
n <= 2046 at 2048) are dropped (the reference), truncated or split, and counted per Pile subset.
Malformed lines, missing "text", empty documents and invalid UTF-8 are counted, never silent.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import typing
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from megamlm.config import DataConfig
from megamlm.console import print_line
from megamlm.data.blocks import BLOCK_MODES, plan_blocks
from megamlm.data.documents import (BuildStats, Problem, ShardError, check_input, corpus_paths, document_lines,
                                    skip, skipped_summary)
from megamlm.data.progress import progress_bar
from megamlm.data.shard_writer import ShardWriter, StoredPieces, meta_json
from megamlm.data.tokenizer import Tokenizer
from megamlm.data.tokenizing import encoded_chunks
from megamlm.errors import check_ranges
from megamlm.files import check_writable, staging_sibling

__all__ = ["BuildOptions", "ShardError", "build_shards", "ensure_shards", "summary_table"]

LONG_DOC_POLICIES = typing.get_args(typing.get_type_hints(DataConfig)["long_docs"])
TEXT_MODES = typing.get_args(typing.get_type_hints(DataConfig)["text_mode"])
FORMAT_VERSION = 2
STAGING_MARKER = ".megamlm-building"  # in a staging folder: "<host> <pid>" of the builder


@dataclass
class BuildOptions:
    """What `megamlm shards build` and data.build_from build; the defaults of the fields that the
    data section also has are that section's (config/sections.py DataConfig)."""

    inputs: list[str]
    out_dir: str
    seq_length: int = DataConfig.seq_length
    long_docs: str = DataConfig.long_docs
    text_mode: str = DataConfig.text_mode
    valid_fraction: float = DataConfig.valid_fraction
    shard_tokens: int = 20_000_000
    workers: int = 1
    seed: int = 1
    strict: bool = False

    def __post_init__(self):
        if self.long_docs not in LONG_DOC_POLICIES:
            raise ShardError(f"--long-docs {self.long_docs}; allowed: {', '.join(LONG_DOC_POLICIES)}")
        if self.text_mode not in TEXT_MODES:
            raise ShardError(f"--text-mode {self.text_mode}; allowed: {', '.join(TEXT_MODES)}")
        if not 0.0 <= self.valid_fraction < 1.0:
            raise ShardError(f"--valid-fraction {self.valid_fraction} must be in [0, 1)")
        check_ranges([(f"--seq-length {self.seq_length}", self.seq_length, ">= 3"),
                      (f"--shard-tokens {self.shard_tokens}", self.shard_tokens, ">= 1"),
                      (f"--workers {self.workers}", self.workers, ">= 1")], ShardError)
        out = Path(self.out_dir).absolute()
        self.inputs = corpus_paths(self.inputs)  # the manifest names the files a pattern matched
        for path in self.inputs:
            check_input(path)
            if out in Path(path).absolute().parents:
                raise ShardError(f"input {path} is inside the output folder {self.out_dir}: the shards "
                                 f"need a folder of their own (e.g. {self.out_dir}-shards)")


def build_shards(options: BuildOptions, tokenizer: Tokenizer, progress: bool = True) -> dict:
    """Tokenize the inputs into shards under out_dir; returns the manifest."""
    final = Path(options.out_dir)
    with staging_sibling(final, lambda: _check_shard_folder(final), "building") as out:
        (out / STAGING_MARKER).write_text(f"{socket.gethostname()} {os.getpid()}")
        manifest = _build(options, tokenizer, out, progress)
        (out / STAGING_MARKER).unlink()
    return manifest


def _check_shard_folder(folder: Path) -> None:
    """The shard builder writes only into a new or empty folder."""
    if folder.exists() and not folder.is_dir():
        raise ShardError(f"output {folder} is a file, not a folder")
    if (folder / "manifest.json").exists():
        raise ShardError(f"{folder} already holds shards (manifest.json); choose an empty folder")
    if folder.is_dir() and any(folder.iterdir()):
        names = sorted(p.name for p in folder.iterdir())
        raise ShardError(f"{folder} is not empty and holds no finished shard build ({', '.join(names[:5])}"
                         f"{f' and {len(names) - 5} more' if len(names) > 5 else ''}); choose a new or "
                         f"empty folder (megamlm never deletes files it did not write)")
    check_writable(folder, "shard folder")


def _build(options: BuildOptions, tokenizer: Tokenizer, out: Path, progress: bool) -> dict:
    """Tokenize and write every shard and the manifest into `out`."""
    dtype = np.uint16 if len(tokenizer.dictionary) <= np.iinfo(np.uint16).max + 1 else np.int32
    writers = {s: ShardWriter(out, s, options.shard_tokens) for s in ("train", "valid")}
    stats = BuildStats()
    # the sample's <s> takes one position
    stored = StoredPieces(options.seq_length - 1, options.long_docs, np.dtype(dtype).str)
    split_rng = np.random.default_rng(options.seed)
    docs = (d for path in options.inputs
            for d in document_lines(Path(path), options.text_mode, stats, options.strict))
    bar = progress_bar(desc="tokenizing", unit=" docs", enabled=progress)
    ordinal = 0
    told: set[str] = set()  # kinds of skipped line already shown
    try:
        for chunk, prepared in encoded_chunks(docs, tokenizer, stored, options.workers):
            found = []  # (document, its subset, what is stored of it)
            for doc, result in zip(chunk, prepared):
                if isinstance(result, Problem):
                    skip(stats, doc.source, doc.line, result, options.strict)
                elif result is not None:
                    found.append((doc, doc.subset if result[0] is None else result[0], result[1]))
            # one draw per document in input order, as many calls of split_rng.random() would draw
            valid = split_rng.random(len(found)) < options.valid_fraction
            for (doc, subset_name, (action, pieces)), in_valid in zip(found, valid):
                split = "valid" if in_valid else "train"
                subset = stats.per_subset[subset_name]
                subset["documents"] += 1
                subset[action] += 1
                for part, piece in enumerate(pieces):
                    tokens = piece[1]
                    writers[split].add(f"{ordinal:010d}", piece,
                                       meta_json(doc.source, doc.line, subset_name, tokens, action, part))
                    ordinal += 1
                    stats.documents[split] += 1
                    stats.tokens[split] += tokens
                    subset["tokens"] += tokens
            bar.update(len(found))
            for kind in sorted(stats.first_skipped.keys() - told) if progress else ():  # as a long build meets it
                told.add(kind)
                bar.write(f"skipping {kind} lines, the first at {stats.first_skipped[kind]}", file=sys.stderr)
    finally:
        bar.close()
    for writer in writers.values():
        writer.close()
    if not sum(stats.documents.values()):
        raise ShardError(_nothing_stored(options, stats))
    manifest = _manifest(options, tokenizer, writers, stats, out)
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / "manifest.json")
    return manifest


def _nothing_stored(options: BuildOptions, stats: BuildStats) -> str:
    """Why a build stored no document: no line was one, or every document was too long to keep."""
    inputs = ", ".join(options.inputs)
    dropped = sum(subset["dropped"] for subset in stats.per_subset.values())
    if not dropped:
        return (f"no documents in {inputs} (skipped lines: {skipped_summary(stats.skipped, stats.first_skipped)}); "
                f"nothing to write")
    paragraphs = options.text_mode == "paragraphs" and "text" in stats.per_subset
    return (f"no documents stored from {inputs}: all {dropped:,} are longer than a sample (--seq-length "
            f"{options.seq_length}: {options.seq_length - 2} tokens, </s> and <s>) and --long-docs drop drops them; "
            f"--long-docs split or truncate keeps them" + (
                " (plain text is one document per blank-line-separated paragraph; --text-mode lines makes each "
                "line one)" if paragraphs else ""))


def _manifest(options: BuildOptions, tokenizer: Tokenizer, writers: dict, stats: BuildStats,
              out: Path) -> dict:
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
        "first_skipped": dict(sorted(stats.first_skipped.items())),
    }


def summary_table(manifest: dict, splits: bool = True) -> str:
    """Per-subset counts as a table, then (`splits`) a line per split and the skipped inputs (printed after a
    build)."""
    rows = [f"{'subset':<24}{'documents':>11}{'tokens':>14}{'kept':>9}{'dropped':>9}"
            f"{'truncated':>11}{'split':>7}"]
    for name, c in manifest["per_subset"].items():
        rows.append(f"{name:<24}{c.get('documents', 0):>11,}{c.get('tokens', 0):>14,}"
                    f"{c.get('kept', 0):>9,}{c.get('dropped', 0):>9,}{c.get('truncated', 0):>11,}"
                    f"{c.get('split', 0):>7,}")
    for split, info in manifest["splits"].items() if splits else ():
        rows.append(f"{split}: {len(info['shards'])} shards, {info['documents']:,} stored documents, "
                    f"{info['tokens']:,} tokens")
    rows.append("skipped inputs: " + skipped_summary(manifest["skipped"], manifest.get("first_skipped", {})))
    return "\n".join(rows)


BUILD_CHOICES = ("seq_length", "long_docs", "text_mode", "valid_fraction")
"""The data section's keys a build records (manifest "options") that change what the shards hold."""


def planned_build(data) -> BuildOptions | None:
    """How data.shards is to be built from data.build_from (its inputs checked), or None when it holds a
    finished build."""
    if data.shards is None:
        raise ShardError("data.shards is not set: point it at a folder built by `megamlm shards build`")
    folder = Path(data.shards)
    if (folder / "manifest.json").exists():
        return None
    if not data.build_from:
        raise ShardError(f"{folder}/manifest.json not found and data.build_from is empty: build the "
                         f"shards with `megamlm shards build ... --out {folder}`")
    return BuildOptions(inputs=list(data.build_from), out_dir=str(folder),
                        **{key: getattr(data, key) for key in BUILD_CHOICES})


def other_build(data) -> str | None:
    """A line when data.shards holds a finished build of other choices (BUILD_CHOICES, the inputs' names)
    than data.build_from with the data section would make: it is used as it is (a finished build is never
    redone); None when they agree or nothing would be built."""
    folder = Path(data.shards or "")
    if not data.build_from or not (folder / "manifest.json").is_file():
        return None
    try:
        built = json.loads((folder / "manifest.json").read_text())["options"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # reading the shards names what is wrong with the manifest
    try:
        inputs = corpus_paths(data.build_from)
    except ShardError:  # a pattern that matches nothing now: the build's own inputs are what counts
        inputs = data.build_from
    asked = {**{key: getattr(data, key) for key in BUILD_CHOICES}, "inputs": [Path(i).name for i in inputs]}
    built = {**built, "inputs": [Path(i).name for i in built.get("inputs", [])]}
    differ = [f"{key} {built.get(key)} (asked: {asked[key]})" for key in asked if built.get(key) != asked[key]]
    if not differ:
        return None
    return (f"data.shards={folder} holds a build of other choices than the config's: {', '.join(differ)}; the run "
            f"uses it as it is (to build anew, point data.shards at a new folder)")


def ensure_shards(data, tokenizer: Tokenizer, progress: bool = True) -> Path:
    """data.shards, built from data.build_from first if it holds no finished build (call on one
    process; the others wait for it)."""
    options, folder = planned_build(data), Path(data.shards)
    if options is None:
        return folder
    remove_stale_staging(folder)
    try:
        manifest = build_shards(options, tokenizer, progress=progress)
    except ShardError:
        if not (folder / "manifest.json").exists():
            raise
        # another job on the same data.shards finished its build first (builds are deterministic): as if
        # it had been there at the start, instead of failing with "already holds shards" after the work
        print_line(f"{folder}: built meanwhile by another process; using that build")
        return folder
    print_line(summary_table(manifest))
    return folder


def remove_stale_staging(folder: Path) -> None:
    """Remove staging folders of builds of `folder` that were killed (their builder process, on
    this host, no longer exists). Only folders carrying our marker are touched."""
    for staging in folder.parent.glob(f".{folder.name}.building-*"):
        try:
            host, pid = (staging / STAGING_MARKER).read_text().split()
        except (OSError, ValueError):
            continue
        if host != socket.gethostname():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(staging, ignore_errors=True)
        except OSError:
            pass
