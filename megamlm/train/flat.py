"""The flat engine (`train.engine=flat`): ZeRO-1 with the optimizer step done once over flat buffers.

DeepSpeed's ZeRO-1 works parameter by parameter at every update: a cast, a norm, slices and views per
gradient, then per-gradient inf/NaN checks with two reads of the device (`benchmarks/loop_ops.py`:
3,274 host operations in the engine step at 12 layers, 1,348 without the check). On a GPU each is a
dispatch, and the H200 loop waited on the host (BENCHMARKS.md). This engine keeps

- the model's weights (bf16 under train.precision=bf16) as views of one flat buffer and their
  gradients as views of another, so that autograd accumulates micro-batches into it in place;
- fp32 master weights and AdamW's moments for this data-parallel rank's range of that buffer only
  (ZeRO-1: the optimizer state is cut over DP), stepped by torch's fused AdamW as one tensor (one per
  bucket under train.overlap_grad_reduce, below);

so an update's step is 14 operations at any depth, 23 with the inf/NaN skip (one of them the read of
the previous update's skip flag from host memory; loop_ops.py): cast the gradients to fp32,
reduce-scatter them over DP (each rank receives the sum of its own range only: half the bytes of an
all-reduce), one norm (tensor-parallel shards counted on every TP rank, replicated parameters on TP
rank 0, as megatron and DeepSpeed count them), clip, one fused AdamW, cast back, all-gather over DP.

Memory per parameter (bf16): weights 2 and gradients 2 bytes, an fp32 copy of the gradients (4, the
whole buffer: what is reduced over DP; 4 / DP under train.grad_reduce_in_fp32=false, which reduces the
16-bit buffer and copies this rank's parts), masters and moments 12 / DP (`megamlm plan` counts the same).

Autograd sums an update's micro-batches into the 16-bit gradient buffer in place, as DeepSpeed's ZeRO-1
does. Under train.fp32_grad_accumulation each micro-batch's gradients are added to the fp32 buffer
after its backward instead, and the 16-bit buffer is zeroed (megatron's rule for bf16): two operations
per micro-batch, and the same memory.

fp16: the loss is multiplied by a dynamic loss scale kept on the device (train/loss_scale.py, DeepSpeed's
rule and settings); the norm is the scaled gradients', and one division unscales and clips. An overflow
at the scale's floor reaches the loop as a `fault`, and the loop rolls back (DeepSpeed stops there).

Skipping updates with a non-finite gradient (train.skip_nonfinite_updates, bf16; always in fp16, where
an overflow also backs the loss scale off) costs no host read: the norm's finiteness goes to the fused
AdamW as its `found_inf`, which leaves weights, moments and step count as they were; `skipped_steps`
counts them. The flag also travels to the host without blocking, and the next update's step reads it
there (by then the GPU has that update's forward and backward queued behind the copy): a skipped update
then takes back its schedule step, so the learning rates are DeepSpeed's, which does not advance the
schedule on a skipped update. (The lr logged right after the skipped update is the one it would have
advanced to.)

train.overlap_grad_reduce (megatron-core's overlap_grad_reduce with its distributed optimizer): the
buffers are cut into buckets of about train.grad_bucket_size elements, each cut over DP, and a rank's
range is its part of every bucket (one fused AdamW over those parts). In the last micro-batch of an
update, a bucket's gradients go to their reduce-scatter (asynchronous) as soon as the backward has
accumulated all of them, so the reduction runs behind the rest of the backward; the step waits for it.
When each bucket starts, in one fixed order on every rank: train/grad_buckets.py. Without it one
reduce-scatter of the whole buffer follows the backward: nothing else on the device while it runs.

Checkpoints are in DeepSpeed's stage-0 file layout (train/flat_checkpoint.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from megamlm.config import Config
from megamlm.model.tp import tp_sharded
from megamlm.parallel import ParallelContext, ToHost
from megamlm.train.flat_checkpoint import write_stage0
from megamlm.train.grad_buckets import BucketLaunches
from megamlm.train.loss_scale import DynamicLossScale
from megamlm.train.schedule import Schedule

ALIGN = 64
"""Every parameter starts at a multiple of 64 elements of the flat buffers (128 bytes in bf16), so
that its view is as aligned as a tensor of its own for the GPU's vectorized kernels."""

NORM_ROW = 4096
"""The norm sums squares in rows of 4,096 elements, then over the rows. One fp32 reduction over
millions of elements loses accuracy (a CPU's: 1.3e-4 relative at 3.3M, as in DeepSpeed's per-tensor
norms of an embedding); two levels keep it near 1e-8. The flat buffers' ranges are whole rows."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# The flat collectives, in place as megatron-core's distributed optimizer calls them (NCCL and gloo both
# take a rank's range of the whole buffer as the output of a reduce-scatter and the input of an
# all-gather). torch 2.13 renamed them (the old names warn); older torch has only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _cut(lo: int, hi: int, size: int, unit: int) -> list[tuple[int, int]]:
    """[lo, hi) (multiples of unit) in consecutive ranges of `size` elements rounded up to a unit, the
    last one shorter."""
    size = _round_up(max(size, 1), unit)
    return [(first, min(first + size, hi)) for first in range(lo, hi, size)]


class FlatEngine:
    """What the loop uses of a DeepSpeed engine (`__call__`, backward, step, module, optimizer,
    checkpoints, counters), over flat buffers."""

    def __init__(self, model: nn.Module, cfg: Config, ctx: ParallelContext):
        self.module, self.ctx = model.to(ctx.device).train(), ctx  # built on the CPU, as DeepSpeed moves it
        self.accumulation = cfg.train.accumulation_steps(ctx.dp_size)
        self.samples_per_update = cfg.train.global_batch(ctx.dp_size)
        self.clip = cfg.optim.clip_grad
        # fp16: the loss is scaled (on the device) and an overflow always skips its update
        self.scaler = DynamicLossScale.from_settings(ctx.device) if cfg.train.precision == "fp16" else None
        self.scan = self.scaler is not None or (cfg.train.precision == "bf16" and cfg.train.skip_nonfinite_updates)
        dtype = DTYPES[cfg.train.precision]
        # TP-sharded parameters first, so that the norm's two kinds of parameters are two ranges of rows
        params = list(model.parameters())
        sharded = [p for p in params if tp_sharded(p)]
        replicated = [p for p in params if not tp_sharded(p)]
        overlap = cfg.train.overlap_grad_reduce and ctx.dp_size > 1
        # buckets: whole rows on every DP rank, and (overlapping) none holding both kinds of parameters
        unit = NORM_ROW * ctx.dp_size
        self.offsets: dict[int, int] = {}  # id(parameter) -> its first element in the flat buffers
        self.sharded_end = _round_up(self._place(sharded, 0), unit if overlap else NORM_ROW)
        total = _round_up(self._place(replicated, self.sharded_end), unit)
        self.weights = torch.zeros(total, dtype=dtype, device=ctx.device)
        self.grads = torch.zeros_like(self.weights)
        for param in sharded + replicated:  # parameters only: buffers keep their dtype, as DeepSpeed leaves them
            self.param_view(self.weights, param).copy_(param.data)
            param.data = self.param_view(self.weights, param)
            param.grad = self.param_view(self.grads, param)
        self.buckets = [(0, total)]  # [lo, hi) of the flat buffers, each reduced over DP in one collective
        if overlap:
            size = cfg.train.grad_bucket_size
            self.buckets = _cut(0, self.sharded_end, size, unit) + _cut(self.sharded_end, total, size, unit)
        # this DP rank's part [first, end) of each bucket: its master weights and moments
        self.parts = [(lo + ctx.dp_rank * (hi - lo) // ctx.dp_size, lo + (ctx.dp_rank + 1) * (hi - lo) // ctx.dp_size)
                      for lo, hi in self.buckets]
        # fp32: the weights are their own masters (AdamW steps this rank's parts of them in place);
        # bf16 / fp16: fp32 copies made from the 16-bit weights, as DeepSpeed makes its masters
        self.separate_masters = dtype != torch.float32
        # train.grad_reduce_in_fp32=false: the 16-bit buffer is reduced in place, and only this rank's parts
        # of it are copied to fp32 (grads32 is those parts, one after another)
        self.reduce16 = self.separate_masters and not cfg.train.grad_reduce_in_fp32
        sizes = [end - first for first, end in self.parts]
        self.grads32 = torch.zeros(sum(sizes) if self.reduce16 else total, device=ctx.device) \
            if self.separate_masters else self.grads
        self.masters = []
        for (first, end), grad32 in zip(self.parts, self.grads32.split(sizes) if self.reduce16 else
                                        [self.grads32[first:end] for first, end in self.parts]):
            master = self.weights[first:end].float() if self.separate_masters else self.weights[first:end]
            master.grad = grad32  # a reduce-scatter's output in place (16-bit reduction: a cast's)
            self.masters.append(master)
        # train.fp32_grad_accumulation: each micro-batch's 16-bit gradients are added to grads32 after its
        # backward, and `grads` holds one micro-batch at a time
        self.accumulate32 = self.separate_masters and cfg.train.fp32_grad_accumulation
        self.optimizer = torch.optim.AdamW(self.masters, lr=cfg.optim.lr, **cfg.optim.adamw(), fused=True)
        self.schedule = Schedule(self.optimizer, cfg.optim, cfg.train.steps)
        # the rows whose squares the norm sums here: TP-sharded everywhere, replicated on TP rank 0
        self.counted = []
        for (first, _), master in zip(self.parts, self.masters):
            split = min(max(self.sharded_end - first, 0), master.numel())
            counted = [master.grad] if ctx.tp_size == 1 else \
                [master.grad[:split]] + ([master.grad[split:]] if ctx.tp_rank == 0 else [])
            self.counted += [rows.view(-1, NORM_ROW) for rows in counted if rows.numel()]
        # train.overlap_grad_reduce: each bucket reduced as soon as the last backward has finished it
        self.launches = BucketLaunches(params, self.offsets, self.buckets, self._reduce_async) if overlap else None
        self.norm = torch.zeros((), device=ctx.device)
        self.skipped = torch.zeros((), device=ctx.device)
        self.skip_in_flight: ToHost | None = None
        """The last update's found_inf (fp16: and the scale's floor_overflow) on its way to the host:
        update `global_steps`'s whenever it is read (the next step reads it before counting itself)."""
        self.floor_overflow_update: int | None = None
        """The first update known on the host to have overflowed at the loss scale's floor."""
        self.micro_steps = self.global_steps = self.global_samples = 0

    def _place(self, params: list[nn.Parameter], first: int) -> int:
        """Give `params` their offsets from element `first` on; the end of the last one."""
        for param in params:
            self.offsets[id(param)] = first
            first = _round_up(first + param.numel(), ALIGN)
        return first

    def param_view(self, flat: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
        offset = self.offsets[id(param)]
        return flat[offset: offset + param.numel()].view(param.shape)

    def _reduce_async(self, b: int) -> dist.Work:
        """Start bucket b's reduce-scatter (the last backward has finished its gradients)."""
        if self.reduce16:
            return self._reduce16(b, async_op=True)
        lo, hi = self.buckets[b]
        if self.accumulate32:  # the last micro-batch's share, as backward adds the others'
            (self.grads32[lo:hi].add_ if self.accumulation > 1 else self.grads32[lo:hi].copy_)(self.grads[lo:hi])
        elif self.separate_masters:
            self.grads32[lo:hi].copy_(self.grads[lo:hi])
        return _reduce_scatter(self.masters[b].grad, self.grads32[lo:hi], group=self.ctx.dp_group, async_op=True)

    def _reduce16(self, b: int, async_op: bool = False) -> dist.Work | None:
        """Bucket b's 16-bit gradients reduce-scattered in place, each rank's share divided by DP first
        (megatron's order: a sum of 16-bit means overflows only where the mean would)."""
        (lo, hi), (first, end) = self.buckets[b], self.parts[b]
        self.grads[lo:hi].div_(self.ctx.dp_size)
        return _reduce_scatter(self.grads[first:end], self.grads[lo:hi], group=self.ctx.dp_group, async_op=async_op)

    # ---- the loop's calls ------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """The loop's weights make the loss of an update a sum over micro-batches and DP ranks of
        `accumulation × DP` means; as DeepSpeed, divide by accumulation here and by DP in the reduction."""
        loss = loss / self.accumulation
        # the update's last micro-batch (step counts it after this)
        reducing = self.launches is not None and (self.micro_steps + 1) % self.accumulation == 0
        if reducing:
            self.launches.start()
        (loss if self.scaler is None else loss * self.scaler.scale).backward()
        if reducing:
            self.launches.launch_ready(every=True)
        if self.accumulate32:
            if not reducing:  # (reducing, each bucket's share went in before its reduce-scatter)
                (self.grads32.add_ if self.micro_steps % self.accumulation else self.grads32.copy_)(self.grads)
            self.grads.zero_()

    def step(self) -> None:
        """Called after every micro-batch; updates at the last one of an update."""
        self.micro_steps += 1
        if self.micro_steps % self.accumulation:
            return
        ctx = self.ctx
        if self.launches is not None:  # launched in the backward
            self.launches.wait()
        elif self.reduce16:
            if ctx.dp_size > 1:
                for b, _ in enumerate(self.buckets):
                    self._reduce16(b)
        else:
            if self.grads32 is not self.grads and not self.accumulate32:
                self.grads32.copy_(self.grads)
            if ctx.dp_size > 1:  # in place: this rank's part of the buffer receives the sum of that part
                for (lo, hi), master in zip(self.buckets, self.masters):
                    _reduce_scatter(master.grad, self.grads32[lo:hi], group=ctx.dp_group)
        grads = [master.grad for master in self.masters]
        if self.reduce16:  # this rank's parts of the sums, to fp32 (divided already)
            for (first, end), grad in zip(self.parts, grads):
                grad.copy_(self.grads[first:end])
        elif ctx.dp_size > 1:
            for grad in grads:
                grad.div_(ctx.dp_size)
        squares = torch.zeros((), device=ctx.device)
        for rows in self.counted:
            squares = squares + torch.linalg.vector_norm(rows, dim=1).square().sum()
        for size, group in ((ctx.dp_size, ctx.dp_group), (ctx.tp_size, ctx.tp_group)):
            if size > 1:  # DP ranks hold other ranges, TP ranks other shards
                dist.all_reduce(squares, group=group)
        norm = squares.sqrt()  # fp16: of the scaled gradients
        # as DeepSpeed clips: by max(1, (norm + 1e-6) / clip); fp16 unscales in the same division
        divisor = None
        if self.scaler is None:
            self.norm = norm
            if self.clip > 0:
                divisor = ((self.norm + 1e-6) / self.clip).clamp(min=1.0)
        else:
            scale = self.scaler.scale
            self.norm = norm / scale
            divisor = scale if self.clip <= 0 else ((self.norm + 1e-6) / self.clip).clamp(min=1.0) * scale
        if divisor is not None:
            for grad in grads:
                grad.div_(divisor)
        if self.scan:
            self.settle_skip()
            found_inf = norm.isfinite().logical_not().float()
            self.optimizer.found_inf = found_inf  # torch's fused AdamW skips the update on the device
            self.skipped += found_inf
            if self.scaler is None:
                self.skip_in_flight = ToHost(found_inf.view(1))
            else:
                self.scaler.update(found_inf)
                self.skip_in_flight = ToHost(torch.stack([found_inf, self.scaler.floor_overflow]))
        self.optimizer.step()
        self.schedule.step()
        if self.separate_masters:  # bf16 / fp16: cast this rank's parts back
            for (first, end), master in zip(self.parts, self.masters):
                self.weights[first:end].copy_(master)
        if ctx.dp_size > 1:  # in place: every rank's part of each bucket from its owner
            for (lo, hi), (first, end) in zip(self.buckets, self.parts):
                _all_gather(self.weights[lo:hi], self.weights[first:end], group=ctx.dp_group)
        if not self.accumulate32:  # (else zeroed after each backward)
            self.grads.zero_()
        self.global_steps += 1
        self.global_samples += self.samples_per_update

    def settle_skip(self) -> None:
        """If the previous update was skipped, step the schedule back, before this update's AdamW takes
        its learning rate (waits for the previous update's step only); fp16: note an overflow at the
        loss scale's floor (`floor_overflow_update`)."""
        if self.skip_in_flight is None:
            return
        flags, self.skip_in_flight = self.skip_in_flight.get().tolist(), None
        if flags[0]:
            self.schedule.step_back()
        self._note_floor(flags)

    def _note_floor(self, flags: list[float]) -> None:
        """flags: [found_inf] (bf16), or [found_inf, floor_overflow] (fp16)."""
        if len(flags) > 1 and flags[1] and self.floor_overflow_update is None:
            self.floor_overflow_update = self.global_steps

    def fault(self, step: int) -> str | None:
        """Why the run cannot go on from update `step`, whose loss the loop has read (so its flags have
        reached the host; a later update's arrive with the step after it): an fp16 overflow with the
        loss scale at its minimum, which DeepSpeed stops a run for."""
        if self.scaler is not None and self.skip_in_flight is not None and self.global_steps <= step:
            self._note_floor(self.skip_in_flight.get().tolist())  # the schedule waits for the next step
        if self.floor_overflow_update is None:
            return None
        return (f"the gradients of update {self.floor_overflow_update} overflowed fp16 with the loss scale at "
                f"its minimum ({self.scaler.min_scale:g})")

    def get_global_grad_norm(self) -> torch.Tensor:
        """The last update's gradient norm before clipping (on the device)."""
        return self.norm

    def zero_optimization_stage(self) -> int:
        """The layout of the checkpoint files: DeepSpeed's stage 0 (in memory, the optimizer state is
        cut over DP as at stage 1)."""
        return 0

    @property
    def master(self) -> torch.Tensor:
        """This rank's master weights where they are one range of the buffers (one bucket: without
        train.overlap_grad_reduce, or at DP=1); `masters` holds one per bucket."""
        (master,) = self.masters
        return master

    @property
    def start(self) -> int:
        """The first element of the buffers that `master` holds."""
        (part,) = self.parts
        return part[0]

    @property
    def end(self) -> int:
        (part,) = self.parts
        return part[1]

    @property
    def skipped_steps(self) -> int:
        return int(self.skipped.item())

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        """Set by a load (`elastic.load_full_state`), with the loaded schedule: a skip still in flight
        from before it concerns the replaced state, not the loaded one."""
        self.skipped.fill_(value)
        self.skip_in_flight = self.floor_overflow_update = None

    # ---- checkpoints -----------------------------------------------------------------------------

    def save_checkpoint(self, root: str, tag: str, save_latest: bool = False) -> None:
        """Collective: DP rank 0 of each TP rank writes mp_rank_XX_model_states.pt (DeepSpeed's stage-0
        layout: train/flat_checkpoint.py)."""
        self.settle_skip()  # the schedule's state as DeepSpeed would save it
        write_stage0(self, Path(root) / tag)

    def set_full(self, param: nn.Parameter, kind: str, local: torch.Tensor) -> None:
        """Load this rank's (TP-cut) fp32 tensor of `kind` (master weights "fp32", "exp_avg",
        "exp_avg_sq") for `param`: the weights, and what of it this DP rank's parts hold."""
        if kind == "fp32":
            param.data.copy_(local.to(param.dtype))
        first = self.offsets[id(param)]
        for (start, end), master in zip(self.parts, self.masters):
            target = master if kind == "fp32" else self.optimizer.state[master][kind]
            lo, hi = max(first, start), min(first + param.numel(), end)
            if lo < hi:
                target.data[lo - start: hi - start].copy_(local.flatten()[lo - first: hi - first])
