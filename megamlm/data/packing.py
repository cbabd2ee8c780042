"""Packed micro-batches (data.packing=packed): samples laid end to end in a token budget instead of
one right-padded row each, so no compute is spent on padding.

A sample is what the padded layout would put in one row (`<s>` + a block of whole documents,
blocks.py; at most seq_length tokens). Per epoch, from sample lengths alone (every rank computes the
same plan, no communication):

1. the epoch's sample order (stream.EpochOrder: shards permuted, shuffled within windows) is cut into
   consecutive windows of max(data.shuffle_window, MIN_WINDOW) positions;
2. each window's samples go into bins of `budget` tokens, best-fit decreasing; a bin lists its
   samples in epoch order;
3. the bins of a window are shuffled by (seed, epoch, window), so the long samples that best-fit
   places first do not open every window;
4. the epoch's bins, in order, are its micro-batches: micro-step a of update u on DP rank r takes
   bin (u·A + a)·DP + r, as padded mode takes samples with micro = 1. The bins of an update do not
   depend on how it is split over ranks and accumulation steps, and a stream resumes at a bin index.
"""

from __future__ import annotations

import bisect

import numpy as np

MIN_WINDOW = 1024
"""Samples per packing window at least: best fit needs candidates, also where the order is not
shuffled (validation streams use a shuffle window of 1)."""


def best_fit_decreasing(lengths: np.ndarray, budget: int) -> list[list[int]]:
    """Indices into `lengths` grouped in bins whose lengths sum to <= budget (each length <= budget):
    longest first, each into the bin it fills most tightly. Deterministic (ties by index)."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (tokens left, bin id), ascending
    for i in order.tolist():
        n = int(lengths[i])
        j = bisect.bisect_left(free, (n, -1))
        if j == len(free):
            bins.append([i])
            left, bin_id = budget - n, len(bins) - 1
        else:
            left, bin_id = free.pop(j)
            bins[bin_id].append(i)
            left -= n
        if left > 0:
            bisect.insort(free, (left, bin_id))
    return [sorted(b) for b in bins]


def plan_bins(lengths: np.ndarray, budget: int, window: int, seed: int, epoch: int) -> list[np.ndarray]:
    """lengths [N] of the epoch's samples in epoch order -> the epoch's bins, each an array of epoch
    positions (ascending)."""
    window = max(MIN_WINDOW, window)
    bins: list[np.ndarray] = []
    for window_id, start in enumerate(range(0, len(lengths), window)):
        packed = best_fit_decreasing(lengths[start:start + window], budget)
        shuffle = np.random.default_rng([seed, epoch, window_id, 2]).permutation(len(packed))
        bins.extend(np.asarray(packed[k], dtype=np.int64) + start for k in shuffle.tolist())
    return bins


def fill_ratio(lengths: np.ndarray, bins: list[np.ndarray], budget: int) -> float:
    """Real tokens / token slots of the bins."""
    return float(np.asarray(lengths).sum()) / (budget * max(1, len(bins)))
