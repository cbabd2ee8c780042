"""Sentence pairs for BERT's next-sentence prediction (NSP) and ALBERT's sentence-order prediction (SOP).

A pair is made from a sample's first document (its tokens after `<s>` up to the first `</s>`, cut to
the sample's length less the pair's two separators), split at a random point into A and B:

    <s> A </s> B </s>          label 0: B follows A in the document
    sop: <s> B </s> A </s>     label 1 with probability 0.5 (the two segments swapped)
    nsp: <s> A </s> B' </s>    label 1 with probability 0.5 (B' as long as B, from another sample's
                               first document, a sample drawn at random from the epoch)

The model's token types count the separators (A = 0, B = 1), so a pair needs no other tensor. Every
choice is seeded by (seed, epoch, sample index): the pairs of a resumed run, of any DP / TP layout and
of validation are the uninterrupted run's. A pair is never longer than its sample (packing plans stay
valid); a document of fewer than two tokens stays as it is, label 0.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from megamlm.data.dictionary import BOS, EOS

PAIR_KINDS = ("nsp", "sop")
SWAP_PROBABILITY = 0.5
"""BERT's and ALBERT's share of label-1 pairs."""


def first_document(sample: np.ndarray) -> np.ndarray:
    """The tokens after `<s>` up to (without) the first `</s>`."""
    content = sample[1:]
    ends = np.flatnonzero(content == EOS)
    return content[: ends[0]] if len(ends) else content


class Pairing:
    """(sample, epoch, index, partner) -> (pair, label); `partner()` reads another sample (NSP) or
    returns None when it cannot be read (then B follows A, label 0)."""

    def __init__(self, kind: str, seed: int):
        if kind not in PAIR_KINDS:
            raise ValueError(f"pair kind {kind!r}; allowed: {', '.join(PAIR_KINDS)}")
        self.kind, self.seed = kind, seed

    def rng(self, epoch: int, index: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, epoch, index, PAIR_KINDS.index(self.kind) + 17])

    def partner_index(self, epoch: int, index: int, total: int) -> int:
        """NSP: the index of the sample that lends B' (any of the epoch's `total` but this one)."""
        other = int(np.random.default_rng([self.seed, epoch, index, 29]).integers(max(total - 1, 1)))
        return other + (other >= index and total > 1)

    def __call__(self, sample: np.ndarray, epoch: int, index: int,
                 partner: Callable[[], np.ndarray | None] | None = None) -> tuple[np.ndarray, int]:
        document = first_document(sample)[: max(len(sample) - 3, 0)]
        if len(document) < 2:
            return sample, 0
        rng = self.rng(epoch, index)
        split = int(rng.integers(1, len(document)))
        a, b, label = document[:split], document[split:], 0
        if rng.random() < SWAP_PROBABILITY:
            if self.kind == "sop":
                a, b, label = b, a, 1
            else:
                other = partner() if partner is not None else None
                replacement = first_document(other)[: len(b)] if other is not None else np.zeros(0)
                if len(replacement):
                    b, label = replacement, 1
        pair = np.concatenate([[BOS], a, [EOS], b, [EOS]]).astype(sample.dtype)
        return pair, label
