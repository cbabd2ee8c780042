"""Corpus files (data/compression.py, documents.text_lines): every compression `megamlm shards build` reads gives
the plain file's shards; files that hold no text, and damaged compressed ones, are refused before any work with
one line naming them; the tokenizer trainers read the same inputs and learn from a jsonl file's text, not its
JSON."""

import bz2
import gzip
import io
import json
import lzma
import sys
import tarfile
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import zstandard
from tests.faults_common import run_cli

from megamlm.cli import main as cli
from megamlm.data.shards import BuildOptions, build_shards
from megamlm.data.tokenizer import Tokenizer
from tests.test_shards import stored_documents

ROOT = Path(__file__).resolve().parents[1]
WIKITEXT = ROOT / "data/wikitext-103/valid.txt"

COMPRESSORS = {
    "zstd": lambda data: zstandard.ZstdCompressor().compress(data),
    "gzip": gzip.compress,
    "bzip2": bz2.compress,
    "xz": lzma.compress,
}


def pile_lines(n=300) -> bytes:
    """n jsonl documents in the Pile's layout, each a few lines of WikiText-103 ending in a newline."""
    paragraphs = [p for p in WIKITEXT.read_text().split("\n \n") if p.strip()][:n]
    return b"".join(json.dumps({"text": p.strip(" ") + "\n", "meta": {"pile_set_name": "Wikipedia (en)"}}).encode()
                    + b"\n" for p in paragraphs)


@pytest.fixture(scope="module")
def gpt2():
    return Tokenizer.gpt2()


@pytest.fixture(scope="module")
def plain_build(tmp_path_factory, gpt2):
    """The shards of the uncompressed jsonl: what every compressed copy must give."""
    folder = tmp_path_factory.mktemp("plain")
    (folder / "corpus.jsonl").write_bytes(pile_lines())
    build_shards(BuildOptions([str(folder / "corpus.jsonl")], str(folder / "shards"), valid_fraction=0.0,
                              long_docs="truncate"), gpt2, progress=False)
    return [d.tolist() for d in stored_documents(folder / "shards")]


@pytest.mark.parametrize("codec", sorted(COMPRESSORS))
def test_every_compression_gives_the_plain_files_shards(codec, tmp_path, gpt2, plain_build):
    data = pile_lines()
    half = len(data) // 2
    # two streams one after the other (as `cat a.gz b.gz` or pzstd write), named by what it is not: the first
    # bytes, not the name, say how a file is compressed
    src = tmp_path / "corpus.jsonl.zst-or-not"
    src.write_bytes(COMPRESSORS[codec](data[:half]) + COMPRESSORS[codec](data[half:]))
    build_shards(BuildOptions([str(src)], str(tmp_path / "shards"), valid_fraction=0.0, long_docs="truncate"), gpt2,
                 progress=False)
    assert len(plain_build) == 300
    assert [d.tolist() for d in stored_documents(tmp_path / "shards")] == plain_build


def no_text_inputs(tmp_path) -> list[tuple[Path, str]]:
    """(a file, what the build says of it): real archives and arrays, each made by its own library."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(pile_lines(20))
    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w") as archive:
        archive.add(corpus, arcname="corpus.jsonl")
    (tmp_path / "corpus.tar").write_bytes(tar.getvalue())
    (tmp_path / "corpus.tar.gz").write_bytes(gzip.compress(tar.getvalue()))
    with zipfile.ZipFile(tmp_path / "corpus.zip", "w") as archive:
        archive.write(corpus, "corpus.jsonl")
    np.save(tmp_path / "ids.npy", np.arange(100, dtype=np.uint16))
    (tmp_path / "part.parquet.gz").write_bytes(gzip.compress(b"PAR1" + bytes(range(256)) * 4 + b"PAR1"))
    (tmp_path / "model.bin").write_bytes(b"some text first, then\x00\x01\x02")
    extract = "extract it and pass the files in it (shards a build wrote are trained on with data.shards=<their " \
              "folder>, not built again)"
    return [
        (tmp_path / "corpus.tar", f"is a tar archive, not text: {extract}"),
        (tmp_path / "corpus.tar.gz", f"is a tar archive (gzip-compressed), not text: {extract}"),
        (tmp_path / "corpus.zip", "is a zip archive, not text: unzip it and pass the files in it"),
        (tmp_path / "ids.npy", "is a NumPy array, not text: megamlm tokenizes text itself: pass the corpus's text"),
        (tmp_path / "part.parquet.gz", "is a Parquet file (gzip-compressed), not text: decompress it (megamlm reads "
                                       "Parquet files as they are)"),
        (tmp_path / "model.bin", "is binary, not text (a NUL byte at offset 21); inputs are jsonl or plain text, "
                                 "optionally compressed with zstd, gzip, bzip2, xz"),
    ]


def test_files_that_hold_no_text_are_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "out"
    corpus_first = tmp_path / "corpus.jsonl"
    for path, what in no_text_inputs(tmp_path):
        # named before the text before it is read: no document of corpus.jsonl is tokenized for nothing
        for verb in (["build", corpus_first, path], ["train-bpe", corpus_first, path], ["train-wordpiece", path]):
            assert run_cli(capsys, "shards", *verb, "--out", out) == (2, f"megamlm: shards: input {path} {what}")
            assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_damaged_compressed_files_are_named(tmp_path, capsys):
    data = pile_lines(100)
    gz = gzip.compress(data)
    corrupt_gz = gz[:20] + bytes(40) + gz[60:]
    xz = lzma.compress(data)
    bz = bz2.compress(data)
    cases = [
        ("cut.jsonl.gz", gz[: len(gz) // 2], "truncated gzip file (it ends inside a compressed stream); "
                                             "re-download or re-compress it"),
        ("cut.jsonl.xz", xz[: len(xz) - 100], "truncated xz file (it ends inside a compressed stream); "
                                              "re-download or re-compress it"),
        ("bad.jsonl.gz", corrupt_gz, "corrupt gzip data (Error -3 while decompressing data: invalid "),
        ("bad.jsonl.bz2", bz[:40] + bytes(40) + bz[80:], "corrupt bzip2 data (Invalid data stream)"),
    ]
    for name, content, what in cases:
        (tmp_path / name).write_bytes(content)
        for verb in ("build", "train-bpe"):
            code, line = run_cli(capsys, "shards", verb, tmp_path / name, "--out", tmp_path / "out")
            assert code == 2 and line.startswith(f"megamlm: shards: {tmp_path / name}: {what}"), line
            assert not (tmp_path / "out").exists()


def test_bpe_is_trained_on_a_jsonl_files_text_not_its_json(tmp_path, monkeypatch):
    """The same text as plain lines, as jsonl and as zstd-compressed jsonl with a malformed line: the same
    encoder.json, vocab.bpe and dict.txt (the JSON around the text used to be learned: "text", "meta", escapes);
    dict.txt's counts are those of the corpus's lines encoded one by one."""
    from tokenizers import ByteLevelBPETokenizer

    import megamlm.data.tokenizer

    lines = pile_lines().splitlines(keepends=True)
    text = "".join(json.loads(line)["text"] for line in lines)
    (tmp_path / "corpus.txt").write_text(text)
    jsonl = tmp_path / "corpus.jsonl.zst"
    jsonl.write_bytes(COMPRESSORS["zstd"](b"".join(lines[:7]) + b"{not json\n" + b"".join(lines[7:])))
    files = ("encoder.json", "vocab.bpe", "dict.txt")
    monkeypatch.setattr(megamlm.data.tokenizer, "COUNT_BATCH_LINES", 7)  # many batches, the last one short
    Tokenizer.train([tmp_path / "corpus.txt"], tmp_path / "from-text", vocab_size=600)
    bpe = ByteLevelBPETokenizer(str(tmp_path / "from-text/encoder.json"), str(tmp_path / "from-text/vocab.bpe"))
    expected = np.zeros(600, dtype=np.int64)
    for line in text.splitlines(keepends=True):
        np.add.at(expected, bpe.encode(line).ids, 1)
    counted = dict(map(int, line.split()) for line in (tmp_path / "from-text/dict.txt").read_text().splitlines())
    assert counted == dict(enumerate(expected.tolist())) and expected.sum() > 20_000
    with pytest.warns(UserWarning) as warned:
        assert cli(["shards", "train-bpe", str(jsonl), "--out", str(tmp_path / "from-jsonl"),
                    "--vocab-size", "600"]) == 0
    text_lines = sum(len(json.loads(line)["text"].splitlines()) for line in lines)
    assert [str(w.message) for w in warned] == [
        f"trained on {text_lines:,} lines; skipped: malformed_json 1 (first at {jsonl}:8: malformed JSON "
        f"(Expecting property name enclosed in double quotes, column 2))"]
    for name in files:
        assert (tmp_path / "from-text" / name).read_bytes() == (tmp_path / "from-jsonl" / name).read_bytes(), name
    vocab = json.loads((tmp_path / "from-jsonl/encoder.json").read_text())
    assert "text" not in vocab and "meta" not in vocab and len(vocab) == 600
    # the same plain text, gzip-compressed: the same files
    (tmp_path / "corpus.txt.gz").write_bytes(gzip.compress((tmp_path / "corpus.txt").read_bytes()))
    Tokenizer.train([tmp_path / "corpus.txt.gz"], tmp_path / "from-gzip", vocab_size=600)
    for name in files:
        assert (tmp_path / "from-text" / name).read_bytes() == (tmp_path / "from-gzip" / name).read_bytes(), name


def test_wordpiece_is_trained_on_a_jsonl_files_text_and_no_text_is_an_error(tmp_path, capsys):
    data = pile_lines()
    (tmp_path / "corpus.jsonl.gz").write_bytes(gzip.compress(data))
    assert cli(["shards", "train-wordpiece", str(tmp_path / "corpus.jsonl.gz"), "--out", str(tmp_path / "wp"),
                "--vocab-size", "400"]) == 0
    pieces = (tmp_path / "wp/vocab.txt").read_text().splitlines()
    # "text" and "meta" head every jsonl line: learned from the JSON, they would be among the first merges
    assert len(pieces) == 400 and "text" not in pieces and "meta" not in pieces and "the" in pieces
    (tmp_path / "keys.jsonl").write_text('{"content": "a corpus under another key"}\n')
    code, line = run_cli(capsys, "shards", "train-wordpiece", tmp_path / "keys.jsonl", "--out", tmp_path / "none")
    assert (code, line) == (2, f"megamlm: shards: no text in {tmp_path / 'keys.jsonl'} (skipped lines: missing_text 1 "
                               f"(first at {tmp_path / 'keys.jsonl'}:1: no string 'text' field (keys: content)))")
    assert not (tmp_path / "none").exists()


def test_json_that_is_not_json_lines_is_refused_naming_its_shape(tmp_path, capsys):
    """A JSON array (one line or many) or a pretty-printed object: each line would be skipped as malformed,
    and the build end with "no documents" after reading the whole file."""
    docs = [{"text": f"document {i}"} for i in range(5)]
    cases = [("one-line.json", json.dumps(docs), "a JSON array", "'.[]'"),
             ("indented.json.gz", json.dumps(docs, indent=2), "a JSON array", "'.[]'"),
             ("pretty.jsonl", "\n" + json.dumps(docs[0], indent=2), "pretty-printed JSON", ".")]
    for name, content, shape, flatten in cases:
        path = tmp_path / name
        path.write_bytes(gzip.compress(content.encode()) if name.endswith(".gz") else content.encode())
        for verb in ("build", "train-bpe"):
            assert run_cli(capsys, "shards", verb, path, "--out", tmp_path / "out") == (
                2, f"megamlm: shards: input {path} is {shape}, not JSON lines (one object per line, each with its "
                   f"\"text\"); `jq -c {flatten}` writes them")
            assert not (tmp_path / "out").exists()
    # the same documents one per line: built
    (tmp_path / "lines.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    assert cli(["shards", "build", str(tmp_path / "lines.jsonl"), "--out", str(tmp_path / "out")]) == 0


def test_eval_reads_a_jsonl_files_text(tmp_path, gpt2):
    """`megamlm eval --data` on jsonl (compressed or not) scores its documents' text, as on a text file holding
    them one per line; read as text, each JSON line was scored, braces and "text" keys included."""
    from megamlm.evaluate import token_stream

    paragraphs = [json.loads(line)["text"].replace("\n", " ") for line in pile_lines(40).splitlines()]
    (tmp_path / "corpus.txt").write_text("\n\n".join(paragraphs) + "\n")
    jsonl = b"".join(json.dumps({"text": p}).encode() + b"\n" for p in paragraphs)
    (tmp_path / "corpus.jsonl").write_bytes(jsonl)
    (tmp_path / "corpus.jsonl.xz").write_bytes(lzma.compress(jsonl))
    (tmp_path / "corpus.txt.bz2").write_bytes(bz2.compress((tmp_path / "corpus.txt").read_bytes()))
    expected = token_stream(tmp_path / "corpus.txt", gpt2, max_tokens=100_000)
    assert len(expected) == sum(len(gpt2.encode(p.strip())) + 1 for p in paragraphs)
    for name in ("corpus.jsonl", "corpus.jsonl.xz", "corpus.txt.bz2"):
        assert np.array_equal(token_stream(tmp_path / name, gpt2, max_tokens=100_000), expected), name
    assert np.array_equal(token_stream(tmp_path / "corpus.jsonl.xz", gpt2, max_tokens=500), expected[:500])


def test_jsonl_in_a_file_named_as_text_is_warned_of(tmp_path, gpt2):
    """A .txt (or unnamed) file of JSON lines is built as text, as asked, with a warning that says so: its
    documents would be the JSON, keys and escapes included."""
    (tmp_path / "corpus").write_bytes(pile_lines(5))
    with pytest.warns(UserWarning) as warned:
        build_shards(BuildOptions([str(tmp_path / "corpus")], str(tmp_path / "out"), long_docs="split"), gpt2,
                     progress=False)
    assert [str(w.message) for w in warned] == [
        f"input {tmp_path / 'corpus'} is read as plain text (its name has no .jsonl or .json), but its first line is "
        f"a JSON object with a \"text\": name it *.jsonl to read each line's text instead of its JSON"]
    (tmp_path / "notes.txt").write_text('{"a": "JSON line without text"}\nplain text after it\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_shards(BuildOptions([str(tmp_path / "notes.txt")], str(tmp_path / "out2")), gpt2, progress=False)


def test_wordpiece_training_is_reproducible(tmp_path):
    """Two trainings on one corpus write the same vocab.txt: `tokenizers` (0.23) numbers the continuing (##)
    pieces in its hash map's order and breaks ties between merges by those numbers (two trainings on this corpus
    differed in ~1,000 ids and a few pieces; huggingface/tokenizers#1794)."""
    from megamlm.data.pieces import WordPieceTokenizer

    for out in ("a", "b"):
        WordPieceTokenizer.train([WIKITEXT], tmp_path / out, vocab_size=8000)
    pieces = (tmp_path / "a/vocab.txt").read_text().splitlines()
    assert (tmp_path / "b/vocab.txt").read_text().splitlines() == pieces and len(pieces) == 8000
    # the ## forms are those of characters met inside a word: "##e", never "##," (punctuation is a word of its own)
    assert "##e" in pieces and "##," not in pieces and "," in pieces and pieces[:5] == [
        "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def test_a_vocabulary_size_the_tokenizer_cannot_hold_is_refused_or_warned_of(tmp_path, capsys):
    from megamlm.data.pieces import WordPieceTokenizer

    for size in ("256", "-5"):
        assert run_cli(capsys, "shards", "train-bpe", WIKITEXT, "--out", tmp_path / "bpe", "--vocab-size", size) == (
            2, f"megamlm: shards: --vocab-size {size}: a byte-level BPE holds the 256 bytes first, then a piece per "
               f"merge; at least 257")
    assert run_cli(capsys, "shards", "train-wordpiece", WIKITEXT, "--out", tmp_path / "wp", "--vocab-size", "5") == (
        2, "megamlm: shards: --vocab-size 5 must be >= 6")
    assert not (tmp_path / "bpe").exists() and not (tmp_path / "wp").exists()
    with pytest.warns(UserWarning) as warned:
        WordPieceTokenizer.train([WIKITEXT], tmp_path / "wp", vocab_size=100)
    held = len((tmp_path / "wp/vocab.txt").read_text().splitlines())
    assert held > 100 and [str(w.message) for w in warned] == [
        f"the vocabulary holds {held} pieces, more than --vocab-size 100: BERT's 5 specials, the corpus's characters "
        f"and their continuing (##) forms come first"]


def test_glob_patterns_expand_to_their_files_sorted(tmp_path, gpt2, capsys):
    """data.build_from (no shell expands it) and quoted arguments: `*` in a folder, `**` below it, sorted; the
    manifest names the files; a finished build of the same files is the same build; no match is an error."""
    from megamlm.config import DataConfig
    from megamlm.data.shards import other_build, planned_build

    data = pile_lines(30).splitlines(keepends=True)
    for i, name in enumerate(["b/2.jsonl.gz", "a.jsonl.gz", "b/c/1.jsonl.gz", "skip.txt"]):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(gzip.compress(b"".join(data[i * 10:(i + 1) * 10])))
    expanded = [str(tmp_path / name) for name in ("a.jsonl.gz", "b/2.jsonl.gz", "b/c/1.jsonl.gz")]
    config = DataConfig(shards=str(tmp_path / "shards"), build_from=[str(tmp_path / "**/*.jsonl.gz")],
                        long_docs="truncate", valid_fraction=0.0)
    options = planned_build(config)
    assert options.inputs == expanded
    manifest = build_shards(options, gpt2, progress=False)
    assert manifest["options"]["inputs"] == expanded and other_build(config) is None
    build_shards(BuildOptions(expanded, str(tmp_path / "listed"), long_docs="truncate", valid_fraction=0.0), gpt2,
                 progress=False)
    assert [d.tolist() for d in stored_documents(tmp_path / "shards")] == [
        d.tolist() for d in stored_documents(tmp_path / "listed")]
    Tokenizer.train([tmp_path / "b/*.jsonl.gz"], tmp_path / "bpe", vocab_size=300)
    Tokenizer.train([tmp_path / "b/2.jsonl.gz"], tmp_path / "bpe-listed", vocab_size=300)
    assert (tmp_path / "bpe/dict.txt").read_text() == (tmp_path / "bpe-listed/dict.txt").read_text()
    pattern = tmp_path / "*.jsonl.zst"
    assert run_cli(capsys, "shards", "build", pattern, "--out", tmp_path / "out") == (
        2, f"megamlm: shards: input pattern {pattern} matches no file")


def test_parquet_files_give_the_shards_tokenizer_and_evaluation_of_the_same_jsonl(tmp_path, gpt2, capsys,
                                                                                   monkeypatch):
    """The Hub's layout (a "text" column, other columns ignored, several row groups): the same stored documents,
    BPE files and evaluation tokens as jsonl of the same texts; null and blank rows counted as a jsonl file's
    are; a file without the column, with another type, truncated, or without pyarrow installed: one line."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megamlm.evaluate import token_stream

    texts = [json.loads(line)["text"] for line in pile_lines(60).splitlines()]
    rows = texts[:7] + [None] + texts[7:20] + ["  "] + texts[20:]
    pq.write_table(pa.table({"id": list(range(len(rows))), "text": rows}), tmp_path / "train-00000.parquet",
                   row_group_size=16)
    (tmp_path / "same.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    manifests = {}
    for name in ("train-00000.parquet", "same.jsonl"):
        manifests[name] = build_shards(BuildOptions([str(tmp_path / name)], str(tmp_path / f"{name}.shards"),
                                                    long_docs="truncate", valid_fraction=0.0), gpt2, progress=False)
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            Tokenizer.train([tmp_path / name], tmp_path / f"{name}.bpe", vocab_size=400)
        assert [str(w.message).split("; ")[1] for w in warned] == (
            ["skipped: empty 1 (first at {0}:22: blank 'text'), missing_text 1 (first at {0}:8: null 'text')".format(
                tmp_path / name)] if name.endswith(".parquet") else [])
    parquet, jsonl = (tmp_path / "train-00000.parquet", tmp_path / "same.jsonl")
    assert [d.tolist() for d in stored_documents(f"{parquet}.shards")] == [
        d.tolist() for d in stored_documents(f"{jsonl}.shards")] and len(texts) == 60
    assert manifests[parquet.name]["first_skipped"] == {"missing_text": f"{parquet}:8: null 'text'",
                                                       "empty": f"{parquet}:22: blank 'text'"}
    for name in ("encoder.json", "vocab.bpe", "dict.txt"):
        assert (tmp_path / f"{parquet.name}.bpe" / name).read_bytes() == (
            tmp_path / f"{jsonl.name}.bpe" / name).read_bytes(), name
    assert np.array_equal(token_stream(parquet, gpt2, 50_000), token_stream(jsonl, gpt2, 50_000))

    pq.write_table(pa.table({"content": ["a"], "url": ["b"]}), tmp_path / "content.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    (tmp_path / "cut.parquet").write_bytes(parquet.read_bytes()[:2000])
    cases = [(tmp_path / "content.parquet", " has no 'text' column (columns: content, url); megamlm reads a "
                                            "document from each row's 'text'"),
             (tmp_path / "ints.parquet", ": its 'text' column holds int64, not strings"),
             (tmp_path / "cut.parquet", " is not a readable Parquet file (ArrowInvalid: Parquet magic bytes not found")]
    for path, what in cases:
        code, line = run_cli(capsys, "shards", "build", path, "--out", tmp_path / "out")
        assert code == 2 and line.startswith(f"megamlm: shards: input {path}{what}"), line
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as where pyarrow is not installed
    assert run_cli(capsys, "shards", "train-bpe", parquet, "--out", tmp_path / "out") == (
        2, f"megamlm: shards: input {parquet} is a Parquet file, and reading it needs pyarrow: `pip install "
           f"'megamlm[parquet]'` (or write its text column as jsonl elsewhere)")
    assert not (tmp_path / "out").exists()


def test_a_parquet_files_pile_meta_gives_the_subsets_a_jsonl_files_does(tmp_path, gpt2):
    """The Pile as Parquet (a "meta" column beside "text": a struct, or the JSON string some conversions
    write): each document lands in its `pile_set_name` subset, as the same documents in jsonl do; a file
    without the column, or a row without the name, in "unknown"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [json.loads(line)["text"] for line in pile_lines(40).splitlines()]
    names = ["Pile-CC", "ArXiv", "Github", None] * 10
    metas = [{"pile_set_name": name} if name else {"source": "elsewhere"} for name in names]
    (tmp_path / "pile.jsonl").write_text("".join(json.dumps({"text": t, "meta": m}) + "\n"
                                                 for t, m in zip(texts, metas)))
    pq.write_table(pa.table({"text": texts, "meta": [{"pile_set_name": name} for name in names]}),
                   tmp_path / "struct.parquet", row_group_size=16)
    pq.write_table(pa.table({"text": texts, "meta": [json.dumps(m) for m in metas]}), tmp_path / "string.parquet")
    pq.write_table(pa.table({"text": texts}), tmp_path / "bare.parquet")
    subsets = {}
    for name in ("pile.jsonl", "struct.parquet", "string.parquet", "bare.parquet"):
        manifest = build_shards(BuildOptions([str(tmp_path / name)], str(tmp_path / f"{name}.shards"),
                                             long_docs="truncate", valid_fraction=0.0), gpt2, progress=False)
        subsets[name] = {subset: counts["documents"] for subset, counts in manifest["per_subset"].items()}
    assert subsets["pile.jsonl"] == {"ArXiv": 10, "Github": 10, "Pile-CC": 10, "unknown": 10}
    assert subsets["struct.parquet"] == subsets["string.parquet"] == subsets["pile.jsonl"]
    assert subsets["bare.parquet"] == {"unknown": 40}
