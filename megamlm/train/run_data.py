"""A run's data: the shards its config names (built on rank 0 if missing), and each rank's corrupted batches of
the train and valid splits, as the objective masks or replaces them."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from megamlm.config import Config
from megamlm.data.batch import Batch
from megamlm.data.loader import start_batches
from megamlm.data.shards import ShardError, ensure_shards
from megamlm.data.stream import MaskedBatches, ShardSet
from megamlm.data.tokenizer import Tokenizer
from megamlm.objectives import Objective
from megamlm.parallel import ParallelContext, barrier
from megamlm.train.checkpoint import TrainState
from megamlm.train.preflight import check_train_shards, load_tokenizer
from megamlm.train.signals import ignore_stop_signals


@dataclass
class Data:
    """What the run's streams are made of (`prepare_data`)."""

    tokenizer: Tokenizer
    shards: Path
    objective: Objective


def prepare_data(cfg: Config, ctx: ParallelContext, objective: Objective) -> Data:
    """The tokenizer and the shards, built by rank 0 where data.build_from names their text and they are missing
    (the others wait), checked on every rank against the tokenizer and the DP size before the model is built."""
    tokenizer = load_tokenizer(cfg)
    if dist.get_rank() == 0:
        ensure_shards(cfg.data, tokenizer)
    barrier()
    check_train_shards(cfg, tokenizer, ctx.dp_size)  # before the model is built (the stream comes after it)
    return Data(tokenizer, Path(cfg.data.shards), objective)


def _stream(cfg: Config, ctx: ParallelContext, data: Data, split: str, seed: int,
            **options) -> MaskedBatches:
    """This rank's corrupted batches of one split; `options` are the split-specific ones."""
    return MaskedBatches(ShardSet(data.shards, split, data.tokenizer.dictionary.sha256),
                         data.objective.corruption(data.tokenizer, seed), seq_length=cfg.data.seq_length,
                         micro_batch=cfg.train.micro_batch_size, block_mode=cfg.data.block_mode,
                         seed=seed, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size,
                         pad_id=cfg.model.pad_token_id, pad_multiple=_pad_multiple(cfg),
                         packing=cfg.data.packing, tokens_per_micro_batch=cfg.data.tokens_per_micro_batch,
                         pairing=data.objective.pairing(seed), **options)


def compiles(cfg: Config) -> bool:
    """Whether the run compiles code in its first updates: train.compile, or FlexAttention (always compiled)."""
    return cfg.train.compile or cfg.model.attention_backend == "flex"


def _pad_multiple(cfg: Config) -> int:
    """Batch widths are rounded up to a multiple of this. Compiled code (train.compile, and
    FlexAttention, which is always compiled) gets one width, data.seq_length: with a width per batch
    it recompiles and then runs dynamic-shape kernels (H100, base zero-clap at 8192 on Flex:
    55k tokens/s with per-batch widths, 88k with one width; BENCHMARKS.md)."""
    return cfg.data.seq_length if compiles(cfg) else 8


def train_stream(cfg: Config, ctx: ParallelContext, data: Data, state: TrainState) -> MaskedBatches:
    return _stream(cfg, ctx, data, "train", state.data_seed,
                   accumulation=cfg.train.accumulation_steps(ctx.dp_size),
                   shuffle_window=cfg.data.shuffle_window, position=state.position)


def train_batches(cfg: Config, ctx: ParallelContext, stream: MaskedBatches) -> Iterator[Batch]:
    """The loop's iterator over the stream: data.loader_workers processes (a stop signal is the trainer's,
    not theirs) and, on a GPU, torch's thread that takes their batches over and pins them (`make_loader`)."""
    return start_batches(stream, cfg.data.loader_workers, ignore_stop_signals, pin_memory=ctx.device.type == "cuda")


def valid_stream(cfg: Config, ctx: ParallelContext, data: Data) -> MaskedBatches | None:
    """Fixed order and masking (seed of the run, epoch 0): comparable across evaluations and variants.
    None (with a warning) when the shards have no valid split big enough for every rank."""
    try:
        return _stream(cfg, ctx, data, "valid", cfg.train.seed, shuffle_window=1, epochs=1)
    except ShardError as err:
        warnings.warn(f"no validation: {err}")
        return None
