"""train.profile_updates: where the training loop's own updates spend their time (torch.profiler).

The benchmarks profile a bare step; the loop adds the engine (DeepSpeed's optimizer and gradient
accumulation), the data loader and the per-update read of the loss. After `WARM_UP` updates
(compilation happens in the first) the next `train.profile_updates` are recorded on rank 0, which
prints the operator table (by device time on a GPU, by CPU time otherwise), writes it to
run_dir/profile.txt and logs a `profile` event: the wall time per update and, on a GPU, the share of
it the device was busy — the rest is time the GPU waited for the host (launches, reads, data,
optimizer bookkeeping). The profiled updates run slower than the others; log lines of their window
show it.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from megamlm.console import print_line

WARM_UP = 2
"""Updates run before recording starts (the first compiles under train.compile / Flex)."""

PHASES = ("data", "forward", "backward", "engine step", "loss read")
"""The loop's phases, each under `phase(name)`: the report gives the host's time in each per update.
"loss read" is the host's one wait for the device per update: for the previous update's loss while this
update's work is queued, or for this update's own before a log line, an evaluation or a checkpoint.
Long when the host ran ahead of the GPU, short when the GPU waited for the host."""


_PHASE_PREFIX = "megamlm: "


def phase(name: str) -> torch.profiler.record_function:
    """A profiler range named `megamlm: NAME` (when nothing records: an enter and an exit call, two of the
    ~6,600 host operations of an update at 12 layers, benchmarks/loop_ops.py)."""
    assert name in PHASES, name
    return torch.profiler.record_function(_PHASE_PREFIX + name)


def host_phase_ms(averages, updates: int) -> dict[str, float]:
    """{phase: the host's ms per update in it} from the profiler's `key_averages()` over `updates`. On a GPU
    a phase that queued kernels is listed twice, its host range and the range of its kernels (a
    `gpu_user_annotation`, no host time): the host's is the CPU one (the other, read last, made lease 8's
    forward, backward and engine step 0.0 ms)."""
    return {e.key.removeprefix(_PHASE_PREFIX): e.cpu_time_total / 1e3 / updates for e in averages
            if e.key.startswith(_PHASE_PREFIX) and e.device_type == DeviceType.CPU}


class UpdateProfiler:
    """Records updates first_step + WARM_UP + 1 .. (at most last_step) when `updates` > 0 and `enabled`."""

    def __init__(self, updates: int, first_step: int, last_step: int, device: torch.device, path: Path,
                 enabled: bool = True):
        self.start = first_step + WARM_UP  # recording starts once this update is done
        self.stop = min(self.start + updates, last_step)
        self.active = enabled and updates > 0 and self.start < self.stop
        self.device, self.path = device, path
        self.profiler: profile | None = None
        self.recorded, self.began = 0, 0.0

    def update_done(self, step: int, log) -> None:
        """Call after each update (`step`: updates done): starts, counts or finishes the recording."""
        if not self.active:
            return
        if self.profiler is None:
            if step >= self.start:
                self._synchronize()
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
                self.profiler = profile(activities=activities)
                with warnings.catch_warnings():
                    # torch 2.11 (the lent GPUs') warns at every start that a cycle's end clears the events
                    # (pytorch#180348; 2.13 does not): one cycle here; it was in every profiled log of leases 1-8
                    warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
                    self.profiler.start()
                self.began = time.perf_counter()
            return
        self.recorded += 1
        if step >= self.stop:
            self._synchronize()
            wall = time.perf_counter() - self.began
            self.profiler.stop()
            self._report(step, wall, log)
            self.active = False

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _report(self, step: int, wall: float, log) -> None:
        averages = self.profiler.key_averages()
        on_device = self.device.type == "cuda"
        # kernel time, as torch's table footer sums it ("Self CUDA time total"), in microseconds
        busy = sum(e.self_device_time_total for e in averages
                   if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)) / 1e6 \
            if on_device else None
        def table(sort_by: str, rows: int) -> str:
            return averages.table(sort_by=sort_by, row_limit=rows, max_name_column_width=70)

        by_time = "self_cuda_time_total" if on_device else "self_cpu_time_total"
        # the file: the long tail too (the H200's top 30 left 17.6% of the kernel time unnamed)
        report = table(by_time, 100)
        if on_device:  # what keeps the host busy while the GPU waits
            report += "\n" + table("self_cpu_time_total", 25)
        self.path.write_text(report)
        print_line(table(by_time, 30))
        per_update = wall / self.recorded
        host = host_phase_ms(averages, self.recorded)
        text = f"profile: {self.recorded} update{'s' if self.recorded > 1 else ''}, {per_update * 1e3:.1f} ms each"
        if busy is not None:
            text += f"; the device busy {100 * busy / wall:.1f}% of it (the rest it waited for the host)"
        if host:
            text += "; host ms per update: " + ", ".join(f"{name} {host[name]:.1f}" for name in PHASES if name in host)
        log.event("profile", step, f"{text}; operators in {self.path}", updates=self.recorded,
                  update_s=per_update, device_busy=None if busy is None else busy / wall, host_ms=host)
