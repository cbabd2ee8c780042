"""Masking strategies (data/masking.py): fairseq's token masking, whole-word and span masking —
fractions, the 80/10/10 split, words never split, the span-length law, seeding."""

import numpy as np
import pytest

from megamlm.data.masking import Masker
from megamlm.data.tokenizer import MASK_SYMBOL, Tokenizer

ROOT_TEXT = "data/wikitext-103/valid.txt"


@pytest.fixture(scope="module")
def gpt2():
    return Tokenizer.gpt2()


@pytest.fixture(scope="module")
def samples(gpt2):
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / ROOT_TEXT).read_text()[:400_000]
    ids = gpt2.encode(text)
    return [np.concatenate([[0], ids[i:i + 255]]) for i in range(0, len(ids) - 255, 255)]


def masker(gpt2, strategy, **kw):
    d = gpt2.dictionary
    return Masker(d.mask_id, d.ordinary_ids(), strategy=strategy, word_starts=gpt2.word_starts(), **kw)


def words_of(gpt2, sample):
    starts = gpt2.word_starts()[sample].copy()
    starts[0] = True
    return np.cumsum(starts) - 1


@pytest.mark.parametrize("strategy", ["token", "whole_word", "span"])
def test_masked_fraction_and_the_80_10_10_split(gpt2, samples, strategy):
    m = masker(gpt2, strategy, mask_prob=0.3)
    targeted = masked = unchanged = 0
    total = 0
    for i, sample in enumerate(samples):
        inputs, target = m(sample, 0, i)
        total += len(sample)
        targeted += target.sum()
        masked += (inputs[target] == gpt2.dictionary.mask_id).sum()
        unchanged += (inputs[target] == sample[target]).sum()
        assert np.array_equal(inputs[~target], sample[~target])  # only targets change
    assert targeted / total == pytest.approx(0.3, abs=0.02)
    assert masked / targeted == pytest.approx(0.8, abs=0.03)
    # kept on purpose (10%) plus random draws that hit the original id (rare)
    assert unchanged / targeted == pytest.approx(0.1, abs=0.03)


@pytest.mark.parametrize("strategy", ["whole_word", "span"])
def test_words_are_masked_entirely_or_not_at_all(gpt2, samples, strategy):
    m = masker(gpt2, strategy)
    split_words = 0
    for i, sample in enumerate(samples[:200]):
        inputs, target = m(sample, 0, i)
        words = words_of(gpt2, sample)
        per_word = np.bincount(words, weights=target)  # targets per word
        split_words += int(((per_word > 0) & (per_word < np.bincount(words))).sum())
        # and a word's tokens share one fate: all <mask>, all random, or all kept
        for w in np.unique(words[target]):
            fate = inputs[words == w] == gpt2.dictionary.mask_id
            assert fate.all() or not fate.any()
    assert split_words == 0


def test_span_lengths_follow_the_truncated_geometric_law(gpt2):
    m = masker(gpt2, "span")
    rng = np.random.default_rng(0)
    lengths = np.array([m.span_length(rng) for _ in range(20000)])
    assert lengths.min() == 1 and lengths.max() == 10
    assert lengths.mean() == pytest.approx(3.797, abs=0.05)  # SpanBERT: 3.8 for p = 0.2, max 10
    assert (lengths == 1).mean() == pytest.approx(0.2 / (1 - 0.8**10), abs=0.01)


@pytest.mark.parametrize("strategy", ["token", "whole_word", "span"])
def test_masking_is_seeded_by_seed_epoch_and_sample(gpt2, samples, strategy):
    m = masker(gpt2, strategy)
    first = m(samples[0], 0, 7)
    assert all(np.array_equal(a, b) for a, b in zip(first, m(samples[0], 0, 7)))
    assert not np.array_equal(first[1], m(samples[0], 1, 7)[1])


def test_word_starts_follow_the_gpt2_space_marker(gpt2):
    ids = gpt2.encode(" The unbelievable tokenization, obviously.")
    assert [bool(gpt2.word_starts()[i]) for i in ids] == [True, True, True, False, False, True, False]
    assert gpt2.word_starts()[gpt2.dictionary.symbols.index(MASK_SYMBOL)]


def test_bad_masking_settings_are_one_line(gpt2):
    from megamlm.config import ConfigError, load_config

    for override, message in (("data.masking=words", "data.masking='words' is invalid; allowed: token | "),
                              ("data.span_p=1.5", "data.span_p=1.5 must be in (0, 1)"),
                              ("data.span_max_words=0", "data.span_max_words=0 must be >= 1")):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("|", r"\|")):
            load_config([], [override])


def test_word_masking_refuses_a_tokenizer_without_word_starts(tmp_path):
    import json

    from megamlm.config import ConfigError, load_config
    from megamlm.objectives import get_objective

    (tmp_path / "encoder.json").write_text(json.dumps({"a": 0, "b": 1, "ab": 2}))  # no Ġ piece
    (tmp_path / "vocab.bpe").write_text("#version: 0.2\na b\n")
    (tmp_path / "dict.txt").write_text("0 5\n1 5\n2 5\n")
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.word_starts() is None
    for strategy in ("span", "whole_word"):
        cfg = load_config([], [f"data.masking={strategy}", f"data.tokenizer={tmp_path}"])
        with pytest.raises(ConfigError, match=f"data.masking={strategy} needs word boundaries, but data.tokenizer="
                                              f".* has no word-start rule"):
            get_objective(cfg).corruption(tokenizer, 1)
    get_objective(load_config([], [f"data.tokenizer={tmp_path}"])).corruption(tokenizer, 1)  # token: fine


def _train(cfg):
    from megamlm.train.loop import train

    return train(cfg)["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("fragment", ["wwm", "span"])
def test_the_objective_config_fragments_train(tmp_path_factory, tmp_path, fragment):
    import yaml

    from tests.multiproc import run_on_ranks
    from tests.test_train import CONFIGS, config, tiny_shards

    data = yaml.safe_load((CONFIGS / f"objectives/{fragment}.yaml").read_text())["data"]
    cfg = config(tiny_shards(tmp_path_factory, f"masking-{fragment}"), tmp_path, "train.steps=3",
                 *(f"data.{key}={value}" for key, value in data.items()))
    assert cfg.data.masking == {"wwm": "whole_word", "span": "span"}[fragment]
    (losses,) = run_on_ranks(_train, 1, cfg)
    assert len(losses) == 3 and all(np.isfinite(losses))
