"""Per-rank streaming of masked batches from shards, with an exact, serializable position.

An epoch is planned from document lengths alone (the `.idx.npy` sidecars and the manifest), never
from a shared queue, so every rank computes the same plan independently:

1. the shards are permuted by (seed, epoch) and their samples (blocks.py) concatenated: N samples;
2. data-parallel rank r takes the contiguous range [r·N/DP, (r+1)·N/DP): sequential reads, equal
   counts on every rank (the N mod DP remainder is left out of that epoch and reported), identical
   batches on tensor-parallel peers (they share the DP rank);
3. a shuffle buffer, simulated on sample indices with its own seed (seed, epoch, rank), reorders
   the range;
4. batch j holds samples [j·b, (j+1)·b) of that order; loader worker w of W builds the batches
   g ≡ w (mod W) of the rank's flat batch sequence, which is the order a DataLoader yields them in.

The position is (epoch, next batch): a resumed stream continues with exactly the batch an
uninterrupted run would have produced next. Masking is seeded by (seed, epoch, sample index in
the epoch's global order), independent of ranks and workers.
"""

from __future__ import annotations

import functools
import io
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from megamlm.data.blocks import BLOCK_MODES, plan_blocks
from megamlm.data.masking import Masker
from megamlm.data.shards import ShardError
from megamlm.data.tokenizer import BOS


class CorruptShardError(ShardError):
    pass


class ShardSet:
    """The shards of one split: manifest checks, document index, token reads by offset."""

    def __init__(self, folder: str | Path, split: str = "train", dictionary_sha256: str | None = None):
        self.folder = Path(folder)
        manifest_path = self.folder / "manifest.json"
        if not manifest_path.is_file():
            raise ShardError(f"{manifest_path} not found: not a shard folder, or its build did not "
                             f"finish (build with `megamlm shards build`)")
        self.manifest = json.loads(manifest_path.read_text())
        if dictionary_sha256 is not None and self.manifest["dictionary_sha256"] != dictionary_sha256:
            raise ShardError(
                f"{self.folder} was built with another dictionary ({self.manifest['dictionary_size']} "
                f"symbols, sha256 {self.manifest['dictionary_sha256'][:12]}) than this model's "
                f"(sha256 {dictionary_sha256[:12]}); rebuild the shards with the model's tokenizer")
        if split not in self.manifest["splits"]:
            raise ShardError(f"{self.folder} has no '{split}' split; it has: "
                             f"{', '.join(self.manifest['splits']) or 'none'}")
        self.shards = []
        self.excluded: list[str] = []
        for shard in self.manifest["splits"][split]["shards"]:
            path = self.folder / shard["name"]
            problem = self._check(path, shard)
            if problem:
                warnings.warn(f"skipping shard {path}: {problem}")
                self.excluded.append(str(path))
            else:
                self.shards.append(dict(shard, path=path))
        if not self.shards:
            raise ShardError(f"{self.folder}: no readable '{split}' shard")

    @staticmethod
    def _check(path: Path, shard: dict) -> str | None:
        """A stat per shard: every rank reaches the same verdict without reading data."""
        if not path.is_file() or not path.with_suffix(".idx.npy").is_file():
            return "missing (tar or index)"
        if path.stat().st_size != shard["bytes"]:
            return f"truncated or altered ({path.stat().st_size} bytes, manifest says {shard['bytes']})"
        return None

    @functools.lru_cache(maxsize=64)
    def index(self, shard: int) -> np.ndarray:
        """[n_docs, 3] (data offset, data size, tokens) of one shard."""
        return np.load(self.shards[shard]["path"].with_suffix(".idx.npy"))

    @functools.lru_cache(maxsize=64)
    def doc_starts(self, shard: int) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.index(shard)[:, 2])])

    def block_counts(self, seq_length: int, mode: str) -> np.ndarray:
        if mode not in BLOCK_MODES:
            raise ShardError(f"data.block_mode={mode}; allowed: {', '.join(BLOCK_MODES)}")
        if seq_length == self.manifest["seq_length"]:
            return np.array([s["blocks"][mode] for s in self.shards], dtype=np.int64)
        return np.array([len(plan_blocks(self.index(i)[:, 2], seq_length, mode))
                         for i in range(len(self.shards))], dtype=np.int64)

    def read_tokens(self, shard: int, start: int, end: int) -> np.ndarray:
        """Tokens [start, end) of the shard's concatenated document stream."""
        index, starts = self.index(shard), self.doc_starts(shard)
        first = int(np.searchsorted(starts, start, side="right") - 1)
        last = int(np.searchsorted(starts, end, side="left"))
        pieces = []
        path = self.shards[shard]["path"]
        with open(path, "rb") as f:
            for doc in range(first, last):
                offset, size, count = index[doc]
                f.seek(offset)
                try:
                    ids = np.load(io.BytesIO(f.read(size)), allow_pickle=False)
                except Exception as err:  # numpy raises several types on garbage bytes
                    raise CorruptShardError(f"{path}: document {doc} unreadable ({err})") from None
                if len(ids) != count:
                    raise CorruptShardError(f"{path}: document {doc} has {len(ids)} tokens, index says {count}")
                pieces.append(ids)
        stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        return stream[start - starts[first]: end - starts[first]].astype(np.int64)


@dataclass
class StreamPosition:
    """Where a rank's stream continues: the next batch of `epoch` (serializable as a dict)."""

    epoch: int = 0
    batch: int = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch}


@dataclass
class EpochPlan:
    shard: np.ndarray        # [n] shard of each sample of this rank, in yield order
    block: np.ndarray        # [n] sample index within its shard
    global_index: np.ndarray  # [n] position in the epoch's global order (seeds the masking)


def plan_epoch(counts: np.ndarray, seed: int, epoch: int, dp_rank: int, dp_size: int,
               shuffle_buffer: int) -> EpochPlan:
    order = np.random.default_rng([seed, epoch]).permutation(len(counts))
    ordered_counts = counts[order]
    ends = np.cumsum(ordered_counts)
    total = int(ends[-1])
    per_rank = total // dp_size
    lo, hi = dp_rank * per_rank, (dp_rank + 1) * per_rank
    # materialize only this rank's range: [lo, hi) of the concatenation of ordered shards
    global_index = np.arange(lo, hi, dtype=np.int64)
    position = np.searchsorted(ends, global_index, side="right")
    shard = order[position]
    block = global_index - (ends[position] - ordered_counts[position])
    permutation = _shuffle_buffer_order(len(global_index), shuffle_buffer,
                                        np.random.default_rng([seed, epoch, dp_rank, 1]))
    return EpochPlan(shard[permutation], block[permutation], global_index[permutation])


def _shuffle_buffer_order(n: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """The order a shuffle buffer of `size` emits items 0..n-1 in (size <= 1: unchanged)."""
    if size <= 1:
        return np.arange(n)
    out, buffer = [], []
    picks = rng.integers(0, size, max(n - size, 0))
    for item in range(n):
        if len(buffer) < size:
            buffer.append(item)
            continue
        k = picks[item - size]
        out.append(buffer[k])
        buffer[k] = item
    tail = np.asarray(buffer, dtype=np.int64)
    rng.shuffle(tail)
    return np.concatenate([np.asarray(out, dtype=np.int64), tail])


class MaskedBatches(IterableDataset):
    """Infinite (or `epochs`-long) stream of masked batches for one data-parallel rank."""

    def __init__(self, shards: ShardSet, masker: Masker, *, seq_length: int, micro_batch: int,
                 block_mode: str = "complete", seed: int = 1, dp_rank: int = 0, dp_size: int = 1,
                 shuffle_buffer: int = 1000, pad_id: int = 1, epochs: int | None = None,
                 position: StreamPosition | None = None):
        self.shards, self.masker = shards, masker
        self.seq_length, self.micro_batch, self.block_mode = seq_length, micro_batch, block_mode
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.shuffle_buffer, self.pad_id, self.epochs = shuffle_buffer, pad_id, epochs
        self.position = position or StreamPosition()
        self.counts = shards.block_counts(seq_length, block_mode)
        self._bounds: dict[int, np.ndarray] = {}
        if self.batches_per_epoch() == 0:
            raise ShardError(f"{shards.folder}: {int(self.counts.sum())} samples of length "
                             f"{seq_length} cannot give every one of {dp_size} data-parallel ranks a "
                             f"batch of {micro_batch}")

    def batches_per_epoch(self) -> int:
        return int(self.counts.sum()) // self.dp_size // self.micro_batch

    def _block_bounds(self, shard: int) -> np.ndarray:
        if shard not in self._bounds:
            lengths = self.shards.index(shard)[:, 2]
            self._bounds[shard] = plan_blocks(lengths, self.seq_length, self.block_mode)
        return self._bounds[shard]

    def _sample(self, shard: int, block: int) -> np.ndarray:
        start, end = self._block_bounds(shard)[block]
        return np.concatenate([[BOS], self.shards.read_tokens(shard, int(start), int(end))])

    def _batch(self, plan: EpochPlan, epoch: int, j: int) -> dict:
        rows = range(j * self.micro_batch, (j + 1) * self.micro_batch)
        samples = []
        for r in rows:
            try:
                samples.append((self._sample(int(plan.shard[r]), int(plan.block[r])),
                                int(plan.global_index[r])))
            except CorruptShardError as err:
                warnings.warn(f"{err}; the sample is replaced by another of the same batch")
        if not samples:
            raise CorruptShardError(f"every sample of batch {j} of epoch {epoch} is unreadable")
        corrupt, readable = self.micro_batch - len(samples), list(samples)
        while len(samples) < self.micro_batch:  # same batch shape, same step count on every rank
            samples.append(readable[len(samples) % len(readable)])
        longest = max(len(s) for s, _ in samples)
        width = min(math.ceil(longest / 8) * 8, max(self.seq_length, longest))
        tokens = np.full((self.micro_batch, width), self.pad_id, dtype=np.int64)
        inputs = tokens.copy()
        targeted = np.zeros((self.micro_batch, width), dtype=bool)
        for row, (sample, index) in enumerate(samples):
            masked_input, mask = self.masker(sample, epoch, index)
            tokens[row, : len(sample)] = sample
            inputs[row, : len(sample)] = masked_input
            targeted[row, : len(sample)] = mask
        return {
            "tokens": torch.from_numpy(inputs),
            "masked_positions": torch.from_numpy(targeted),
            "targets": torch.from_numpy(tokens[targeted]),
            "sample_ids": torch.tensor([index for _, index in samples]),
            "epoch": epoch,
            "batch": j,
            "corrupt": corrupt,
        }

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch, start = self.position.epoch, self.position.batch
        per_epoch = self.batches_per_epoch()
        flat = 0  # batches of this rank's stream since the resume point
        while self.epochs is None or epoch < self.epochs:
            plan = None
            for j in range(start, per_epoch):
                if flat % workers == worker:
                    if plan is None:
                        plan = plan_epoch(self.counts, self.seed, epoch, self.dp_rank, self.dp_size,
                                          self.shuffle_buffer)
                    yield self._batch(plan, epoch, j)
                flat += 1
            epoch, start = epoch + 1, 0

    def left_out_per_epoch(self) -> int:
        """Samples of an epoch that no rank gets (N mod DP)."""
        return int(self.counts.sum()) % self.dp_size


def make_loader(stream: MaskedBatches, workers: int = 0) -> DataLoader:
    """A DataLoader that yields the stream's batches in order (batching happens in the stream)."""
    return DataLoader(stream, batch_size=None, num_workers=workers,
                      persistent_workers=workers > 0, prefetch_factor=4 if workers else None)


def advance(position: StreamPosition, batch: dict, batches_per_epoch: int) -> StreamPosition:
    """The position after consuming `batch`."""
    nxt = batch["batch"] + 1
    if nxt >= batches_per_epoch:
        return StreamPosition(batch["epoch"] + 1, 0)
    return StreamPosition(batch["epoch"], nxt)
