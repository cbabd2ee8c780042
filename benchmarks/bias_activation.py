#!/usr/bin/env python
"""The FFN's bias + activation, forward and forward + backward: torch eager (autograd), Inductor
(torch.compile of the same two ops, what a compiled layer runs with model.bias_activation=torch) and
model.bias_activation=triton's kernels (model/triton_bias_activation.py), side by side.

    PYTHONPATH=. python benchmarks/bias_activation.py --device cuda     # [16,384, 3,072] bf16: base, micro-batch 8
    PYTHONPATH=. python benchmarks/bias_activation.py --rows 32768      # micro-batch 16

Times are medians of interleaved rounds (a GPU: device time between CUDA events around --calls calls
queued back to back, per call: one call per pair of events timed the host's launches, session 60's
lease: eager's forward read 0.430 ms where the loop's profile had Inductor's at 0.158); GB/s counts the bytes
each direction must move at least (forward: y in, out; backward: the gradient and y in, dy out); "error"
is the largest |difference| of out, dy and the bias's gradient from float64's, over the largest |value|.
Exits 1 where the kernels' error exceeds twice torch eager's (+ 1e-3): the check of the GPU's compiled
kernels (the tests run them in Triton's interpreter).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from megamlm.model.activation import ACTIVATIONS
from megamlm.model.bias_activation import bias_activation
from timing import timed, warm_clocks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _eager(activation: str):
    return lambda y, b: ACTIVATIONS[activation](y + b)


def _run(fn, y, b, g, backward: bool):
    y, b = y.detach().requires_grad_(backward), b.detach().requires_grad_(backward)
    out = fn(y, b)
    if not backward:
        return [out]
    return [out, *torch.autograd.grad(out, (y, b), g)]


def _calls(fn, y, b, g, backward: bool, calls: int) -> None:
    """`calls` runs back to back, each one's outputs dropped before the next (the device's queue stays
    ahead of the host as long as a call's kernels outlast its launches)."""
    for _ in range(calls):
        _run(fn, y, b, g, backward)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384, help="s · b: 2,048 x micro-batch 8")
    parser.add_argument("--ffn", type=int, default=3072, help="roberta.base's FFN width")
    parser.add_argument("--activation", default="gelu", choices=list(ACTIVATIONS))
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=20, help="calls per timed window (one on a CPU)")
    parser.add_argument("--no-compile", action="store_true", help="leave out Inductor (a CPU without a compiler)")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    calls = args.calls if device.type == "cuda" else 1
    if device.type == "cuda":
        warm_clocks()
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"bias + {args.activation}, [{args.rows}, {args.ffn}] {args.dtype}, {where}, torch {torch.__version__}")
    generator = torch.Generator(device=device).manual_seed(0)
    y = (torch.randn(args.rows, args.ffn, device=device, generator=generator) * 2).to(dtype)
    b = torch.randn(args.ffn, device=device, generator=generator).to(dtype)
    g = torch.randn(args.rows, args.ffn, device=device, generator=generator).to(dtype)
    exact = _run(_eager(args.activation), y.double(), b.double(), g.double(), backward=True)
    implementations = {"torch eager": _eager(args.activation)}
    if not args.no_compile:
        implementations["Inductor (torch.compile)"] = torch.compile(_eager(args.activation), dynamic=False)
    implementations["megamlm triton"] = lambda y, b: bias_activation(y, b, args.activation)
    size = y.element_size() * args.rows * args.ffn
    print(f"{'implementation':<26} {'fwd ms':>8} {'GB/s':>7} {'fwd+bwd ms':>11} {'GB/s':>7} {'error':>9}")
    times = {(label, backward): [] for label in implementations for backward in (False, True)}
    errors = {}
    for round_ in range(args.rounds + 1):  # round 0 warms up (and compiles)
        for label, fn in implementations.items():
            for backward in (False, True):
                seconds = timed(lambda fn=fn, backward=backward: _calls(fn, y, b, g, backward, calls), device) / calls
                if round_:
                    times[label, backward].append(seconds)
            if not round_:
                got = _run(fn, y, b, g, backward=True)
                errors[label] = max(((a.double() - e).abs().max() / e.abs().max()).item() for a, e in zip(got, exact))
    for label in implementations:
        forward, both = (statistics.median(times[label, backward]) for backward in (False, True))
        # bytes at least: forward 2 tensors; forward + backward 2 + 3
        print(f"{label:<26} {1e3 * forward:>8.3f} {2 * size / forward / 1e9:>7.0f} {1e3 * both:>11.3f} "
              f"{5 * size / both / 1e9:>7.0f} {errors[label]:>9.2e}")
    if errors["megamlm triton"] > 2 * errors["torch eager"] + 1e-3:
        raise SystemExit(f"megamlm triton's error {errors['megamlm triton']:.2e} exceeds twice torch eager's")
    print("done")


if __name__ == "__main__":
    main()
