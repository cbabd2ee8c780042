"""The config's train section: batch arithmetic, precision, the engine and its options, evaluation,
checkpoints and guards (config/sections.py holds the other sections and the whole Config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megamlm.config.checks import ConfigError, check_bounds, check_fields, unmet


@dataclass
class TrainConfig:
    """The run: batch arithmetic, engine, evaluation, checkpoints, guards."""

    seed: int = 1
    """Seed for initialization, dropout, data order and masking; results do not depend on TP."""
    micro_batch_size: int = 8
    """Sequences per forward pass on one data-parallel rank."""
    global_batch_size: int | None = None
    """Sequences per update over all ranks = micro × accumulation × DP; null = micro × DP."""
    steps: int = 20
    """Optimizer updates."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """fp32, bf16, or fp16 with dynamic loss scaling (the reference)."""
    engine: Literal["deepspeed", "flat"] = "deepspeed"
    """What steps the optimizer. deepspeed: DeepSpeed's engine at train.zero_stage. flat: megamlm's own
    ZeRO-1 (train/flat.py): weights and gradients as views of flat buffers, one fused AdamW over this
    data-parallel rank's range, 14-49 host operations per optimizer step instead of DeepSpeed's
    1,300-3,300 at 12 layers (benchmarks/loop_ops.py); fp32, bf16 or fp16 (its dynamic loss scale on
    the device, DeepSpeed's rule; also on a CPU), train.zero_stage 0 or 1 (its optimizer state is cut
    over DP either way). Its checkpoints are in DeepSpeed's stage-0 layout:
    they resume on either engine at any layout and convert as any other."""
    fp32_grad_accumulation: bool = False
    """train.engine=flat, bf16 / fp16: add each micro-batch's gradients to the fp32 buffer that the
    update reduces over DP anyway, instead of summing an update's micro-batches in the weights' dtype
    (false: DeepSpeed's ZeRO-1 default, which the flat engine matches bit for bit). megatron accumulates
    bf16 gradients in fp32 always: a 16-bit running sum keeps 8 (bf16) or 11 (fp16) significant bits of
    each addend, and the Pile recipes accumulate 16-32 micro-batches (BENCHMARKS.md, "Gradient
    accumulation"). Costs an add and a zero over the gradient buffer per micro-batch, no memory."""
    overlap_grad_reduce: bool = False
    """train.engine=flat, DP > 1: reduce-scatter the gradients over DP in buckets (train.grad_bucket_size),
    each as soon as the update's last backward has finished it (megatron-core's overlap_grad_reduce),
    instead of in one collective after the backward. The same sums; the norm adds its rows in another order."""
    grad_bucket_size: int = 40_000_000
    """Gradient elements per reduce-scatter under train.overlap_grad_reduce (megatron-core's default)."""
    grad_reduce_in_fp32: bool = True
    """train.engine=flat, bf16 / fp16: reduce the gradients over DP in an fp32 copy of the whole buffer.
    false: reduce the 16-bit buffer itself (megatron's --grad-reduce-in-bf16; DeepSpeed's ZeRO reduces so
    by default, its communication_data_type), each rank's share divided by DP first as megatron does:
    half the bytes over DP and 4 bytes less memory per parameter (only this rank's part is copied to
    fp32), each sum rounded to 8 (bf16) or 11 (fp16) significant bits: an error that grows as about √DP
    and passes the 16-bit backward's own from DP = 32 on (BENCHMARKS.md)."""
    zero_stage: int = 1
    """DeepSpeed ZeRO stage 0-3 (optimizer states / + gradients / + parameters sharded over DP). An
    fp32 run on one data-parallel rank runs at stage 0 whatever this says (`engine_zero_stage`)."""
    skip_nonfinite_updates: bool = True
    """bf16: DeepSpeed scans every gradient for inf / NaN before each update and skips an update that
    has one (its `check_grad_overflow`). The scan costs about 1,900 host operations and two waits for
    the device per update at 12 layers (benchmarks/loop_ops.py). false: no scan, no wait; a non-finite
    gradient then reaches the weights, the next loss is non-finite and the spike guard rolls back to
    the last checkpoint (before the first one, the run stops: "no checkpoint to roll back to"). fp16
    always scans (its loss scale needs it); fp32 never does."""
    deepspeed_config: str | None = None
    """A DeepSpeed JSON file used instead of the one generated from this config (batch sizes must agree)."""
    run_dir: str = "runs/default"
    """Checkpoints, TensorBoard events and logs go here."""
    init_from: str | None = None
    """A model folder (a trained <run_dir>/final or `megamlm convert` output) whose weights start the
    run; its model section must describe the same architecture. Ignored when resuming a checkpoint."""
    log_interval: int = 10
    """Updates between log lines."""
    eval_interval: int = 100
    """Updates between validation runs (also before the first and after the last update)."""
    eval_batches: int = 50
    """Validation micro-batches per rank (fewer if the valid split is smaller)."""
    save_interval: int = 500
    """Updates between checkpoints (also at the end and on SIGTERM/SIGUSR1)."""
    activation_checkpointing: bool = False
    """Recompute each encoder layer's activations in the backward pass (long sequences: less
    memory, about one more forward of compute)."""
    compile: bool = False
    """torch.compile each encoder layer (fuses its elementwise chain: bias, dropout, residual,
    LayerNorm, GELU); batches are then padded to data.seq_length so that every batch has one
    shape. roberta.base at 2048 in the training loop on an H200: 163-185k tokens/s against 151-166k
    eager (BENCHMARKS.md); measure before turning it on. The first update compiles; its time is logged
    once (event "compile", first_update_s) so that the cost of compiling is visible next to the later
    updates."""
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    """torch.compile's mode under train.compile. reduce-overhead: Inductor also records each layer as a
    CUDA graph (no per-kernel launch cost; train.compile's one batch shape makes that possible);
    max-autotune: also searches matmul / Triton configurations, FlexAttention's kernels among them
    (minutes of compilation), with CUDA graphs; max-autotune-no-cudagraphs: the search alone. GPU
    options, to be measured (benchmarks/train_throughput.py --compile --compile-mode); on CPU they
    compile as default."""
    compile_head: bool = False
    """torch.compile the MLM head and its loss (MaskedLM.loss_sum), dynamic in the number of masked positions
    (one compilation for every batch): Inductor fuses the eager passes over the [n, V] logits (the fp32 copy,
    max, exp, sums, the softmax gradient; ~8 kernels of 0.3-0.6 ms per micro-batch on an H200 at base/2048,
    BENCHMARKS.md). TP=1, model.head_loss=unfused, ZeRO stage < 3, MLM-family objectives. Off by default
    until a GPU measures it (gpu.sh: loop-2048-flat-compiled-micro16-head)."""
    profile_updates: int = 0
    """Updates to record with torch.profiler after two warm-up updates (rank 0; 0: none): prints the
    operator table (by device time on a GPU), writes it to run_dir/profile.txt and logs a `profile`
    event with the time per update and the share of it the GPU was busy (train/profiling.py)."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are deleted."""
    spike_factor: float = 3.0
    """A loss above spike_factor × the running median is a spike."""
    spike_patience: int = 5
    """Consecutive spiking updates that trigger a rollback (a non-finite loss triggers at once)."""
    spike_window: int = 100
    """Updates in the running median."""
    max_rollbacks: int = 3
    """Rollbacks to the last good checkpoint (with a new data seed) before giving up."""

    def __post_init__(self):
        check_fields(self, "train")
        for key in ("micro_batch_size", "steps", "log_interval", "eval_interval", "save_interval",
                    "keep_last", "spike_patience", "spike_window"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.{key}={getattr(self, key)} must be >= 1")
        if self.profile_updates < 0:
            raise ConfigError(f"train.profile_updates={self.profile_updates} must be >= 0 (0: no profile)")
        check_bounds(self, "train", {"seed": ">= 0", "global_batch_size": ">= 1", "eval_batches": ">= 1",
                                     "spike_factor": "> 1", "max_rollbacks": ">= 0",
                                     "grad_bucket_size": ">= 1"})
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"train.zero_stage={self.zero_stage} is invalid; allowed: 0 | 1 | 2 | 3")
        if not self.skip_nonfinite_updates and self.precision == "fp16":
            raise ConfigError("train.skip_nonfinite_updates=false needs train.precision=bf16: fp16's loss "
                              "scale is set from the scan it turns off")
        if self.engine == "flat":
            asks = unmet((("train.zero_stage", self.zero_stage, self.zero_stage in (0, 1)),
                          ("train.deepspeed_config", self.deepspeed_config, self.deepspeed_config is None)))
            if asks:
                raise ConfigError(f"train.engine=flat runs ZeRO-1 without a DeepSpeed JSON; "
                                  f"{asks} needs train.engine=deepspeed")
        for key, deepspeed in (("overlap_grad_reduce", "DeepSpeed's engine overlaps with zero_optimization."
                                "overlap_comm in a JSON given as train.deepspeed_config"),
                               ("fp32_grad_accumulation", "DeepSpeed's ZeRO-1 sums micro-batches in the weights' "
                                "dtype (its fp32 option is another optimizer, with another checkpoint layout)")):
            if getattr(self, key) and self.engine != "flat":
                raise ConfigError(f"train.{key}=true needs train.engine=flat: {deepspeed}")
        if not self.grad_reduce_in_fp32:
            asks = unmet((("train.engine", self.engine, self.engine == "flat"),
                          ("train.precision", self.precision, self.precision != "fp32"),
                          ("train.fp32_grad_accumulation", "true", not self.fp32_grad_accumulation)))
            if asks:
                raise ConfigError(f"train.grad_reduce_in_fp32=false reduces the flat engine's 16-bit gradients "
                                  f"as they are (DeepSpeed's engine does so already); it needs train.engine=flat, "
                                  f"train.precision=bf16 or fp16 and no fp32 sums, not {asks}")
        if self.global_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                f"train.micro_batch_size={self.micro_batch_size}")

    def engine_zero_stage(self, dp_size: int) -> int:
        """The ZeRO stage the engine runs: zero_stage, but 0 for fp32 on one data-parallel rank, where
        partitioning over a group of one saves nothing and its flattening and bucketing cost ~18% of a
        CPU step (DeepSpeed then steps torch's fused AdamW on the parameters; the losses are bit-identical).
        bf16/fp16 keep the stage: DeepSpeed's stage-0 mixed-precision optimizer accumulates differently.
        train.engine=flat: 0, the layout of its checkpoint files (train/flat.py)."""
        if self.engine == "flat":
            return 0
        return 0 if dp_size == 1 and self.precision == "fp32" else self.zero_stage

    def logs_after(self, step: int) -> bool:
        """Whether training writes a log line after update `step`: every log_interval-th, and the last."""
        return step % self.log_interval == 0 or step == self.steps

    def accumulation_steps(self, dp_size: int) -> int:
        """global = micro × accumulation × DP, checked against the world actually launched."""
        if self.global_batch_size is None:
            return 1
        per_step = self.micro_batch_size * dp_size
        if self.global_batch_size % per_step:
            raise ConfigError(
                f"train.global_batch_size={self.global_batch_size} is not divisible by "
                f"train.micro_batch_size × data-parallel size = {self.micro_batch_size} × {dp_size}; "
                f"choose a multiple of {per_step}")
        return self.global_batch_size // per_step

    def global_batch(self, dp_size: int) -> int:
        """Micro-batches' sequences (slots of seq_length tokens) per update over `dp_size` ranks: DeepSpeed's
        train_batch_size. The stream's own unit (samples, or packed rows) is data/updates.py's."""
        return self.micro_batch_size * self.accumulation_steps(dp_size) * dp_size
