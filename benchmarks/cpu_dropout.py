#!/usr/bin/env python
"""The CPU dropout's mask application, forward + backward: megamlm's one pass (`model/dropout.py`: 0 + scale · x ·
keep, `addcmul` with the bool mask read as bytes) against its previous two (`torch.where(keep, x, 0.0)` then an
in-place scale: until session 65) and against torch's whole dropout (`F.dropout`: a Mersenne-Twister `bernoulli_`
mask, its float copy, a multiply), side by side on the shapes of the default throughput benchmark (tiny, 512,
batch 4: the attention probabilities and the hidden states).

    OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/cpu_dropout.py [--keep-freed-memory]

"apply" rows time the mask's application alone, forward and backward (the same operation on the output's
gradient) on one drawn mask; "dropout" rows time the whole call, mask draw included. Medians of interleaved rounds.
Exits 1 where megamlm's application differs in any bit (signed zeros included) from the where-and-scale one.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from megamlm.host_memory import keep_freed_host_memory
from megamlm.model.dropout import apply_mask, dropout, dropped_levels, level_keep_scale
from timing import interleaved

SHAPES = {"attention probabilities [b, np, s, s]": (4, 4, 512, 512), "hidden states [s, b, h]": (512, 4, 256)}
P = 0.1


def where_and_scale(x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    """The application megamlm's dropout used until session 65."""
    return torch.where(keep, x, 0.0).mul_(scale)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def _works(x: torch.Tensor, grad: torch.Tensor, keep: torch.Tensor, scale: float) -> dict:
    """{row: work()} on one tensor x, its output's gradient and a drawn mask."""
    leaf = x.clone().requires_grad_()
    return {
        "apply: torch.where + mul_ (until session 65)": lambda: (where_and_scale(x, keep, scale),
                                                                  where_and_scale(grad, keep, scale)),
        "apply: megamlm (addcmul, one pass)": lambda: (apply_mask(x, keep, scale), apply_mask(grad, keep, scale)),
        "dropout: megamlm (16-bit mask + addcmul)": lambda: dropout(leaf, P, True).backward(grad),
        "dropout: F.dropout (bernoulli_)": lambda: F.dropout(leaf, P, True).backward(grad),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="megamlm train's CPU allocator policy (megamlm/host_memory.py): no page faults")
    args = parser.parse_args()
    if args.keep_freed_memory:
        keep_freed_host_memory()
    device = torch.device("cpu")
    scale = level_keep_scale(dropped_levels(P))
    allocator = "freed blocks kept" if args.keep_freed_memory else "glibc's defaults"
    print(f"CPU dropout p={P}, fp32, forward + backward, {torch.get_num_threads()} threads, {allocator}, "
          f"torch {torch.__version__}")
    print(f"{'tensor':<40} {'row':<44} {'ms':>7} {'vs where':>9}")
    differs = []
    for name, shape in SHAPES.items():
        generator = torch.Generator().manual_seed(0)
        x, grad = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
        keep = torch.rand(shape, generator=generator) >= P
        works = _works(x, grad, keep, scale)
        times = interleaved(works, args.rounds, device)
        base = statistics.median(times["apply: torch.where + mul_ (until session 65)"])
        for label, seconds in times.items():
            ms = statistics.median(seconds)
            print(f"{name:<40} {label:<44} {1e3 * ms:>7.2f} {ms / base:>8.2f}x")
        if any(not torch.equal(_bits(apply_mask(tensor, keep, scale)), _bits(where_and_scale(tensor, keep, scale)))
               for tensor in (x, -x, grad)):
            differs.append(name)
    if differs:
        raise SystemExit(f"megamlm's mask application differs from torch.where + mul_ on: {', '.join(differs)}")
    print("megamlm's mask application equals torch.where + mul_, bit for bit (signed zeros included)")


if __name__ == "__main__":
    main()
