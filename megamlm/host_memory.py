"""How the host's C allocator treats the large blocks tensors free, for training (and GLUE fine-tuning) on a CPU.

torch's CPU tensors come from the C library's malloc. glibc maps every block above its mmap threshold (at most
32 MiB by its own adjustment) freshly from the kernel and unmaps it when freed, so each large tensor of a
training step — the head's [n, V] logits, the [V, h] table's gradients, the attention probabilities — costs a
page fault per 4 KiB page and the zeroing of each page, every step (a 61 MB copy took twice as long as from
reused memory: BENCHMARKS.md, "Session 64"). Raising the threshold, and the trim threshold with it, keeps such
blocks in the heap once freed, for the next step's tensors: what jemalloc or TCMalloc (Intel's advice for
training on CPUs) do, without another library. The results are bit-identical; the process keeps its peak
memory instead of returning it between steps. Other C libraries (macOS, musl) keep their own policy.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""glibc's mallopt parameters (malloc.h)."""

KEPT_BLOCK_BYTES = 1 << 30
"""Blocks up to this size come from the heap and stay there once freed (base at 512 x 8's largest tensors are
~120 MB); larger ones are mapped and unmapped as before."""


def keep_freed_host_memory(device_type: str = "cpu") -> bool:
    """Raise glibc's mmap and trim thresholds (`KEPT_BLOCK_BYTES`) for the rest of this process where the work's
    tensors are the host's (`device_type` "cpu"); False where nothing changed: another device (its tensors come
    from its own allocator) or a C library other than glibc."""
    if device_type != "cpu":
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    # (the values are C ints: a freed top of the heap is returned only beyond 2 GiB)
    return bool(mallopt(M_MMAP_THRESHOLD, KEPT_BLOCK_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
