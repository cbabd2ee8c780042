#!/usr/bin/env python
"""The unfused head's loss, forward + backward over [n, V_local] logits: megatron-core's vocab-parallel
cross-entropy (on the fp32 copy its in-place kernel needs: megamlm's loss until session 64) against megamlm's
(`vocab_parallel_loss`: the same arithmetic without that copy of fp32 logits, amax for max-with-indices) and
torch's `F.cross_entropy` (not vocab-parallel: the yardstick at TP=1), side by side, at TP=1.

    PYTHONPATH=. python benchmarks/cross_entropy.py                       # tiny/512/batch 4's 303 masked x 50,304, fp32
    PYTHONPATH=. python benchmarks/cross_entropy.py --device cuda --rows 4915 --dtype bf16   # base/2048, micro-batch 16

Times are medians of interleaved rounds (a GPU: device time between CUDA events around --calls calls queued
back to back, per call). Exits 1 where megamlm's losses or gradient differ from megatron-core's in any bit.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

from megamlm.config import ParallelConfig
from megamlm.model.heads import vocab_padding_bias
from megamlm.objectives.mlm import vocab_parallel_loss
from megamlm.parallel import init_distributed
from timing import interleaved, warm_clocks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LOSSES = {
    "megatron-core (fp32 copy)": lambda logits, targets: vocab_parallel_cross_entropy(
        logits.to(torch.float32, copy=True), targets),
    "megamlm": lambda logits, targets: vocab_parallel_loss(logits, targets, "none"),
    "F.cross_entropy": lambda logits, targets: F.cross_entropy(logits.float(), targets, reduction="none"),
}


def _run(loss, logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses [n], d Σ weights · losses / d logits)."""
    logits = logits.detach().requires_grad_()
    losses = loss(logits, targets)
    (grad,) = torch.autograd.grad(losses, logits, weights)
    return losses.detach(), grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=303, help="masked positions n")
    parser.add_argument("--vocab", type=int, default=50265, help="real ids; padded to a multiple of 128 (-inf)")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=20, help="calls per timed window (one on a CPU)")
    args = parser.parse_args()
    init_distributed(ParallelConfig(tensor_parallel=1))
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    calls = args.calls if device.type == "cuda" else 1
    if device.type == "cuda":
        warm_clocks()
    padded = -(-args.vocab // 128) * 128
    generator = torch.Generator(device=device).manual_seed(0)
    # logits with the spread of a trained head's, the padding's columns -inf as the head's bias makes them
    logits = (torch.randn(args.rows, padded, device=device, generator=generator) * 3
              + vocab_padding_bias(0, padded, args.vocab).to(device)).to(dtype)
    targets = torch.randint(0, args.vocab, (args.rows,), device=device, generator=generator)
    weights = torch.rand(args.rows, device=device, generator=generator)
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"cross-entropy of [{args.rows}, {padded}] {args.dtype} logits ({args.vocab} real ids), forward + backward, "
          f"{where}, torch {torch.__version__}")
    # (each call's gradient, the size of the logits, is dropped before the next: 20 at base/2048 would hold 10 GB)
    works = {label: functools.partial(_run, loss, logits, targets, weights) for label, loss in LOSSES.items()}
    times = interleaved(works, args.rounds, device, calls)
    (want, want_grad), (got, got_grad) = (_run(LOSSES[label], logits, targets, weights)
                                          for label in ("megatron-core (fp32 copy)", "megamlm"))
    base = statistics.median(times["megatron-core (fp32 copy)"])
    print(f"{'implementation':<28} {'ms':>8} {'vs megatron-core':>17}")
    for label in LOSSES:
        ms = statistics.median(times[label])
        print(f"{label:<28} {1e3 * ms:>8.2f} {ms / base:>16.2f}x")
    if not (torch.equal(got, want) and torch.equal(got_grad, want_grad)):
        raise SystemExit("megamlm's cross-entropy differs from megatron-core's")
    print("megamlm's losses and gradient equal megatron-core's, bit for bit")


if __name__ == "__main__":
    main()
