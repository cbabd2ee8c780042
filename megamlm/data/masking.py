"""Dynamic MLM masking with fairseq's MaskTokensDataset semantics.

Per block of n tokens (the `<s>`/`</s>` positions are eligible, as in the reference):
  k = floor(mask_prob * n + u), u ~ U[0, 1)      probabilistic rounding of the count
  k positions drawn without replacement are prediction targets; of those
  80% become the mask id, 10% a random ordinary token, 10% stay unchanged.
The generator is seeded by (seed, epoch, sample index), so a sample is masked the same way whatever
the number of ranks, loader workers or restarts, and differently in every epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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

    def __call__(self, tokens: np.ndarray, epoch: int, index: int):
        """tokens [n] -> (inputs [n], targeted [n] bool). Targets are tokens[targeted]."""
        rng = np.random.default_rng([self.seed, epoch, index])
        n = len(tokens)
        count = int(self.mask_prob * n + rng.random())
        targeted = np.zeros(n, dtype=bool)
        targeted[rng.choice(n, count, replace=False)] = True
        keep_or_random = targeted & (rng.random(n) < self.leave_unmasked_prob + self.random_token_prob)
        keep_share = self.leave_unmasked_prob / max(self.leave_unmasked_prob + self.random_token_prob, 1e-12)
        keep = keep_or_random & (rng.random(n) < keep_share)
        randomize = keep_or_random & ~keep
        inputs = tokens.copy()
        inputs[targeted & ~keep_or_random] = self.mask_id
        inputs[randomize] = rng.choice(self.random_ids, int(randomize.sum()))
        return inputs, targeted
