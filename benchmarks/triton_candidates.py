#!/usr/bin/env python
"""Every autotuner candidate of model.attention_backend=triton's attention kernels
(megamlm/model/triton_kernels.py), timed one by one at the loop's shape: what the autotuner chooses
between, side by side in one run — e.g. dK/dV's two orientations (score tiles with keys or with queries
along rows) — and model.triton_dq=atomic's backward (the dK/dV kernel adding dQ, with the zeroing and
scaling of its sum) beside the dK/dV and dQ kernels it replaces. The autotuner's log
(TRITON_PRINT_AUTOTUNING=1) names only its pick.

    python benchmarks/triton_candidates.py      # GPU: bf16, base's 12 heads of 64, batch 16 x 2048, packed, dropout 0.1

Packed rows are samples of 204-921 positions at 2048 (a fixed generator) filling each row, the free tail
shorter than the next sample, as data.packing=packed lays them out. Prints per kernel and candidate the
time of one call (--repeats calls queued back to back per window, the median of 5 windows) and its rate
over the scores its queries see, and how far its results are from the first candidate's (block sizes change
the order of the sums: bf16-rounding differences; a miscompiled candidate would stand out).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
from timing import timed, warm_clocks  # benchmarks/ is the script's folder: on sys.path
from triton_static import describe

from megamlm.model.flex import dropped_levels
from megamlm.model.attention import split_qkv
from megamlm.model.positions import alibi_slopes
from megamlm.model.triton_attention import backward_launches, forward_launch, kernel_spans, softmax_row_terms
from megamlm.model.triton_autotune import COMPILE_OPTIONS


def packed_groups(b: int, s: int, device) -> torch.Tensor:
    """[b, s] groups: samples of s/10 to 0.45 s positions (204-921 at 2048) filling each row, then free (-1)
    where the next one would not fit."""
    lengths = torch.Generator().manual_seed(0)
    groups = torch.full((b, s), -1, dtype=torch.int32)
    for row in range(b):
        start, sample = 0, 0
        while True:
            length = int(torch.randint(s // 10, 9 * s // 20 + 1, (), generator=lengths))
            if start + length > s:
                break
            groups[row, start:start + length] = sample
            start, sample = start + length, sample + 1
    return groups.to(device)


def seen_scores(groups: torch.Tensor | None, b: int, s: int) -> int:
    """(query, key) pairs a query sees per head: every pair of a row, or the pairs within each sample."""
    if groups is None:
        return b * s * s
    return sum(int(count) ** 2 for row in groups for value, count in zip(*row.unique(return_counts=True))
               if value >= 0)


def candidate_call(launch, config: triton.Config):
    """The launch's kernel run with one candidate (what the autotuner times), not through the autotuner."""
    grid = launch.grid(config.kwargs)
    return lambda: launch.kernel.fn[grid](*launch.args, **launch.constants, **config.all_kwargs(), **COMPILE_OPTIONS)


def milliseconds(call, repeats: int, device: torch.device) -> float:
    """One call's time: `repeats` calls queued back to back per window (timing.timed), the median of 5 windows
    after a compiling, warming call."""
    call()
    return statistics.median(timed(lambda: [call() for _ in range(repeats)], device) for _ in range(5)) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layout", default="packed", choices=("packed", "whole-rows"))
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=10, help="calls queued back to back per timing window")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        warm_clocks()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    b, np_, s, hn = args.batch, args.heads, args.length, args.head_dim
    gen = torch.Generator().manual_seed(0)
    # [s, b, np, 3 hn] -> [b, np, s, 3 hn]: the layer's QKV projection, as its core attention hands it over
    # unsplit (q, k and v views of it; their gradients written into one tensor of its layout)
    qkv = torch.randn(s, b, np_, 3 * hn, generator=gen).to(device, dtype).permute(1, 2, 0, 3)
    groups = packed_groups(b, s, device) if args.layout == "packed" else None
    spans = kernel_spans(groups) if groups is not None else None
    slopes = torch.tensor(alibi_slopes(np_), device=device).expand(2, -1)  # before and after the query
    seed = torch.tensor(1234, device=device)
    pattern = (slopes, groups, spans)
    constants = (hn ** -0.5, 0.5, dropped_levels(args.dropout), -1)
    forward, (out, lse, query_bits) = forward_launch(qkv, None, None, *pattern, seed, *constants)
    forward()  # through the autotuner: out, lse and the query bits for the backward
    do = torch.randn(out.shape, generator=gen).to(device, dtype)
    delta = softmax_row_terms(do, out, constants[2])
    (keys, queries), (dqkv, *_) = backward_launches(do, qkv, None, None, delta, lse, query_bits, *pattern, *constants,
                                                     False)
    dq, dk, dv = split_qkv(dqkv)  # [b, np, s, 3 hn] -> 3 x [b, np, s, hn]
    (atomic, scaling), (atomic_dqkv, *_) = backward_launches(do, qkv, None, None, delta, lse, query_bits, *pattern,
                                                             *constants, False, atomic_dq=True)
    dq_sum = dict(zip(atomic.kernel.fn.arg_names, atomic.args))["DQ_SUM"]
    seen = seen_scores(groups, b, s) * np_
    print(f"model.attention_backend=triton's candidates on {device}"
          f"{f' ({torch.cuda.get_device_name()})' if device.type == 'cuda' else ''}: batch {b} x {s}, {args.layout}, "
          f"{np_} heads of {hn}, {args.dtype}, ALiBi offset, dropout {args.dropout}; triton {triton.__version__}; "
          f"{seen / (np_ * b * s * s):.1%} of the scores seen; the last column: the largest difference of the "
          "candidate's results from the first's, over their largest magnitude")
    print("| kernel | BLOCK_M × BLOCK_N, warps, stages | ms | TFLOP/s over the scores seen | results vs the first |")
    print("|---|---|---:|---:|---:|")
    # matmuls per score seen: forward q·kᵀ, p·v; dK/dV q·kᵀ, dO·vᵀ, pᵀ·dO, dSᵀ·q; dQ q·kᵀ, dO·vᵀ, dS·k; dK/dV+dQ
    # (model.triton_dq=atomic) the dK/dV kernel's and dS·k, each call with the zeroing and the scaling of the sum
    for name, launch, matmuls, results in (("forward", forward, 2, [out]), ("dK/dV", keys, 4, [dk, dv]),
                                           ("dQ", queries, 3, [dq]),
                                           ("dK/dV+dQ", atomic, 5, list(split_qkv(atomic_dqkv)))):
        rows, first = [], None
        for config in launch.kernel.configs:
            call = candidate_call(launch, config)
            if launch is atomic:
                call = (lambda kernel: lambda: (dq_sum.zero_(), kernel(), scaling()))(call)
            ms = milliseconds(call, args.repeats, device)
            got = torch.cat([t.float().flatten() for t in results])
            first = got if first is None else first
            rows.append((config, ms, ((got - first).abs().max() / first.abs().max()).item()))
        fastest = min(ms for _, ms, _ in rows)
        for config, ms, difference in rows:
            rate = f"{matmuls * 2 * hn * seen / ms / 1e9:.0f}"
            cells = (f"**{ms:.3f}**", f"**{rate}**") if ms == fastest else (f"{ms:.3f}", rate)
            print(f"| {name} | {describe(config)} | {cells[0]} | {cells[1]} | {difference:.1e} |", flush=True)


if __name__ == "__main__":
    main()
