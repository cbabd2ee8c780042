"""The DeepSpeed engine: JSON generated from our config, ZeRO over the data-parallel group only.

DeepSpeed learns the layout from an `mpu` object. megatron's parallel_state lacks the
`get_model_parallel_*` names DeepSpeed asks for, so `ModelParallelUnit` answers from our
ParallelContext. It deliberately has no `initialize_sequence_parallel` attribute: DeepSpeed would
then take the sequence-parallel path and drop model-parallel handling.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from megamlm.config import Config, ConfigError
from megamlm.model.tp import tp_sharded
from megamlm.parallel import ParallelContext
from megamlm.train.flat import FlatEngine
from megamlm.train.guard import TrainingDiverged
from megamlm.train.loss_scale import FP16_LOSS_SCALING
from megamlm.train.schedule import Schedule


class ModelParallelUnit:
    """What DeepSpeed's `mpu` must provide (ZeRO partitions over the DP group; the gradient norm
    counts TP-sharded parameters once per shard and replicated ones once)."""

    def __init__(self, ctx: ParallelContext):
        self.ctx = ctx

    def get_model_parallel_rank(self):
        return self.ctx.tp_rank

    def get_model_parallel_world_size(self):
        return self.ctx.tp_size

    def get_model_parallel_group(self):
        return self.ctx.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self):
        return self.ctx.dp_rank

    def get_data_parallel_world_size(self):
        return self.ctx.dp_size

    def get_data_parallel_group(self):
        return self.ctx.dp_group


def deepspeed_config(cfg: Config, dp_size: int, stage: int | None = None) -> dict:
    """The DeepSpeed JSON for this run (or the user's file, checked against our batch arithmetic);
    `stage`: the ZeRO stage (default: the one the layout gets, `TrainConfig.engine_zero_stage`)."""
    train = cfg.train
    if train.engine == "flat":
        raise ConfigError("train.engine=flat runs without DeepSpeed: there is no DeepSpeed JSON to generate")
    stage = train.engine_zero_stage(dp_size) if stage is None else stage
    accumulation = train.accumulation_steps(dp_size)
    global_batch = train.global_batch(dp_size)
    if train.deepspeed_config:
        path = Path(train.deepspeed_config)
        try:
            ds = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"train.deepspeed_config={path}: cannot read JSON ({err})") from None
        for key, ours in (("train_micro_batch_size_per_gpu", train.micro_batch_size),
                          ("gradient_accumulation_steps", accumulation),
                          ("train_batch_size", global_batch)):
            if key in ds and ds[key] != ours:
                raise ConfigError(f"{path}: {key}={ds[key]} disagrees with the config's {ours} "
                                  f"(train.micro_batch_size / global_batch_size); make them agree")
        ds.update(train_micro_batch_size_per_gpu=train.micro_batch_size,
                  gradient_accumulation_steps=accumulation, train_batch_size=global_batch)
        return ds
    ds = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": global_batch,
        # fp32 at stage 0: DeepSpeed neither reports the norm nor needs to clip (GradNorm does both)
        "gradient_clipping": 0.0 if _plain_fp32(cfg, stage) else cfg.optim.clip_grad,
        # stage 1 without the contiguous gradient buffer: the same losses (bf16, DP=1 and DP=2, tested) with
        # 1,321 fewer host operations per update at 12 layers (benchmarks/loop_ops.py: a bucket copy of
        # every gradient in every micro-batch), and no reduce bucket of reduce_bucket_size fp32 elements
        "zero_optimization": {"stage": stage} | ({"contiguous_gradients": False} if stage == 1 else {}),
        # our optimizer is torch's AdamW (no fused/CPU-Adam kernels to build)
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,  # we log ourselves
        "wall_clock_breakdown": False,
    }
    if train.precision == "bf16":
        ds["bf16"] = {"enabled": True}
        if not train.skip_nonfinite_updates:  # DeepSpeed's default is to scan
            ds["bf16"]["check_grad_overflow"] = False
    elif train.precision == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, **FP16_LOSS_SCALING}  # dynamic, as the flat engine's
    return ds


def _plain_fp32(cfg: Config, stage: int) -> bool:
    """DeepSpeed steps the torch optimizer directly (no ZeRO, no mixed-precision wrapper)."""
    return stage == 0 and cfg.train.precision == "fp32"


class GradNorm:
    """Optimizer step pre-hook for DeepSpeed's plain fp32 path, which computes no gradient norm: the
    global L2 norm as ZeRO computes it (tensor-parallel shards counted once each, replicated
    parameters once), clipped as ZeRO clips (gradients × 1 / max(1, (norm + 1e-6) / clip)) when
    clip > 0, and stored where `engine.get_global_grad_norm()` reads it. No host sync. Without clipping
    the norm is only logged: it is computed for the updates `logged(update)` says a line follows (on a CPU
    torch's norms accumulate in fp64, ~1.5% of the demo's update), None for the others."""

    def __init__(self, engine, optimizer, ctx: ParallelContext, clip: float, logged: Callable[[int], bool]):
        self.engine, self.ctx, self.clip, self.logged = engine, ctx, clip, logged
        self.parameters = [p for group in optimizer.param_groups for p in group["params"]]
        # which parameters the norm counts is fixed by the layout: decided once, not every step
        self.counted = [p for p in self.parameters if ctx.tp_rank == 0 or tp_sharded(p)]

    def __call__(self, optimizer, args, kwargs) -> None:
        if self.clip == 0 and not self.logged(self.engine.global_steps + 1):  # DeepSpeed counts it after the step
            self.engine._global_grad_norm = None
            return
        squares = torch.stack(torch._foreach_norm([p.grad for p in self.counted if p.grad is not None]))
        squares = squares.square().sum()
        if self.ctx.tp_size > 1:
            torch.distributed.all_reduce(squares, group=self.ctx.tp_group)
        norm = squares.sqrt()
        if self.clip > 0:
            factor = ((norm + 1e-6) / self.clip).clamp(min=1.0)
            torch._foreach_mul_([p.grad for p in self.parameters if p.grad is not None], 1.0 / factor)
        self.engine._global_grad_norm = norm


def build_engine(model: torch.nn.Module, cfg: Config, ctx: ParallelContext, stage: int):
    """(engine, optimizer, schedule) from a model whose parameters are already initialized, at ZeRO
    `stage` (a new run: `TrainConfig.engine_zero_stage`; a resumed one: its checkpoint's), or
    train.engine=flat's (which has one stage)."""
    if cfg.train.engine == "flat":
        engine = FlatEngine(model, cfg, ctx)
        return engine, engine.optimizer, engine.schedule
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if ctx.device.type == "cuda" else "cpu")
    import deepspeed

    if ctx.device.type == "cpu":
        without_the_inference_all_reduce_op()
    if cfg.train.precision == "fp16" and ctx.device.type == "cpu":
        raise ConfigError("train.precision=fp16 on DeepSpeed needs a CUDA GPU; on a CPU: fp32, bf16, or "
                          "train.engine=flat")
    optim = cfg.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, **optim.adamw(),
                                  fused=True)  # one kernel per step: 5x faster than foreach on CPU too
    if stage == 3:
        # e.g. the tied embedding, used by the MLM head outside the embedding's own forward
        for module, param in getattr(model, "external_parameters", list)():
            deepspeed.zero.register_external_parameter(module, param)
    engine, optimizer, _, schedule = deepspeed.initialize(
        model=model, optimizer=optimizer, config=deepspeed_config(cfg, ctx.dp_size, stage),
        mpu=ModelParallelUnit(ctx),
        lr_scheduler=lambda opt: Schedule(opt, cfg.optim, cfg.train.steps))
    if engine.zero_optimization_stage() == 0 and ctx.dp_size == 1:  # (a train.deepspeed_config may set the stage)
        # nothing to all-reduce over one data-parallel rank: DeepSpeed would still flatten every gradient into
        # one buffer and copy it back after each update (~4% of the CPU demo's update; the same numbers). ZeRO's
        # optimizers (stages 1-3) take their gradients through this reduction: it stays on for them.
        engine.enable_backward_allreduce = False
    if _plain_fp32(cfg, stage) and not cfg.train.deepspeed_config:
        optimizer.register_step_pre_hook(GradNorm(engine, optimizer, ctx, cfg.optim.clip_grad,
                                                   cfg.train.logs_after))
    if cfg.train.precision == "fp16":
        engine.step = stopping_at_the_scale_floor(engine.step, engine)
    return engine, optimizer, schedule


def without_the_inference_all_reduce_op() -> None:
    """DeepSpeed's CPU communication backend compiles a shared-memory all-reduce (C++, OpenMP) as it starts:
    ~1 minute on a machine's first run, a line in every run's output, a .so loaded in each process, and under
    its launcher (LOCAL_SIZE: all ranks on one machine) a 66 MiB buffer per rank in /dev/shm that it never
    unlinks (RAM held until the machine restarts; DeepSpeed 0.19.8). Only its `inference_all_reduce`
    (DeepSpeed-Inference's tensor parallelism) uses it; training reduces through torch.distributed. Marked
    not compatible, the backend skips it (a DeepSpeed that no longer reads this mark only compiles it again).
    CPU only: reading the mark probes every op's builder, which DeepSpeed's CPU backend does as it starts
    anyway, and its CUDA backend does not."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


DEEPSPEED_SCALE_FLOOR = "Current loss scale already at minimum"
"""The start of the message of the bare Exception DeepSpeed's DynamicLossScaler raises on an overflow
with the fp16 loss scale at its minimum."""


def stopping_at_the_scale_floor(step, engine):
    """DeepSpeed's engine.step, with its stop at the loss scale's floor told as a diverged run (one line,
    what to do) instead of a bare Exception. (The flat engine rolls back by itself there.)"""

    @functools.wraps(step)
    def wrapped(*args, **kwargs):
        try:
            return step(*args, **kwargs)
        except Exception as err:
            if not str(err).startswith(DEEPSPEED_SCALE_FLOOR):
                raise
            raise TrainingDiverged(
                f"training diverged at update {engine.global_steps + 1}: its fp16 gradients overflowed with "
                f"DeepSpeed's loss scale at its minimum ({FP16_LOSS_SCALING['min_loss_scale']:g}); resume from "
                f"an earlier checkpoint (--resume TAG), or train with train.engine=flat, which rolls back by "
                f"itself with a new data seed") from err

    return wrapped
