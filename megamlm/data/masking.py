"""Dynamic MLM masking (data.masking): fairseq's token masking, whole-word masking, span masking.

token (fairseq MaskTokensDataset; the reference). Per sample of n tokens (the `<s>`/`</s>` positions
are eligible, as in the reference):
  k = floor(mask_prob * n + u), u ~ U[0, 1)      probabilistic rounding of the count
  k positions drawn without replacement are prediction targets; of those
  80% become the mask id, 10% a random ordinary token, 10% stay unchanged.
whole_word (BERT's whole-word masking, fairseq's mask_whole_words): the same draw over the sample's
  w words instead of its tokens (k = floor(mask_prob * w + u) words; the 80/10/10 decision is made per
  word), then every token of a chosen word is a target: a word is never split. A word is a token that
  starts one (GPT-2 BPE: its piece begins with the space marker `Ġ`; specials are words of their own)
  plus the continuation pieces after it (Tokenizer.word_starts).
span (SpanBERT): spans of whole words, lengths from a geometric law (p = data.span_p) truncated at
  data.span_max_words (mean 3.8 words for 0.2 and 10), at uniformly drawn word starts, until the
  targets reach floor(mask_prob * n + u) tokens; the 80/10/10 decision is made per span.
The generator is seeded by (seed, epoch, sample index), so a sample is masked the same way whatever
the number of ranks, loader workers or restarts, and differently in every epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

STRATEGIES = ("token", "whole_word", "span")
MASK, RANDOM, KEEP = 1, 2, 3  # what happens to a target unit


@dataclass(frozen=True)
class Masker:
    mask_id: int
    """`<mask>` (50264), or len(dictionary) for zero-clap."""
    random_ids: np.ndarray
    """Ids random replacement draws from (ordinary symbols)."""
    mask_prob: float = 0.15
    leave_unmasked_prob: float = 0.1
    random_token_prob: float = 0.1
    seed: int = 1
    strategy: str = "token"
    """token | whole_word | span (the module docstring)."""
    word_starts: np.ndarray | None = None
    """[vocabulary] bool: the id starts a word (whole_word, span)."""
    span_p: float = 0.2
    span_max_words: int = 10

    def __call__(self, tokens: np.ndarray, epoch: int, index: int):
        """tokens [n] -> (inputs [n], targeted [n] bool). Targets are tokens[targeted]."""
        rng = np.random.default_rng([self.seed, epoch, index])
        if self.strategy == "token":
            return self._token(tokens, rng)
        starts = self.word_starts[tokens]
        starts[0] = True
        word_of = np.cumsum(starts) - 1  # [n] word index of each token
        lengths = np.bincount(word_of)  # [w] tokens per word
        units = self._whole_words(lengths, rng) if self.strategy == "whole_word" else self._spans(lengths, rng)
        return self._apply(tokens, units[word_of], rng)

    def _token(self, tokens: np.ndarray, rng: np.random.Generator):
        n = len(tokens)
        count = int(self.mask_prob * n + rng.random())
        targeted = np.zeros(n, dtype=bool)
        targeted[rng.choice(n, count, replace=False)] = True
        keep_or_random = targeted & (rng.random(n) < self.leave_unmasked_prob + self.random_token_prob)
        keep = keep_or_random & (rng.random(n) < self._keep_share())
        randomize = keep_or_random & ~keep
        inputs = tokens.copy()
        inputs[targeted & ~keep_or_random] = self.mask_id
        inputs[randomize] = rng.choice(self.random_ids, int(randomize.sum()))
        return inputs, targeted

    def _keep_share(self) -> float:
        return self.leave_unmasked_prob / max(self.leave_unmasked_prob + self.random_token_prob, 1e-12)

    def _decide(self, chosen: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """[u] chosen units -> [u] 0 | MASK | RANDOM | KEEP, 80/10/10 per unit."""
        u = len(chosen)
        keep_or_random = chosen & (rng.random(u) < self.leave_unmasked_prob + self.random_token_prob)
        keep = keep_or_random & (rng.random(u) < self._keep_share())
        return np.select([keep, keep_or_random, chosen], [KEEP, RANDOM, MASK], 0)

    def _whole_words(self, lengths: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        words = len(lengths)
        chosen = np.zeros(words, dtype=bool)
        chosen[rng.choice(words, int(self.mask_prob * words + rng.random()), replace=False)] = True
        return self._decide(chosen, rng)

    def span_length(self, rng: np.random.Generator) -> int:
        """Geometric(span_p) words, redrawn until <= span_max_words (SpanBERT's clipping)."""
        while True:
            length = int(rng.geometric(self.span_p))
            if length <= self.span_max_words:
                return length

    def _spans(self, lengths: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        words = len(lengths)
        budget = int(self.mask_prob * lengths.sum() + rng.random())
        decision = np.zeros(words, dtype=np.int64)
        covered, attempts = 0, 0
        while covered < budget and attempts < 10 * words:  # spans may overlap; bounded retries
            attempts += 1
            start = int(rng.integers(words))
            span = slice(start, min(start + self.span_length(rng), words))
            new = decision[span] == 0
            if not new.any():
                continue
            kind = self._decide(np.ones(1, dtype=bool), rng)[0]
            decision[span][new] = kind
            covered += int(lengths[span][new].sum())
        return decision

    def _apply(self, tokens: np.ndarray, decision: np.ndarray, rng: np.random.Generator):
        """Per-token decisions -> (inputs, targeted)."""
        inputs = tokens.copy()
        inputs[decision == MASK] = self.mask_id
        randomize = decision == RANDOM
        inputs[randomize] = rng.choice(self.random_ids, int(randomize.sum()))
        return inputs, decision > 0
