"""Samples from documents: fairseq TokenBlockDataset's `complete` mode and a contiguous mode.

Every document is stored with its `</s>`. A sample is `<s>` followed by at most
`seq_length - 1` tokens:
  complete    whole documents packed greedily, in order, while they fit (fairseq
              `sample_break_mode: complete`); documents never straddle samples
  contiguous  the shard's token stream cut every `seq_length - 1` tokens (fairseq `none`)
Both are computed from document lengths alone, so ranks can plan an epoch without reading tokens.
"""

from __future__ import annotations

import numpy as np

from megamlm.errors import MegamlmError

BLOCK_MODES = ("complete", "contiguous")


def plan_blocks(lengths: np.ndarray, seq_length: int, mode: str) -> np.ndarray:
    """Document lengths [n_docs] -> block boundaries [n_blocks, 2] as token offsets into the shard's
    concatenated token stream (start, end); a sample is <s> + stream[start:end]."""
    capacity = seq_length - 1
    ends = np.cumsum(lengths, dtype=np.int64)
    total = int(ends[-1]) if len(ends) else 0
    if mode == "contiguous":
        starts = np.arange(0, total, capacity, dtype=np.int64)
        return np.stack([starts, np.minimum(starts + capacity, total)], axis=1)
    if mode != "complete":
        raise MegamlmError(f"block mode {mode!r}; allowed: {', '.join(BLOCK_MODES)}")
    bounds, start, current = [], 0, 0
    for end, length in zip(ends.tolist(), np.asarray(lengths).tolist()):
        if current and current + length > capacity:
            bounds.append((start, end - length))
            start, current = end - length, 0
        current += length
    if current:
        bounds.append((start, total))
    return np.asarray(bounds, dtype=np.int64).reshape(-1, 2)
