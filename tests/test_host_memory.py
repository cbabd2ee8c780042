"""Training and GLUE fine-tuning on a CPU keep the large blocks tensors free in glibc's heap for the next step's
tensors (megamlm/host_memory.py): a 64 MiB tensor is then no longer a fresh mapping from the kernel. Each check
runs in its own process (the policy lasts for the rest of a process)."""

import ctypes
import ctypes.util
import platform

import pytest
import torch

from megamlm.host_memory import keep_freed_host_memory
from tests.multiproc import run_on_ranks
from tests.test_glue import _glue_on_ranks, write_tiny_folder
from tests.test_train import _train, config, tiny_shards

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator")

BLOCK = 64 << 20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mapped_bytes() -> int:
    """Bytes glibc holds in blocks mapped apart from its heap (mallinfo2's hblkhd)."""
    mallinfo2 = ctypes.CDLL(ctypes.util.find_library("c")).mallinfo2
    mallinfo2.restype = _MallInfo2
    return mallinfo2().hblkhd


def _block_is_mapped() -> bool:
    """Whether a 64 MiB tensor comes from a mapping of its own (unmapped again when freed)."""
    before = _mapped_bytes()
    block = torch.empty(BLOCK, dtype=torch.uint8).fill_(1)
    mapped = _mapped_bytes() - before >= BLOCK
    del block
    return mapped


def _before_and_after_the_policy() -> tuple[bool, bool, bool]:
    before = _block_is_mapped()
    applied = keep_freed_host_memory()
    return before, applied, _block_is_mapped()


def test_large_blocks_come_from_the_heap_once_the_policy_is_set():
    ((before, applied, after),) = run_on_ranks(_before_and_after_the_policy, 1)
    assert before and applied and not after


def _policy_for_a_gpu() -> tuple[bool, bool]:
    return keep_freed_host_memory("cuda"), _block_is_mapped()


def test_work_on_another_device_leaves_the_hosts_allocator_as_it_is():
    assert run_on_ranks(_policy_for_a_gpu, 1) == [(False, True)]


def _trained_then_block_is_mapped(cfg) -> bool:
    _train(cfg)
    return _block_is_mapped()


def test_training_on_a_cpu_sets_the_policy(tmp_path_factory, tmp_path):
    cfg = config(tiny_shards(tmp_path_factory, "host-memory"), tmp_path / "run", "train.steps=2")
    assert run_on_ranks(_trained_then_block_is_mapped, 1, cfg) == [False]


def _fine_tuned_then_block_is_mapped(folder) -> bool:
    _glue_on_ranks(write_tiny_folder(folder), ["RTE"])
    return _block_is_mapped()


def test_fine_tuning_on_a_cpu_sets_the_policy(tmp_path):
    assert run_on_ranks(_fine_tuned_then_block_is_mapped, 1, tmp_path / "model") == [False]
