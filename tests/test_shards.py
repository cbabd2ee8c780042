"""Shard builder: round trip (our reader and the webdataset library), counts, long-document
policies at the reference's boundary, determinism, and bad input that is counted, not lost."""

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from megamlm.cli import main as cli
from megamlm.data.documents import BuildStats, read_documents
from megamlm.data.shards import BuildOptions, ShardError, build_shards, summary_table
from megamlm.data.stream import ShardSet
from megamlm.data.tokenizer import EOS, Tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpt2():
    return Tokenizer.gpt2()


def a_tokens(n):
    """A text of exactly n GPT-2 tokens ('a' then ' a' n-1 times)."""
    return "a" + " a" * (n - 1)


def write_jsonl(path, records, raw_lines=()):
    lines = [json.dumps(r) for r in records] + list(raw_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def stored_documents(folder, split="train"):
    shards = ShardSet(folder, split)
    docs = []
    for i in range(len(shards.shards)):
        starts = shards.doc_starts(i)
        docs += [shards.read_tokens(i, int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]
    return docs


def test_round_trip_and_manifest_counts(tmp_path, gpt2):
    text = (ROOT / "data/wikitext-103/valid.txt").read_text()
    out = tmp_path / "shards"
    manifest = build_shards(BuildOptions([str(ROOT / "data/wikitext-103/valid.txt")], str(out),
                                         seq_length=256, long_docs="split", shard_tokens=50_000,
                                         valid_fraction=0.0),
                            gpt2, progress=False)
    docs = stored_documents(out)
    # brute-force recount: paragraphs of the file, each tokenized + </s>, split at 255 tokens
    paragraphs = [re.sub(r"^(?:[ \t]*\n)+", "", p).rstrip("\n")
                  for p in re.split(r"\n[ \t]*\n", text) if p.strip()]
    expected = []
    for p in paragraphs:
        ids = np.append(gpt2.encode(p), EOS)
        expected += [ids[i:i + 255] for i in range(0, len(ids), 255)]
    assert len(docs) == len(expected) == manifest["splits"]["train"]["documents"]
    assert all(np.array_equal(a, b) for a, b in zip(docs, expected))
    assert sum(map(len, docs)) == manifest["splits"]["train"]["tokens"] == manifest["per_subset"]["text"]["tokens"]
    assert len(manifest["splits"]["train"]["shards"]) > 3
    assert manifest["dictionary_sha256"] == gpt2.dictionary.sha256
    # the same shards read by the webdataset library
    urls = [str(out / s["name"]) for s in manifest["splits"]["train"]["shards"]]
    samples = list(wds.WebDataset(urls, shardshuffle=False).decode())
    assert len(samples) == len(docs)
    assert all(np.array_equal(s["ids.npy"], d) for s, d in zip(samples, docs))
    assert samples[0]["json"]["source"].endswith("valid.txt") and samples[0]["ids.npy"].dtype == np.uint16


@pytest.mark.parametrize("policy,kept,stored_lengths", [
    ("drop", {"kept": 1, "dropped": 1}, [2047]),
    ("truncate", {"kept": 1, "truncated": 1}, [2047, 2047]),
    ("split", {"kept": 1, "split": 1}, [2047, 2047, 1]),
])
def test_long_documents_at_the_reference_boundary(tmp_path, gpt2, policy, kept, stored_lengths):
    # at length 2048 a document of 2046 BPE tokens (+ </s> = 2047) fits, one of 2047 does not
    src = write_jsonl(tmp_path / "docs.jsonl", [
        {"text": a_tokens(2046), "meta": {"pile_set_name": "Pile-CC"}},
        {"text": a_tokens(2047), "meta": {"pile_set_name": "Github"}},
    ])
    out = tmp_path / policy
    manifest = build_shards(BuildOptions([str(src)], str(out), seq_length=2048, long_docs=policy, valid_fraction=0.0),
                            gpt2, progress=False)
    assert [len(d) for d in stored_documents(out)] == stored_lengths
    subsets = manifest["per_subset"]
    assert subsets["Pile-CC"]["kept"] == 1
    counted = {k: sum(s.get(k, 0) for s in subsets.values()) for k in kept}
    assert counted == kept
    if policy == "truncate":
        assert stored_documents(out)[1][-1] == EOS



def test_a_build_that_drops_every_document_says_so_not_no_documents(tmp_path, gpt2):
    """Every document too long for --long-docs drop: named as that, with the way to keep them (it said "no
    documents ... skipped lines: none", as if the files were empty)."""
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": a_tokens(2047)}, {"text": a_tokens(3000)}])
    text = tmp_path / "book.txt"
    text.write_text("".join(f"line {i} of a book written without blank lines\n" for i in range(300)))
    for path, hint in [(src, ""), (text, " (plain text is one document per blank-line-separated paragraph; "
                                         "--text-mode lines makes each line one)")]:
        with pytest.raises(ShardError) as err:
            build_shards(BuildOptions([str(path)], str(tmp_path / "out"), seq_length=2048), gpt2, progress=False)
        count = 2 if path == src else 1
        assert str(err.value) == (f"no documents stored from {path}: all {count} are longer than a sample "
                                  f"(--seq-length 2048: 2046 tokens, </s> and <s>) and --long-docs drop drops "
                                  f"them; --long-docs split or truncate keeps them{hint}")
        assert not (tmp_path / "out").exists()
    build_shards(BuildOptions([str(text)], str(tmp_path / "out"), seq_length=2048, text_mode="lines"), gpt2,
                 progress=False)
    assert len(stored_documents(tmp_path / "out")) + len(stored_documents(tmp_path / "out", "valid")) == 300


def test_output_is_deterministic_for_any_worker_count(tmp_path, gpt2):
    inputs = [str(ROOT / "data/wikitext-103/test.txt")]
    folders = []
    for workers in (1, 2, 1):
        out = tmp_path / f"w{workers}-{len(folders)}"
        build_shards(BuildOptions(inputs, str(out), seq_length=128, long_docs="split",
                                  valid_fraction=0.1, shard_tokens=100_000, workers=workers),
                     gpt2, progress=False)
        folders.append(out)
    names = sorted(p.name for p in folders[0].iterdir())
    assert any(n.startswith("valid-") for n in names)
    for other in folders[1:]:
        assert sorted(p.name for p in other.iterdir()) == names
        for name in names:
            assert (other / name).read_bytes() == (folders[0] / name).read_bytes(), name


@pytest.mark.parametrize("name,size", [("0000000000.ids.npy", 0), ("0000012345.json", 511), ("x" * 100, 512),
                                       ("0000000007.ids.npy", 8_589_934_591)])
def test_the_writers_tar_headers_and_arrays_are_tarfiles_and_numpys_bytes(name, size):
    """ShardWriter builds members itself (tarfile's header took ~60 us of Python, twice per member): the bytes
    are those of tarfile's USTAR header and of np.save, so a build writes the same shards as before."""
    import io
    import tarfile

    from megamlm.data.shard_writer import npy_bytes, ustar_header

    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, 0o644
    assert ustar_header(name, size) == info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")
    with pytest.raises(ValueError, match="over 100 bytes"):
        ustar_header("x" * 101, 1)
    for ids in (np.arange(size % 1000, dtype=np.uint16), np.arange(70_000, 70_000 + size % 77, dtype=np.int32)):
        buf = io.BytesIO()
        np.save(buf, ids, allow_pickle=False)
        assert npy_bytes(ids) == buf.getvalue()


@pytest.mark.parametrize("source,subset", [("pile/00.jsonl.zst", "Pile-CC"), ('odd "name"\\ é\t.jsonl', "ünï\u2028"),
                                           ("", "")])
def test_a_pieces_json_member_is_json_dumps_bytes(source, subset):
    """meta_json formats the member from strings quoted once (json.dumps of a dict per piece was ~5 us of the
    build's serial part): the bytes are json.dumps' with sorted keys, for any file name and subset."""
    from megamlm.data.shard_writer import meta_json

    for line, tokens, action, part in [(1, 0, "kept", 0), (123_456_789, 2047, "split", 3), (7, 5, "truncated", 0)]:
        meta = {"source": source, "line": line, "subset": subset, "tokens": tokens, "action": action, "part": part}
        assert meta_json(source, line, subset, tokens, action, part) == json.dumps(meta, sort_keys=True).encode()


def test_a_tokenizer_worker_that_dies_ends_the_build_with_one_line_and_leaves_nothing(tmp_path, gpt2, monkeypatch):
    """A worker killed mid-build (the out-of-memory killer): multiprocessing.Pool replaced it and waited for
    its chunk forever (a --workers 2 build hung at 0% CPU, nothing said); now the build stops with a line."""
    import multiprocessing
    import signal

    from megamlm.data import shards

    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": a_tokens(20 + i % 7)} for i in range(3000)])
    read = shards.document_lines

    def killing_one_worker(*args):
        for i, doc in enumerate(read(*args)):
            if i == 600:  # two chunks submitted: the workers run
                worker = next(p for p in multiprocessing.active_children() if "Process" in type(p).__name__)
                worker.kill()
                worker.join()
                # the executor's manager thread reaps the same child: the thread whose waitpid loses gets
                # ECHILD and returns before the winner stores the exit code, so the code can lag the join
                deadline = time.monotonic() + 10
                while worker.exitcode is None and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert worker.exitcode == -signal.SIGKILL
            yield doc

    monkeypatch.setattr(shards, "document_lines", killing_one_worker)
    out = tmp_path / "out"
    with pytest.raises(ShardError, match=r"^a tokenizer worker process \(--workers 2\) ended abruptly after "
                                         r"[\d,]+ documents \(killed: .*run it again, with fewer --workers"):
        build_shards(BuildOptions([str(src)], str(out), valid_fraction=0.0, workers=2), gpt2, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]  # no output, no staging folder


def test_bad_lines_are_counted_or_fatal_with_file_and_line(tmp_path, gpt2, capsys):
    src = tmp_path / "bad.jsonl"
    good = json.dumps({"text": "fine document", "meta": {"pile_set_name": "Wikipedia (en)"}})
    with open(src, "wb") as f:
        f.write(good.encode() + b"\n")
        f.write(b'{"text": "unterminated\n')
        f.write(json.dumps({"meta": {}}).encode() + b"\n")
        f.write(json.dumps({"text": "   "}).encode() + b"\n")
        f.write(b'{"text": "bad \xff byte"}\n')
        f.write(good.encode() + b"\n")
    manifest = build_shards(BuildOptions([str(src)], str(tmp_path / "out"), valid_fraction=0.0), gpt2, progress=False)
    assert manifest["skipped"] == {"malformed_json": 1, "missing_text": 1, "empty": 1, "invalid_utf8": 1}
    # the first line of each kind, named: a corpus whose text is under another key says so at once
    assert manifest["first_skipped"] == {
        "malformed_json": f"{src}:2: malformed JSON (Invalid control character at, column 23)",
        "missing_text": f"{src}:3: no string 'text' field (keys: meta)", "empty": f"{src}:4: blank 'text'",
        "invalid_utf8": f"{src}:5: invalid UTF-8 (invalid start byte at byte 14)"}
    assert summary_table(manifest).endswith(
        f"skipped inputs: empty 1 (first at {src}:4: blank 'text'), invalid_utf8 1 (first at {src}:5: invalid "
        f"UTF-8 (invalid start byte at byte 14)), malformed_json 1 (first at {src}:2: malformed JSON (Invalid "
        f"control character at, column 23)), missing_text 1 (first at {src}:3: no string 'text' field (keys: meta))")
    assert manifest["splits"]["train"]["documents"] == 2
    with pytest.raises(ShardError, match=rf"{src}:2: malformed JSON"):
        build_shards(BuildOptions([str(src)], str(tmp_path / "strict"), strict=True, valid_fraction=0.0),
            gpt2, progress=False)
    # a long build shows each kind as it meets its first line, not only at the end
    assert cli(["shards", "build", str(src), "--out", str(tmp_path / "shown"), "--valid-fraction", "0"]) == 0
    shown = re.findall(r"skipping (\w+) lines, the first at (\S+):", capsys.readouterr().err)
    assert sorted(shown) == [("empty", f"{src}:4"), ("invalid_utf8", f"{src}:5"), ("malformed_json", f"{src}:2"),
                             ("missing_text", f"{src}:3")], shown


def test_jsonl_parsed_in_the_workers_gives_the_same_shards_skips_and_strict_error(tmp_path, gpt2):
    """--workers > 1 parses a jsonl line's JSON in the tokenizer workers (json_document): the shards, the manifest's
    per-subset and skipped counts and a --strict build's error are those of --workers 1, which parses in-process."""
    src = tmp_path / "mixed.jsonl"
    texts = [d.text for d in read_documents(ROOT / "data/wikitext-103/test.txt", "paragraphs", BuildStats(), False)]
    subsets = ["Pile-CC", "Wikipedia (en)", "ünï \"q\"", "", ["a list"]]
    lines = [json.dumps({"text": t, "meta": {"pile_set_name": subsets[i % 5]}}).encode()
             for i, t in enumerate(texts[:900])]
    for at, bad in [(3, b'{"text": "unterminated'), (300, b'{"meta": {}}'), (301, b'{"text": "  "}'), (700, b"[1]"),
                    (820, b'{"text": "bad \xff byte"}'), (821, b"")]:
        lines.insert(at, bad)
    src.write_bytes(b"\n".join(lines) + b"\n")
    folders, manifests = [], []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        manifests.append(build_shards(BuildOptions([str(src)], str(out), seq_length=128, long_docs="split",
                                                   valid_fraction=0.1, shard_tokens=30_000, workers=workers),
                                      gpt2, progress=False))
        folders.append(out)
    assert manifests[0]["skipped"] == {"malformed_json": 1, "missing_text": 2, "empty": 1, "invalid_utf8": 1}
    assert manifests[0]["per_subset"].keys() == {"Pile-CC", "Wikipedia (en)", 'ünï "q"', "", '["a list"]'}
    assert manifests[1] == manifests[0]
    names = sorted(p.name for p in folders[0].iterdir())
    assert len(names) > 4 and sorted(p.name for p in folders[1].iterdir()) == names
    for name in names:
        assert (folders[1] / name).read_bytes() == (folders[0] / name).read_bytes(), name
    for workers in (1, 2):
        with pytest.raises(ShardError, match=rf"^{re.escape(str(src))}:4: malformed JSON"):
            build_shards(BuildOptions([str(src)], str(tmp_path / f"strict{workers}"), strict=True, workers=workers),
                         gpt2, progress=False)


def test_read_ahead_hands_over_blocks_in_order_raises_in_order_and_stops_with_its_consumer():
    """A .zst input is decompressed on a thread of its own (documents.read_ahead): the consumer sees the blocks
    as made, an error where the blocks raised it, and a consumer that stops early leaves no thread behind (its
    producer was blocked on a full queue)."""
    import threading

    from megamlm.data.documents import read_ahead

    def blocks(n, error=None):
        for i in range(n):
            yield bytes([i % 256]) * (i + 1)
        if error is not None:
            raise error

    assert list(read_ahead(blocks(50), depth=2)) == list(blocks(50))
    seen = []
    with pytest.raises(ShardError, match="corrupt zstd"):
        for block in read_ahead(blocks(7, ShardError("x.zst: corrupt zstd data")), depth=2):
            seen.append(block)
    assert seen == list(blocks(7))
    reader = read_ahead(blocks(1000), depth=2)
    assert next(reader) == b"\x00"
    time.sleep(0.2)  # the producer fills the queue and waits
    reader.close()
    assert [t.name for t in threading.enumerate() if t.name == "megamlm-read-ahead"] == []


def test_progress_into_a_file_or_pipe_is_lines_not_a_redrawn_bar(tmp_path, gpt2, capsys, monkeypatch):
    """stderr is not a terminal here (capsys), as in a SLURM job's log: no `\\r`, each redraw a line of its
    own, one a minute at most (here: the first and the last of a short build); at no interval, one a chunk of
    256 documents, counting up."""
    from megamlm.data import progress

    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": f"document {i}"} for i in range(600)])
    assert build_shards(BuildOptions([str(src)], str(tmp_path / "a"), valid_fraction=0.0), gpt2)
    err = capsys.readouterr().err
    assert "\r" not in err and re.findall(r"^tokenizing: (\d+) docs", err, re.M) == ["0", "600"], err
    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.0)
    assert build_shards(BuildOptions([str(src)], str(tmp_path / "b"), valid_fraction=0.0), gpt2)
    err = capsys.readouterr().err
    assert "\r" not in err and re.findall(r"^tokenizing: (\d+) docs", err, re.M) == ["0", "256", "512", "600"], err


def test_zstd_jsonl_and_line_mode_text(tmp_path, gpt2):
    import zstandard

    records = [{"text": f"document number {i}", "meta": {"pile_set_name": "ArXiv"}} for i in range(5)]
    plain = write_jsonl(tmp_path / "a.jsonl", records)
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    manifest = build_shards(BuildOptions([str(tmp_path / "a.jsonl.zst")], str(tmp_path / "z"), valid_fraction=0.0),
                            gpt2, progress=False)
    assert manifest["per_subset"]["ArXiv"]["documents"] == 5
    assert gpt2.decode(stored_documents(tmp_path / "z")[3]) == "document number 3"
    lines = tmp_path / "lines.txt"
    lines.write_text("one\ntwo\n\nthree\n")
    build_shards(BuildOptions([str(lines)], str(tmp_path / "l"), text_mode="lines", valid_fraction=0.0),
        gpt2, progress=False)
    assert [gpt2.decode(d) for d in stored_documents(tmp_path / "l")] == ["one", "two", "three"]


def test_cli_build_reports_and_refuses_reuse(tmp_path, capsys):
    src = write_jsonl(tmp_path / "x.jsonl", [{"text": "hello there"}])
    assert cli(["shards", "build", str(src), "--out", str(tmp_path / "o")]) == 0
    assert "unknown" in capsys.readouterr().out
    assert cli(["shards", "build", str(src), "--out", str(tmp_path / "o")]) == 2
    assert "already holds shards" in capsys.readouterr().err
    assert cli(["shards", "build", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "p")]) == 2
    assert "input not found" in capsys.readouterr().err


def test_a_finished_build_of_other_choices_is_named_not_rebuilt(tmp_path, gpt2):
    from megamlm.config import DataConfig
    from megamlm.data.shards import ensure_shards, other_build

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Paragraph {i}. " + a_tokens(40) for i in range(200)))
    asked = DataConfig(shards=str(tmp_path / "shards"), build_from=[str(corpus)], seq_length=64, valid_fraction=0.1)
    assert other_build(asked) is None  # nothing built yet
    ensure_shards(asked, gpt2, progress=False)
    manifest = (tmp_path / "shards/manifest.json").read_bytes()
    assert other_build(asked) is None
    assert other_build(DataConfig(shards=asked.shards, build_from=[], valid_fraction=0.2)) is None  # builds nothing
    changed = DataConfig(shards=asked.shards, build_from=[str(corpus)], seq_length=128, valid_fraction=0.2)
    assert other_build(changed) == (
        f"data.shards={tmp_path / 'shards'} holds a build of other choices than the config's: seq_length 64 (asked: "
        f"128), valid_fraction 0.1 (asked: 0.2); the run uses it as it is (to build anew, point data.shards at a new "
        f"folder)")
    assert ensure_shards(changed, gpt2, progress=False) == tmp_path / "shards"
    assert (tmp_path / "shards/manifest.json").read_bytes() == manifest  # used as it is
