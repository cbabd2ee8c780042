#!/usr/bin/env python
"""Host work of the real training loop, per phase: aten operations per update, counted on a CPU.

    PYTHONPATH=. python benchmarks/loop_ops.py          # base zero-clap, bf16: ZeRO 1 (with, without the scan) / 0 / 2,
                                                        # fp32 stage 0, the flat engine (with, without the scan)
    PYTHONPATH=. python benchmarks/loop_ops.py --rows "default:" "compiled:train.compile=true"
    PYTHONPATH=. python benchmarks/loop_ops.py --time   # ms per phase instead: at width 64, a CPU's host cost

On a GPU every aten operation costs the host a dispatch, and most a kernel launch, whatever the
tensor sizes. When the host spends longer queueing an update than the GPU spends running it, the GPU
waits (the H200 loop at 2048: busy 58-68% of the time, BENCHMARKS.md). The count does not depend on
the shapes, so a CPU gives it: the model keeps its depth (the config's layers) at a tiny width and
length, and `megamlm train` runs a few updates in-process. Operations are counted in each phase of
the loop (train/profiling.py: PHASES) from the third update on. Each row runs in its own process.
The model's CPU-only paths are swapped for what a GPU runs (`gpu_paths`; --cpu-paths keeps them):
attention with dropout is one SDPA call (on the CPU megamlm takes an eager path), dropout one
native_dropout (on the CPU a 16-bit mask).
Columns: operations per update in each phase, their total, and the device reads in the backward, the
engine step and the loss read (an `.item()` that waits for the device on a GPU; not the reads of
values `parallel.ToHost` copied to pinned memory, nor the forward's of the batch's host copies,
`Batch.host_layout`, which cost nothing there: tests/test_host_sync.py).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megamlm.config import load_config
from megamlm.train import loop
from megamlm.train.profiling import PHASES

ROOT = Path(__file__).resolve().parents[1]
SKIPPED_UPDATES = 2  # the first updates build buckets and optimizer state once
TINY = ["data.seq_length=128", "model.max_positions=128", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.ffn_hidden_size=256", "train.micro_batch_size=2", "train.global_batch_size=4", "train.steps=6",
        "train.precision=bf16", "data.loader_workers=0", "data.long_docs=split", "data.valid_fraction=0.02",
        "train.log_interval=100", "train.eval_interval=100", "train.save_interval=100000"]
ROWS = ["ZeRO-1 (the Pile configs):", "ZeRO-1, no inf/NaN scan:train.skip_nonfinite_updates=false",
        "ZeRO-0 (DeepSpeed's bf16 optimizer):train.zero_stage=0", "ZeRO-2:train.zero_stage=2",
        "fp32, one rank (no DeepSpeed wrapper):train.precision=fp32", "flat engine:train.engine=flat",
        "flat engine, no inf/NaN scan:train.engine=flat,train.skip_nonfinite_updates=false",
        # the CPU cannot run alibi-flash's attention dropout; a GPU's flash pass drops inside its kernel
        "flat engine, alibi-flash:train.engine=flat,model.attention_backend=alibi-flash,model.attention_dropout=0"]


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while active, under the phase's name."""

    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense" and any(args[0] is host for host in HOST_COPIES):
            name = "item of a host copy"  # on a GPU: pinned memory the device wrote to, no wait
        self.counts[name] += 1
        return func(*args, **(kwargs or {}))


HOST_COPIES: list[torch.Tensor] = []
"""The tensors `parallel.ToHost` made (on a CPU: the device tensors themselves): reading one is not a
device read on a GPU."""


def mark_host_copies() -> None:
    from megamlm.parallel import ToHost

    made = ToHost.__init__

    def init(self, tensor):
        made(self, tensor)
        HOST_COPIES[:] = HOST_COPIES[-8:] + [self.host]

    ToHost.__init__ = init


def gpu_paths() -> None:
    """The operations a GPU dispatches where the CPU takes paths of its own (model/dropout.py,
    model/attention.py: _eager); the values differ, the counts are the GPU's."""
    from megamlm.model import attention, embedding, layer

    def native_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
        return torch.native_dropout(x, p, True)[0] if training and p > 0 else x

    for module in (attention, embedding, layer):
        module.dropout = native_dropout
    # SDPA's dropout is inside its one fused kernel on a GPU
    attention._eager = lambda q, k, v, bias, dropout_p, scale: F.scaled_dot_product_attention(
        q, k, v, attn_mask=bias, scale=scale)
    # alibi-flash: a private flash op per pass (forward, backward); the CPU's reference pass is matmuls
    attention.flash_kernel = lambda device, dtype: OnePass()


class OnePass:
    """Stands in for a GPU's flash pass in the counts: one operation forward (its output), one backward
    (zeros: the stand-in trains nothing, but the loop's numbers stay finite)."""

    name = "one operation"

    def forward(self, q, k, v, dropout_p, scale):
        return torch.zeros_like(q), torch.zeros(q.shape[:3], device=q.device), ()

    def backward(self, grad_out, q, k, v, out, lse, dropout_p, scale, state):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def count_child(config: str, overrides: list[str], work: Path, timed: bool = False) -> dict:
    """Runs the loop in this process (one rank, as `megamlm train` from a plain python); {phase: {op: count
    per update}}, or with `timed` {phase: {"ms": milliseconds per update}} (nothing counted)."""
    counts = {name: collections.Counter() for name in PHASES}
    updates = reads = 0  # updates begun (a "data" phase each); loss reads counted
    real_phase = loop.phase

    @contextlib.contextmanager
    def counted_phase(name: str):
        nonlocal updates, reads
        start = time.perf_counter()
        updates += name == "data"
        if updates <= SKIPPED_UPDATES:
            with real_phase(name):
                yield
        else:
            reads += name == "loss read"
            with real_phase(name), contextlib.nullcontext() if timed else OpCounter(counts[name]):
                yield
            if timed:
                counts[name]["ms"] += 1e3 * (time.perf_counter() - start)

    loop.phase = counted_phase
    cfg = load_config([config], [f"data.build_from=[{ROOT}/data/wikitext-103/valid.txt]",
                                 f"data.shards={work}/shards", f"train.run_dir={work}/run", *TINY,
                                 *(["train.steps=22"] if timed else []), *overrides])
    loop.train(cfg, overwrite=True)
    # per update: each update's loss is read once, mostly during the next update (train/loop.py)
    counted = {name: updates - SKIPPED_UPDATES for name in PHASES} | {"loss read": reads}
    return {name: {op: n / counted[name] for op, n in c.most_common()} for name, c in counts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs/pile/base-zero-clap.yaml"))
    parser.add_argument("--rows", nargs="+", default=ROWS, help="NAME:OVERRIDE,OVERRIDE... per row")
    parser.add_argument("--top", type=int, default=6, help="the most frequent operations of each phase, first row")
    parser.add_argument("--cpu-paths", action="store_true",
                        help="count the CPU's own attention-dropout and dropout paths (default: the GPU's)")
    parser.add_argument("--time", action="store_true",
                        help="time each phase instead (ms per update on this CPU, 20 updates, nothing counted)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # one row, in its own process: NAME:OVERRIDES, the work folder
        _, overrides = args.child.split(":", 1)
        if not args.cpu_paths:
            gpu_paths()
        mark_host_copies()
        with tempfile.TemporaryDirectory() as work:
            result = count_child(args.config, [o for o in overrides.split(",") if o], Path(work), args.time)
        print("COUNTS " + json.dumps(result))
        return
    results = {}
    for row in args.rows:
        child = [sys.executable, __file__, "--config", args.config, "--child", row] + ["--cpu-paths"] * args.cpu_paths \
            + ["--time"] * args.time
        done = subprocess.run(child, cwd=ROOT,
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        line = next((line for line in done.stdout.splitlines() if line.startswith("COUNTS ")), None)
        if line is None:
            sys.exit(f"row {row!r} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        results[row.split(":", 1)[0]] = json.loads(line.removeprefix("COUNTS "))
    layers = load_config([args.config]).model.num_layers
    if args.time:
        print(f"ms per update on this CPU (2 micro-batches of 2 x 128 tokens), {Path(args.config).name}, {layers} "
              f"layers at width 64, bf16, torch {torch.__version__}")
        width = max(len(name) for name in results) + 2
        print(f"{'row':<{width}}" + "".join(f"{name:>13}" for name in PHASES) + f"{'total':>9}")
        for name, phases in results.items():
            per_phase = [phases[p]["ms"] for p in PHASES]
            print(f"{name:<{width}}" + "".join(f"{ms:>13.1f}" for ms in per_phase) + f"{sum(per_phase):>9.1f}")
        return
    print(f"aten operations per update (2 micro-batches), {Path(args.config).name}, {layers} layers, bf16, "
          f"{'the CPU' if args.cpu_paths else 'a GPU'}'s dropout and attention paths, torch {torch.__version__}")
    width = max(len(name) for name in results) + 2
    print(f"{'row':<{width}}" + "".join(f"{name:>13}" for name in PHASES) + f"{'total':>9}{'device reads':>14}")
    for name, phases in results.items():
        per_phase = [sum(phases[p].values()) for p in PHASES]
        reads = sum(phases[p].get("_local_scalar_dense", 0) for p in ("backward", "engine step", "loss read"))
        print(f"{name:<{width}}" + "".join(f"{n:>13,.0f}" for n in per_phase) + f"{sum(per_phase):>9,.0f}"
              f"{reads:>14,.0f}")
    first, phases = next(iter(results.items()))
    print(f"most frequent in {first}:")
    for p in PHASES:
        top = list(phases[p].items())[:args.top]
        print(f"  {p:<12} " + ", ".join(f"{op} {n:,.0f}" for op, n in top))


if __name__ == "__main__":
    main()
