"""What one update takes from the stream, in the stream's unit: samples (data.packing=padded, a
micro-batch is `micro_batch` rows of one sample each) or packed rows (packed: a micro-batch is one
row of `budget` tokens holding whole samples, packing.py). The stream (stream.MaskedBatches) counts
its epoch in this unit, and whoever starts the ranks refuses shards too small for one update with the
line a rank would print (train/preflight.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megamlm.config import Config
from megamlm.data.shards import ShardError


@dataclass(frozen=True)
class UpdateShape:
    packed: bool
    micro_batch: int
    """Samples per micro-batch (padded); packed rows have their budget instead."""
    seq_length: int
    accumulation: int
    dp_size: int
    tokens_per_micro_batch: int | None = None
    """A packed row's tokens; None: micro_batch x seq_length, the padded micro-batch's slots."""

    @classmethod
    def of(cls, cfg: Config, dp_size: int) -> UpdateShape:
        """A run's update at `dp_size` data-parallel ranks (the accumulation checked against them)."""
        return cls(cfg.data.packing == "packed", cfg.train.micro_batch_size, cfg.data.seq_length,
                   cfg.train.accumulation_steps(dp_size), dp_size, cfg.data.tokens_per_micro_batch)

    @property
    def budget(self) -> int:
        """Tokens of one packed row."""
        return self.tokens_per_micro_batch or self.micro_batch * self.seq_length

    @property
    def units_per_micro(self) -> int:
        """Stream units in one micro-batch of one rank: a packed row, or micro_batch samples."""
        return 1 if self.packed else self.micro_batch

    @property
    def global_batch(self) -> int:
        """Stream units in one update over every data-parallel rank."""
        return self.units_per_micro * self.accumulation * self.dp_size

    def refuse_unfilled(self, folder: Path, samples: int, units: int) -> None:
        """Refuse an epoch of `samples` (which fill `units`: themselves, or fewer packed rows) that does
        not fill one update."""
        if units >= self.global_batch:
            return
        unit = f"packed micro-batches of {self.budget} tokens" if self.packed else "sequences"
        raise ShardError(f"{folder}: {samples} samples of length {self.seq_length} do not fill one update of "
                         f"{self.global_batch} {unit} (micro {self.units_per_micro} x accumulation "
                         f"{self.accumulation} x DP {self.dp_size})")
