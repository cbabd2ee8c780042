"""Per-rank streaming of masked batches from shards, with an exact, serializable position.

An epoch has one global sample order, computed by every rank from document lengths alone (the
manifest and `.idx.npy` sidecars), so no rank ever talks to another about data:

1. the shards are permuted by (seed, epoch) and their samples (blocks.py) concatenated: N samples;
2. the order is shuffled within consecutive windows of `shuffle_window` samples, each by its own
   seeded permutation (random access to any position, nothing to replay on resume);
3. an update consumes the next G = micro × accumulation × DP samples of that order; micro-step a of
   data-parallel rank r takes the slice starting at (a·DP + r)·micro. So the samples of an update do
   not depend on how it is split (DP=2 sees what DP=1 with 2 accumulation steps sees), every rank
   gets the same number of batches (the N mod G remainder is left out of that epoch and reported),
   and tensor-parallel peers (same DP rank) get identical batches;
4. loader worker w of W builds micro-batches k ≡ w (mod W) of the rank's flat sequence, which is the
   order a DataLoader yields them in.

The position is (epoch, next micro-batch of this rank): a resumed stream continues with exactly the
batch an uninterrupted run would have produced next. Masking is seeded by (seed, epoch, sample index),
independent of ranks, workers and restarts.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import math
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from megamlm.data.batch import Batch, Corruption, collate
from megamlm.data.blocks import BLOCK_MODES, plan_blocks
from megamlm.data.packing import plan_bins
from megamlm.data.pairs import Pairing
from megamlm.data.shards import ShardError
from megamlm.data.tokenizer import BOS
from megamlm.data.updates import UpdateShape


class CorruptShardError(ShardError):
    pass


class ShardSet:
    """The shards of one split: manifest checks, document index, token reads by offset."""

    def __init__(self, folder: str | Path, split: str = "train", dictionary_sha256: str | None = None):
        self.folder = Path(folder)
        self.manifest = self.read_manifest(self.folder)
        self.vocab_size = int(self.manifest.get("dictionary_size", 2**31))
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
    def read_manifest(folder: Path) -> dict:
        """The shard folder's manifest.json (the keys every reader needs checked), or one line saying why not."""
        manifest_path = folder / "manifest.json"
        if not manifest_path.is_file():
            raise ShardError(f"{manifest_path} not found: not a shard folder, or its build did not "
                             f"finish (build with `megamlm shards build`)")
        try:
            manifest = json.loads(manifest_path.read_text())
            manifest["splits"], manifest["dictionary_sha256"], manifest["seq_length"]  # noqa: B018 (required keys)
        except (ValueError, KeyError, TypeError) as err:
            raise ShardError(f"{manifest_path} is corrupt ({type(err).__name__}: {err}); rebuild the "
                             f"shards (`megamlm shards build`)") from None
        return manifest

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
        """[n_docs, 3 or 4] (data offset, data size, tokens[, CRC-32]) of one shard, checked against
        the sha256 the manifest recorded (format 2)."""
        path = self.shards[shard]["path"].with_suffix(".idx.npy")
        data = path.read_bytes()
        expected = self.shards[shard].get("index_sha256")
        if expected is not None and hashlib.sha256(data).hexdigest() != expected:
            raise CorruptShardError(f"{path}: index differs from the manifest's sha256 (damaged)")
        try:
            index = np.load(io.BytesIO(data), allow_pickle=False)
        except Exception as err:  # numpy raises several types on garbage bytes
            raise CorruptShardError(f"{path}: unreadable index ({err})") from None
        if index.ndim != 2 or index.shape[1] not in (3, 4) or len(index) != self.shards[shard]["documents"]:
            raise CorruptShardError(f"{path}: index of shape {index.shape}, manifest says "
                                    f"{self.shards[shard]['documents']} documents")
        return index

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
                offset, size, count = index[doc, :3]
                f.seek(offset)
                payload = f.read(size)
                try:
                    ids = np.load(io.BytesIO(payload), allow_pickle=False)
                except Exception as err:  # numpy raises several types on garbage bytes
                    raise CorruptShardError(f"{path}: document {doc} unreadable ({err})") from None
                if index.shape[1] == 4 and zlib.crc32(payload) != index[doc, 3]:
                    raise CorruptShardError(f"{path}: document {doc} fails its checksum (damaged bytes)")
                if len(ids) != count:
                    raise CorruptShardError(f"{path}: document {doc} has {len(ids)} tokens, index says {count}")
                outside = ids[(ids >= self.vocab_size) | (ids < 0)]
                if len(outside):  # never fed to the embedding: an id outside the dictionary is damage
                    raise CorruptShardError(f"{path}: document {doc} holds token id {int(outside[0])}, "
                                            f"outside the dictionary of {self.vocab_size} symbols")
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


class EpochOrder:
    """The global sample order of one epoch: position -> (shard, block in shard, sample index)."""

    def __init__(self, counts: np.ndarray, seed: int, epoch: int, window: int):
        self.counts, self.seed, self.epoch, self.window = counts, seed, epoch, max(1, window)
        self.order = np.random.default_rng([seed, epoch]).permutation(len(counts))
        self.ends = np.cumsum(counts[self.order])
        self.total = int(self.ends[-1])
        self._window_id, self._permutation = -1, None

    def _window(self, window_id: int) -> np.ndarray:
        size = min(self.window, self.total - window_id * self.window)
        return np.random.default_rng([self.seed, self.epoch, window_id, 1]).permutation(size)

    def sample(self, position: int) -> tuple[int, int, int]:
        window_id, offset = divmod(position, self.window)
        if window_id != self._window_id:
            self._window_id, self._permutation = window_id, self._window(window_id)
        index = window_id * self.window + int(self._permutation[offset])
        return (*self.locate(index), index)

    def locate(self, index: int) -> tuple[int, int]:
        """(shard, block in shard) of the sample with this index."""
        slot = int(np.searchsorted(self.ends, index, side="right"))
        shard = int(self.order[slot])
        return shard, index - int(self.ends[slot] - self.counts[shard])

    def indices(self) -> np.ndarray:
        """[total] the sample index of every position (`sample`'s third value, all at once)."""
        return np.concatenate([w * self.window + self._window(w) for w in range(-(-self.total // self.window))])


class MaskedBatches(IterableDataset):
    """Infinite (or `epochs`-long) stream of corrupted batches (data/batch.py's Batch) for one
    data-parallel rank; `corruption` is the objective's (MLM: masking.py's Masker).

    packing="padded": a micro-batch is `micro_batch` samples, one per row. packing="packed": a
    micro-batch is one row of `tokens_per_micro_batch` tokens holding a bin of whole samples
    (packing.py); the unit an update is counted in is then a bin instead of a sample."""

    def __init__(self, shards: ShardSet, corruption: Corruption, *, seq_length: int, micro_batch: int,
                 accumulation: int = 1, block_mode: str = "complete", seed: int = 1,
                 dp_rank: int = 0, dp_size: int = 1, shuffle_window: int = 1000, pad_id: int = 1,
                 epochs: int | None = None, position: StreamPosition | None = None, pad_multiple: int = 8,
                 packing: str = "padded", tokens_per_micro_batch: int | None = None,
                 pairing: Pairing | None = None):
        """`pairing`: sentence-pair objectives (NSP, SOP) make each sample a pair before corruption."""
        self.shards, self.corruption, self.pairing = shards, corruption, pairing
        # batches are padded to a multiple of this (capped at seq_length); = seq_length gives every
        # batch one shape, which compiled layers need to avoid recompiling per batch width
        self.pad_multiple = pad_multiple
        self.seq_length, self.micro_batch, self.block_mode = seq_length, micro_batch, block_mode
        self.accumulation, self.seed, self.dp_rank, self.dp_size = accumulation, seed, dp_rank, dp_size
        self.shuffle_window, self.pad_id, self.epochs = shuffle_window, pad_id, epochs
        self.position = position or StreamPosition()
        shape = UpdateShape(packing == "packed", micro_batch, seq_length, accumulation, dp_size, tokens_per_micro_batch)
        self.packed, self.budget = shape.packed, shape.budget
        self.units_per_micro, self.global_batch = shape.units_per_micro, shape.global_batch  # bins or samples
        self.counts = shards.block_counts(seq_length, block_mode)
        self._bounds: dict[int, np.ndarray] = {}
        self._bins: tuple[int, list[np.ndarray]] | None = None  # (epoch, its bins)
        shape.refuse_unfilled(shards.folder, int(self.counts.sum()), self._units(0))

    def _units(self, epoch: int) -> int:
        return len(self.bins(epoch)) if self.packed else int(self.counts.sum())

    def batches_per_epoch(self, epoch: int = 0) -> int:
        """Micro-batches per rank in `epoch` (whole updates only; packed: depends on the epoch)."""
        return self._units(epoch) // self.global_batch * self.accumulation

    def bins(self, epoch: int) -> list[np.ndarray]:
        """Packed: the epoch's bins (arrays of epoch positions), planned from sample lengths."""
        if self._bins is None or self._bins[0] != epoch:
            order = EpochOrder(self.counts, self.seed, epoch, self.shuffle_window)
            lengths = np.concatenate([np.diff(self._block_bounds(int(shard)), axis=1)[:, 0] + 1  # + <s>
                                      for shard in order.order])
            self._bins = epoch, plan_bins(lengths[order.indices()], self.budget, self.shuffle_window,
                                          self.seed, epoch)
        return self._bins[1]

    def _positions(self, epoch: int, k: int):
        """Positions in the epoch order of this rank's micro-batch k."""
        update, micro_step = divmod(k, self.accumulation)
        start = update * self.global_batch + (micro_step * self.dp_size + self.dp_rank) * self.units_per_micro
        return self.bins(epoch)[start].tolist() if self.packed else range(start, start + self.micro_batch)

    def _block_bounds(self, shard: int) -> np.ndarray:
        if shard not in self._bounds:
            lengths = self.shards.index(shard)[:, 2]
            self._bounds[shard] = plan_blocks(lengths, self.seq_length, self.block_mode)
        return self._bounds[shard]

    def _sample(self, shard: int, block: int) -> np.ndarray:
        start, end = self._block_bounds(shard)[block]
        return np.concatenate([[BOS], self.shards.read_tokens(shard, int(start), int(end))])

    def _batch(self, order: EpochOrder, epoch: int, j: int) -> Batch:
        samples, positions = [], self._positions(epoch, j)
        for position in positions:
            shard, block, index = order.sample(position)
            try:
                samples.append((self._sample(shard, block), index))
            except CorruptShardError as err:
                fate = "left out" if self.packed else "replaced by another of the same batch"
                warnings.warn(f"{err}; the sample is {fate}")
        if not samples:
            raise CorruptShardError(f"every sample of batch {j} of epoch {epoch} is unreadable")
        corrupt = len(positions) - len(samples)
        if not self.packed:
            readable = list(samples)
            while len(samples) < self.micro_batch:  # same batch shape, same step count on every rank
                samples.append(readable[len(samples) % len(readable)])
        labels = None
        if self.pairing is not None:  # never longer than the sample: packing plans and widths hold
            pairs = [self.pairing(sample, epoch, index, functools.partial(self._partner, order, epoch, index))
                     for sample, index in samples]
            samples = [(pair, index) for (pair, _), (_, index) in zip(pairs, samples)]
            labels = [label for _, label in pairs]
        if self.packed:  # the row keeps its width: a left-out sample is padding
            return collate(samples, self.corruption, epoch, self.budget, self.pad_id, packed=True,
                           pair_labels=labels, batch=j, corrupt=corrupt)
        longest = max(len(s) for s, _ in samples)
        width = min(math.ceil(longest / self.pad_multiple) * self.pad_multiple, max(self.seq_length, longest))
        return collate(samples, self.corruption, epoch, width, self.pad_id, pair_labels=labels, batch=j,
                       corrupt=corrupt)

    def _partner(self, order: EpochOrder, epoch: int, index: int) -> np.ndarray | None:
        """NSP's other sample for the sample at epoch index `index` (None if it cannot be read)."""
        shard, block = order.locate(self.pairing.partner_index(epoch, index, order.total))
        try:
            return self._sample(shard, block)
        except CorruptShardError as err:
            warnings.warn(f"{err}; the pair keeps its own continuation")
            return None

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch, start = self.position.epoch, self.position.batch
        flat = 0  # batches of this rank's stream since the resume point
        while self.epochs is None or epoch < self.epochs:
            order = EpochOrder(self.counts, self.seed, epoch, self.shuffle_window)
            for j in range(start, self.batches_per_epoch(epoch)):
                if flat % workers == worker:
                    yield self._batch(order, epoch, j)
                flat += 1
            epoch, start = epoch + 1, 0

    def left_out_per_epoch(self) -> int:
        """Samples of epoch 0 in no update (padded: N mod global batch; packed: those in the bins
        after the last whole update)."""
        if not self.packed:
            return int(self.counts.sum()) % self.global_batch
        bins = self.bins(0)
        return sum(len(b) for b in bins[len(bins) // self.global_batch * self.global_batch:])


def advance(position: StreamPosition, batch: Batch, batches_per_epoch: int) -> StreamPosition:
    """The position after consuming `batch` (`batches_per_epoch`: of the batch's epoch)."""
    nxt = batch.batch + 1
    if nxt >= batches_per_epoch:
        return StreamPosition(batch.epoch + 1, 0)
    return StreamPosition(batch.epoch, nxt)
