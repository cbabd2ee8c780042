"""Packed micro-batches: the bin plan (data/packing.py) on a Pile-like length distribution."""

import numpy as np
import pytest

from megamlm.data.blocks import plan_blocks
from megamlm.data.packing import best_fit_decreasing, fill_ratio, plan_bins


def pile_like_samples(n_docs: int = 20000, seq_length: int = 2048, seed: int = 0) -> np.ndarray:
    """Sample lengths (<s> + block) of the reference's recipe on lognormal documents with the Pile's
    facts: median 1,024 tokens, 1/7 longer than 2,048 (sigma = ln 2 / z(6/7) = 0.649); documents
    longer than a sample are dropped, the rest packed by fairseq's `complete`."""
    rng = np.random.default_rng(seed)
    docs = np.round(rng.lognormal(np.log(1024), np.log(2) / 1.0676, n_docs)).astype(np.int64) + 1  # + </s>
    docs = docs[docs <= seq_length - 1]
    blocks = plan_blocks(docs, seq_length, "complete")
    return blocks[:, 1] - blocks[:, 0] + 1


def test_best_fit_decreasing_places_every_item_once_within_the_budget():
    lengths = np.random.default_rng(1).integers(1, 100, 500)
    bins = best_fit_decreasing(lengths, 100)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(lengths[b].sum() <= 100 for b in bins)
    assert bins == best_fit_decreasing(lengths, 100)
    # no bin could take another bin's smallest item: at most one bin is less than half full
    assert sum(lengths[b].sum() < 50 for b in bins) <= 1


def test_packing_fills_98_percent_of_a_pile_like_distribution_where_padding_fills_75():
    lengths = pile_like_samples()
    padded = lengths.sum() / (len(lengths) * 2048)
    assert padded == pytest.approx(0.745, abs=0.01)
    bins = plan_bins(lengths, 8 * 2048, window=1000, seed=1, epoch=0)
    assert fill_ratio(lengths, bins, 8 * 2048) >= 0.98
    positions = np.concatenate(bins)
    assert sorted(positions.tolist()) == list(range(len(lengths)))  # every sample once, none dropped
    assert all(lengths[b].sum() <= 8 * 2048 for b in bins)


def test_the_plan_is_seeded_per_epoch():
    lengths = pile_like_samples(4000)
    plan = plan_bins(lengths, 4 * 2048, window=500, seed=3, epoch=0)
    again = plan_bins(lengths, 4 * 2048, window=500, seed=3, epoch=0)
    other = plan_bins(lengths, 4 * 2048, window=500, seed=3, epoch=1)
    assert all(np.array_equal(a, b) for a, b in zip(plan, again)) and len(plan) == len(again)
    assert not all(np.array_equal(a, b) for a, b in zip(plan, other))
