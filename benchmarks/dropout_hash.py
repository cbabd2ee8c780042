#!/usr/bin/env python
"""The hash behind Flex attention dropout (model/flex.py), on int64 lanes (sessions 16-24) vs int32
lanes (now), compiled, side by side: the same mask bits, the cost of computing them.

    PYTHONPATH=. python benchmarks/dropout_hash.py                          # CPU: [2, 12, 1024, 1024]
    PYTHONPATH=. python benchmarks/dropout_hash.py --device cuda --shape 8,12,2048,2048   # the loop's

FlexAttention's score_mod evaluates the keep mask for every (row, head, query, key) its kernels
visit: in the pass that computes the output, in the logsumexp pass, and again in both backward
passes. Each kernel here is what Inductor makes of the mask alone: the count of kept entries over
the whole [b, np, s, s] grid (one fused reduction; nothing [s, s] is stored). Times are medians of
interleaved rounds (a GPU: device time between CUDA events); "entries/ns" is the grid's size per time.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from megamlm.model.flex import dropped_levels, kept_at_level, key_level, key_pair
from timing import interleaved, warm_clocks

_LOW32 = 2**32 - 1


def _fmix32_int64(x: torch.Tensor) -> torch.Tensor:
    """murmur3's finalizer as sessions 16-24 computed it: int64 lanes holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _LOW32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _LOW32
    return x ^ (x >> 16)


def kept_int64(seed: torch.Tensor, dropped: int, b, h, q_idx, kv_idx) -> torch.Tensor:
    """The keep mask on int64 lanes (the same bits as `kept_at_level`; the test in test_flex.py checks
    both against Python's integers)."""
    x = _fmix32_int64(seed ^ ((b.to(torch.int64) << 16) | h.to(torch.int64)))
    x = _fmix32_int64(x ^ q_idx.to(torch.int64))
    kv_idx = kv_idx.to(torch.int64)
    return key_level(_fmix32_int64(x ^ key_pair(kv_idx)), kv_idx) >= dropped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", default="2,12,1024,1024", help="b,np,s,s of the grid")
    parser.add_argument("--p", type=float, default=0.1, help="the drop probability (the recipes' 0.1)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5, help="calls per timed round, queued back to back")
    args = parser.parse_args()
    device = torch.device(args.device)
    b, np_, sq, sk = (int(n) for n in args.shape.split(","))
    grids = (torch.arange(b, device=device)[:, None, None, None], torch.arange(np_, device=device)[None, :, None, None],
             torch.arange(sq, device=device)[None, None, :, None], torch.arange(sk, device=device)[None, None, None, :])
    seed, dropped = torch.tensor(987654321, device=device), dropped_levels(args.p)
    hashes = {"int64 lanes (before)": kept_int64, "int32 lanes (kept_at_level)": kept_at_level}
    counts = {label: torch.compile(lambda s, *g, fn=fn: fn(s, dropped, *g).sum(), dynamic=False)
              for label, fn in hashes.items()}
    kept = {label: count(seed, *grids).item() for label, count in counts.items()}  # compiles; the same mask
    assert len(set(kept.values())) == 1, f"the two hashes keep different entries: {kept}"
    if device.type == "cuda":
        warm_clocks()
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"dropout keep mask, compiled count over [{b}, {np_}, {sq}, {sk}] (kept {next(iter(kept.values())):,}), "
          f"{where}, torch {torch.__version__}")
    times = interleaved({label: functools.partial(count, seed, *grids) for label, count in counts.items()}, args.rounds,
                        device, args.calls)
    base = statistics.median(times[next(iter(times))])
    print(f"{'hash':<30} {'ms':>9} {'entries/ns':>11} {'speed-up':>9}")
    for label, values in times.items():
        seconds = statistics.median(values)
        print(f"{label:<30} {seconds * 1e3:>9.3f} {b * np_ * sq * sk / seconds / 1e9:>11.2f} {base / seconds:>8.2f}x")
    print("done")


if __name__ == "__main__":
    main()
