#!/usr/bin/env python
"""Gradients reduced over DP ranks in 16 bits vs in fp32, at DP = 2 to 128, against the exact mean.

    PYTHONPATH=. python benchmarks/reduce16.py                  # the demo's tiny model, bf16, DP 2 8 32 128
    PYTHONPATH=. python benchmarks/reduce16.py --dtypes fp16 --dp 2 8 32

16 bits is the flat engine under `train.grad_reduce_in_fp32=false` and DeepSpeed's ZeRO by default (its
`communication_data_type` is the weights' dtype); fp32 is the flat engine's default and megatron's for bf16.

Each DP rank's share is the 16-bit gradient of its own micro-batch: the bf16 / fp16 model's, one backward
per rank on real WikiText-103 text masked by the fairseq rule (dropout off; fp16: at the engine's initial
loss scale, unscaled after the reduction). The reduction is computed as NCCL's ring reduce-scatter computes
it (`ring_reduce_scatter`): the buffer's chunk c starts at rank c + 1 and goes round the ring, each rank
adding its share in fp32 and rounding the sum to the buffer's dtype, and ends at rank c; DP - 1 roundings per
element. tests/test_flat_reduce16.py checks it bit for bit against gloo's reduce-scatter at DP 2 and 3
(gloo takes another order from 4 ranks on).
- 16-bit: each share divided by DP in its dtype first (megatron's order, the flat engine's, DeepSpeed's
  pre-division), then the ring in that dtype.
- fp32: the shares cast to fp32, the ring in fp32, then divided by DP.
"exact" is the float64 mean of the same 16-bit shares, so the error columns are the reduction's alone.
"16-bit backward" is, for scale, how far that exact mean is from the fp32 model's mean gradient on the same
weights: the error of the shares themselves, before any reduction. Errors are relative L2 norms over all
parameters. The ranks' DP micro-batches are the first DP of the text, so each row adds ranks to the last.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from benchmarks.grad_accumulation import (DTYPES, add_model_arguments, loss_scale, model_config, relative,
                                          twin_models, wikitext_batches)
from megamlm.config import ParallelConfig
from megamlm.data.tokenizer import Tokenizer
from megamlm.objectives import get_objective
from megamlm.parallel import init_distributed


def ring_reduce_scatter(shares: list[torch.Tensor], dtype: torch.dtype, divide: bool = False) -> torch.Tensor:
    """The sum of `shares` (one flat tensor per rank) as a ring reduce-scatter leaves it, every rank's chunk
    side by side: chunk c is summed in the order of ranks c + 1, c + 2, ..., c (mod DP), each addition in
    fp32 and rounded to `dtype`. divide: each share divided by DP in its own dtype first (the mean)."""
    dp = len(shares)
    chunks = [share.tensor_split(dp) for share in shares]  # [dp ranks][dp chunks]

    def addend(rank: int, c: int) -> torch.Tensor:
        chunk = chunks[rank % dp][c]
        return (chunk / dp if divide else chunk).float()

    out = []
    for c in range(dp):
        total = addend(c + 1, c).to(dtype)
        for k in range(2, dp + 1):
            total = (total.float() + addend(c + k, c)).to(dtype)
        out.append(total)
    return torch.cat(out)


def flat_gradient(net: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in net.parameters()])


def rank_gradients(cfg, ctx, objective, batches, dtype, sizes: list[int]) -> tuple[list[torch.Tensor], dict]:
    """(each batch's 16-bit gradient as a rank holds it, flat; fp16: at the engine's initial loss scale),
    {DP: the mean of the first DP batches' gradients of the fp32 model with the same weights, float64}."""
    model, reference = twin_models(cfg, ctx, objective, dtype)
    scale = loss_scale(dtype)
    shares, means, wide = [], {}, None
    for count, batch in enumerate(batches, 1):
        for net, factor in ((model, scale), (reference, 1.0)):
            net.zero_grad(set_to_none=True)
            (objective.loss(net, batch).loss_sum.sum() / len(batch.targets) * factor).backward()
        shares.append(flat_gradient(model))
        wide = flat_gradient(reference).double() + (0 if wide is None else wide)
        if count in sizes:
            means[count] = wide / count
    return shares, means


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)  # --micro: one micro-batch per rank
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 8, 32, 128], help="data-parallel sizes")
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=list(DTYPES))
    args = parser.parse_args()
    if min(args.dp) < 2:
        parser.error(f"--dp {min(args.dp)}: a reduction needs 2 ranks or more")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    ctx = init_distributed(ParallelConfig())
    tokenizer = Tokenizer.gpt2()
    batches = wikitext_batches(tokenizer, max(args.dp), args.micro, args.seq_length)[:max(args.dp)]
    print(f"gradient reduction over DP, {Path(args.config).name} + {Path(args.variant).name}, micro-batch "
          f"{args.micro} x {args.seq_length} per rank, CPU {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print("| dtype | DP | 16-bit reduction: error | fp32 reduction: error | 16-bit backward (for scale) "
          "| mean's norm / a share's |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.dtypes:
        cfg = model_config(args, tokenizer, name)
        start = time.perf_counter()
        shares, fp32_model = rank_gradients(cfg, ctx, get_objective(cfg), batches, DTYPES[name], args.dp)
        print(f"({len(shares)} backward passes per model in {time.perf_counter() - start:.0f} s)", flush=True)
        scale = loss_scale(DTYPES[name])
        for dp in sorted(args.dp):
            exact = sum(share.double() for share in shares[:dp]) / dp
            share_norm = sum(share.double().norm() for share in shares[:dp]) / dp
            sixteen = ring_reduce_scatter(shares[:dp], DTYPES[name], divide=True).double()
            fp32 = ring_reduce_scatter(shares[:dp], torch.float32).double() / dp
            print(f"| {name} | {dp} | {relative(sixteen, exact):.2e} | {relative(fp32, exact):.2e} | "
                  f"{relative(exact / scale, fp32_model[dp]):.2e} | {(exact.norm() / share_norm).item():.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
