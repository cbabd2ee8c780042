#!/usr/bin/env python
"""CLAP's row normalization of the head's table, forward + backward: F.normalize through autograd vs
megamlm's `l2_normalize` (model/norm.py: the backward in closed form), side by side.

    PYTHONPATH=. python benchmarks/row_normalize.py                    # CPU: 50,304 x 768, fp32 and bf16
    PYTHONPATH=. python benchmarks/row_normalize.py --device cuda      # a GPU: bf16 and fp16 too

The CLAP head normalizes the whole vocab-parallel table ([V_local, h]) in every micro-batch, and its
gradient passes back through the normalization. On the H200 (session 24) the loop's profile had 4
adds of ~0.54 ms each per update at this shape, which the counts on a CPU (loop_ops.py) place in
autograd's chain through F.normalize. Times are medians of interleaved rounds of 5 calls each
(a GPU: device time between CUDA events); "error" is the gradient's relative error against float64.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from megamlm.model.norm import l2_normalize
from timing import timed, warm_clocks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


CALLS = 5
"""Forward + backward calls per timed window, queued back to back as the loop queues its work."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50304, help="V_local: roberta's vocabulary, padded")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", nargs="+", default=None, choices=list(DTYPES),
                        help="default: fp32 bf16 on a CPU, bf16 fp16 on a GPU")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtypes = args.dtypes or (["fp32", "bf16"] if device.type == "cpu" else ["bf16", "fp16"])
    if device.type == "cuda":
        warm_clocks()
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"row normalization fwd + bwd, [{args.rows}, {args.hidden}], {where}, torch {torch.__version__}")
    print(f"{'dtype':<6} {'implementation':<26} {'ms':>9} {'error':>10}")
    generator = torch.Generator(device=device).manual_seed(0)
    for name in dtypes:
        dtype = DTYPES[name]
        eps = max(1e-12, torch.finfo(dtype).tiny)
        x = (torch.randn(args.rows, args.hidden, device=device, generator=generator) * 0.02).to(dtype)
        g = torch.randn(args.rows, args.hidden, device=device, generator=generator).to(dtype)
        exact = x.double().requires_grad_()
        F.normalize(exact, dim=-1).backward(g.double())
        implementations = {"F.normalize (autograd)": lambda t, eps=eps: F.normalize(t, dim=-1, eps=eps),
                           "l2_normalize (megamlm)": l2_normalize}
        times = {label: [] for label in implementations}
        errors = {}
        for round_ in range(args.rounds + 1):  # round 0 warms up
            for label, fn in implementations.items():
                leaves = [x.clone().requires_grad_() for _ in range(CALLS)]
                work = lambda fn=fn, leaves=leaves, g=g: [fn(leaf).backward(g) for leaf in leaves]  # noqa: E731
                seconds = timed(work, device) / CALLS
                if round_:
                    times[label].append(seconds)
                errors[label] = ((leaves[0].grad.double() - exact.grad).norm() / exact.grad.norm()).item()
        for label in implementations:
            print(f"{name:<6} {label:<26} {1e3 * statistics.median(times[label]):>9.3f} {errors[label]:>10.2e}")
    print("done")


if __name__ == "__main__":
    main()
