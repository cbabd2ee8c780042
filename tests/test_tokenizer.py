"""GPT-2 BPE through the fairseq dictionary: known ids, exact round trips, variants, user BPEs."""

import shutil
from pathlib import Path

import pytest

from megamlm.data import tokenizer as tokmod
from megamlm.data.tokenizer import Tokenizer, TokenizerError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpt2():
    return Tokenizer.gpt2()


def test_known_gpt2_and_fairseq_ids(gpt2):
    assert gpt2.bpe_ids("Hello world") == [15496, 995]
    # roberta.base encodes "Hello world" as <s> 31414 232 </s>
    assert gpt2.encode("Hello world").tolist() == [31414, 232]
    assert len(gpt2.dictionary) == 50265 and gpt2.dictionary.mask_id == 50264
    assert gpt2.dictionary.symbols[:4] == ("<s>", "<pad>", "</s>", "<unk>")
    assert gpt2.dictionary.symbols[4] == "13"  # dict.txt line 1: GPT-2 id 13 ('.'), the most frequent


def test_zero_clap_dictionary_has_no_mask_row(gpt2):
    zero = Tokenizer.gpt2(zero_clap=True)
    assert len(zero.dictionary) == 50262 and zero.dictionary.mask_id == 50262
    assert zero.dictionary.symbols[-1] == "madeupword0000"
    assert zero.encode("Hello world").tolist() == gpt2.encode("Hello world").tolist()
    # text encodes to the same ids in both, so they share shards
    assert zero.dictionary.sha256 == gpt2.dictionary.sha256


@pytest.mark.parametrize("name", ["valid.txt", "test.txt"])
def test_round_trip_on_bundled_wikitext(gpt2, name):
    text = (ROOT / "data/wikitext-103" / name).read_text(encoding="utf-8")
    ids = gpt2.encode(text)
    assert (ids != tokmod.UNK).all()
    assert gpt2.decode(ids) == text


def test_round_trip_on_unicode_and_whitespace(gpt2):
    for text in ["Héllo wörld 🤗 — 東京 \u200b", "  leading\tand\ttrailing  \n\n", "\x00\x7f", ""]:
        assert gpt2.decode(gpt2.encode(text)) == text


def test_decode_skips_specials_and_mask(gpt2):
    ids = [0, *gpt2.encode("The capital"), gpt2.dictionary.mask_id, 2, 1]
    assert gpt2.decode(ids) == "The capital"


def test_ordinary_ids_exclude_specials_madeupwords_and_mask(gpt2):
    ordinary = gpt2.dictionary.ordinary_ids()
    assert len(ordinary) == 50257 and ordinary.min() == 4 and ordinary.max() == 50260


def test_corrupt_bundled_file_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "gpt2"
    shutil.copytree(tokmod.bundled_gpt2_dir(), folder)
    with open(folder / "vocab.bpe", "a") as f:
        f.write("x y\n")
    monkeypatch.setattr(tokmod, "bundled_gpt2_dir", lambda: folder)
    with pytest.raises(TokenizerError, match="vocab.bpe is corrupt: sha256 differs"):
        Tokenizer.gpt2()


def test_bad_dictionary_line_names_file_and_line(tmp_path):
    (tmp_path / "dict.txt").write_text("13 5\nno-count-here\n")
    with pytest.raises(TokenizerError, match=r"dict.txt:2: expected '<symbol> <count>'"):
        tokmod.Dictionary.load(tmp_path / "dict.txt")


def test_user_trained_bpe_round_trips(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((ROOT / "data/wikitext-103/valid.txt").read_text()[:200_000])
    folder = Tokenizer.train([corpus], tmp_path / "bpe", vocab_size=2000)
    tok = Tokenizer.from_dir(folder)
    assert len(tok.dictionary) == 4 + 2000 + 1  # specials + BPE symbols + <mask>
    text = "The lobster , known as Homarus gammarus , is blue ."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids.min() >= 4 and len(ids) < len(text)
    assert tok.dictionary.sha256 != Tokenizer.gpt2().dictionary.sha256
