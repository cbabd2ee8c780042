"""MFU and device peaks. Model FLOPs per token (matmuls only, forward + backward = 3 x forward) are
the objective's (`Objective.flops_per_token`: the encoder body, model/encoder.py, plus its heads; MLM:
6·L·(4h² + 2h·f) + 12·L·s·h + 6·(h² [RoBERTa head dense] + h·V)·mask_prob). MFU = flops/token x
tokens/s / peak; the peak comes from a table of known GPUs or, on CPU, from a matmul timed in the
same run.
"""

from __future__ import annotations

import functools
import time

import torch

# dense peak FLOP/s per GPU (no sparsity) by precision
GPU_PEAKS = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "V100": {"bf16": 125e12, "fp16": 125e12, "fp32": 15.7e12},
}

LOOP_MFU = {("deepspeed", False): 0.12, ("deepspeed", True): 0.13, ("flat", False): 0.16, ("flat", True): 0.20}
"""MFU of megamlm's training loop as measured, by (train.engine, train.compile): roberta.base zero-clap at
2048, bf16, micro-batch 8, one H200 (BENCHMARKS.md, GPU: NVIDIA H200: `loop-2048` 11.8-12.9%,
`loop-2048-compiled` 12.7-14.5%, `loop-2048-flat` 15.3-17.0%, `loop-2048-flat-compiled` 19.8-20.4%).
`megamlm plan` assumes it where --mfu is not given; roberta.large measured higher (18% and 25%). A lease that
measures a faster loop updates it."""
FASTEST_LOOP_MFU = 0.299
"""MFU of the loop with the fastest settings measured (configs/gpu/fastest.yaml: flat, compiled, micro-batch 16,
our Triton attention and FFN kernels, packed rows): roberta.base zero-clap at 2048, bf16, the recipe's attention
dropout 0.1, one H200 (BENCHMARKS.md, Session 60: `packed-2048-triton-flat-micro16-ffn` 29.8-29.9%). `megamlm
plan` assumes it for a run with every one of those settings, LOOP_MFU's otherwise."""
LOOP_MFU_MEASURED_ON = "roberta.base at 2048 on an H200"
"""What LOOP_MFU was measured on, in the words `megamlm plan` prints."""


def mfu(flops_per_token: float, tokens_per_s: float, peak: float, devices: int) -> float | None:
    """Model FLOPs utilization, or None where it cannot be true: above 1 means the peak was measured
    low (a CPU busy with something else while timing it), and a made-up number is worse than none."""
    value = flops_per_token * tokens_per_s / (peak * devices)
    return value if 0 < value <= 1 else None


def measured_matmul_peak(dtype: torch.dtype = torch.float32, max_size: int = 1024, trials: int = 5,
                         slow_s: float = 0.1) -> float:
    """FLOP/s of a square matmul on this CPU (the reference for MFU on machines without a table): the
    best of `trials` timings of 5 matmuls, because one timing caught by a moment of other load read
    a third of the rate (and the log then showed MFU 99% or n/a). The size doubles from 128 up to
    `max_size` while the doubled matmul (8x the work) would take under `slow_s`: a CPU without bf16
    units (0.5 GFLOP/s) spent 4 s on one bf16 matmul of 1024 and 2 minutes on the measurement; stopping
    only after a matmul exceeded `slow_s` still left 25 of 0.23 s each (512 at 1.2 GFLOP/s), 6 s of
    every bf16 run on such a CPU. fp32 reaches 1024 (20 ms on session 40's EPYC; its 512, 3 ms, has
    4x the margin for a loaded CPU), bf16 there stops at 256."""
    generator = torch.Generator().manual_seed(0)  # leave the training RNG streams alone
    size = 128
    while True:
        a, b = (torch.randn(size, size, generator=generator).to(dtype) for _ in range(2))
        a @ b  # warm-up
        start = time.perf_counter()
        a @ b
        if size >= max_size or 8 * (time.perf_counter() - start) > slow_s:
            break
        size *= 2
    best, reps = 0.0, 5
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = max(best, 2 * size**3 * reps / (time.perf_counter() - start))
    return best


def device_peak(device: torch.device, precision: str) -> tuple[float, str]:
    """(peak FLOP/s, where it came from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in GPU_PEAKS.items():
            if key in name:
                return peaks[precision], f"{name} datasheet"
        return float("nan"), f"{name} (unknown peak)"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return measured_matmul_peak(dtype), "CPU matmul measured at start"


class PeakRate:
    """The devices' peak for the log lines' MFU (`device_peak`). A CPU's is a matmul timed at the start: a CPU
    busy with something else then read it low, and every line's MFU came out above 1, n/a for the whole run (a
    `make demo` started beside a test, session 71). The first line past 1 on a CPU times the matmul again and
    keeps the higher rate; `retimed` holds the log's line for it until the loop takes it."""

    def __init__(self, device: torch.device, precision: str, devices: int, timed: bool = True):
        self.peak, self.source = device_peak(device, precision) if timed else (float("nan"), "rank 0's")
        self.devices = devices
        self._time_again = functools.partial(device_peak, device, precision) if timed and device.type == "cpu" else None
        self.retimed: str | None = None

    def __str__(self) -> str:
        return f"{self.peak / 1e12:.2f} TFLOP/s ({self.source})"

    def mfu(self, flops_per_token: float, tokens_per_s: float) -> float | None:
        value = mfu(flops_per_token, tokens_per_s, self.peak, self.devices)
        if value is None and self._time_again and flops_per_token * tokens_per_s > self.peak * self.devices:
            before = self.peak
            self.peak, self._time_again = max(before, self._time_again()[0]), None
            self.retimed = (f"peak timed again: {self.peak / 1e12:.2f} TFLOP/s (the start's {before / 1e12:.2f} "
                            f"read low: the CPU was busy then)")
            value = mfu(flops_per_token, tokens_per_s, self.peak, self.devices)
        return value
