"""Timing shared by the kernel benchmarks (run as scripts: `python benchmarks/NAME.py` puts this folder
on the path). Device windows as the tool library's METHOD.md asks: on a GPU, the device time between
two CUDA events around work queued back to back, not a host clock around each call."""

from __future__ import annotations

import time

import torch


def timed(work, device: torch.device) -> float:
    """Seconds `work()` takes: the device time between two CUDA events on a GPU, a host clock on a CPU."""
    if device.type != "cuda":
        start = time.perf_counter()
        work()
        return time.perf_counter() - start
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    work()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def interleaved(works: dict, rounds: int, device: torch.device, calls: int = 1) -> dict[str, list[float]]:
    """{label: seconds per call in each round} of works {label: work()}, each timed over `calls` calls back to back
    (each call's results dropped before the next), round after round in turn so that drift hits all; an
    untimed round first warms up (compiles, allocates)."""
    times = {label: [] for label in works}

    def run(work) -> None:
        for _ in range(calls):
            work()

    for round_ in range(rounds + 1):
        for label, work in works.items():
            seconds = timed(lambda work=work: run(work), device) / calls
            if round_:
                times[label].append(seconds)
    return times


def warm_clocks(seconds: float = 2.0) -> None:
    """Bring an idle GPU to its working clock before the first row: a lease's first command found the
    H200 at 345 MHz, and its first 2048 row read 0.94 ms where a later lease read 0.58 (session 24)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
