"""Distributed plumbing: process groups, megatron parallel_state, seeding, the tensor-parallel RNG.

This is the only module that touches `megatron.core.parallel_state`; everything else receives a
`ParallelContext` (process groups and ranks) explicitly.

Launch: torchrun (or SLURM's srun, which sets SLURM_PROCID/SLURM_NTASKS) provides RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. A plain `python` run without them becomes a
world of one, so every tool works unchanged on a laptop.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from megamlm.config import ConfigError, ParallelConfig


@dataclass
class ParallelContext:
    """Process groups and ranks of this process. World = TP × DP (pipeline parallel = 1)."""

    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device

    @property
    def pg_collection(self) -> ProcessGroupCollection:
        """The groups in the form megatron-core modules take them."""
        pgs = ProcessGroupCollection()
        pgs.tp = self.tp_group
        pgs.dp = self.dp_group
        pgs.cp = parallel_state.get_context_parallel_group()
        pgs.pp = parallel_state.get_pipeline_model_parallel_group()
        return pgs


def _env_int(*names: str, default: int) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    return default


def check_world_size(cfg: ParallelConfig, world: int, made_of: str = "") -> None:
    """The layout's rule for a world of `world` processes (TP x DP, DP >= 1); `made_of` says where the
    number comes from (e.g. "2 nodes x 8 GPUs")."""
    if world % cfg.tensor_parallel:
        raise ConfigError(
            f"parallel.tensor_parallel={cfg.tensor_parallel} does not divide the world size "
            f"{world}{f' ({made_of})' if made_of else ''}; launch a multiple of {cfg.tensor_parallel} processes"
        )


def process_backend(cfg: ParallelConfig) -> str:
    """parallel.backend as this machine runs it (auto: nccl where CUDA is available, else gloo)."""
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("parallel.backend=nccl needs CUDA GPUs; allowed here: gloo, auto")
    return backend


def check_gpus(backend: str, processes: int, gpus: int | None = None) -> None:
    """NCCL runs a process per GPU: refuse more processes on a machine than it has GPUs (`gpus`; None:
    this machine's)."""
    if backend != "nccl":
        return
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if processes > gpus:
        raise ConfigError(f"{processes} processes on this machine, which has {gpus} GPU{'s' * (gpus != 1)} (NCCL "
                          f"runs one process per GPU): launch at most {gpus} a node, or parallel.backend=gloo")


def init_distributed(cfg: ParallelConfig) -> ParallelContext:
    """Initialize torch.distributed (if needed) and megatron's TP × DP groups."""
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    # DeepSpeed reads these itself; make srun and plain `python` runs look like torchrun
    for name, value in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", local_rank)):
        os.environ.setdefault(name, str(value))
    backend = process_backend(cfg)
    # local rank r is GPU r: a process past the last GPU would fail in set_device with CUDA's words
    check_gpus(backend, local_rank + 1)
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=30)
        if world == 1 and "MASTER_ADDR" not in os.environ:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
        else:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    check_world_size(cfg, dist.get_world_size())
    if not (parallel_state.model_parallel_is_initialized()
            and parallel_state.get_tensor_model_parallel_world_size() == cfg.tensor_parallel):
        # the same layout as an earlier call in this process keeps its groups: megatron's
        # destroy_model_parallel drops its references without destroying the groups, and each new
        # set of gloo groups starts ~50 threads that stay (they slowed the test suite by minutes)
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=cfg.tensor_parallel)
    return ParallelContext(
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        dp_group=parallel_state.get_data_parallel_group(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        device=device,
    )


def tensor_parallel_shard() -> tuple[dist.ProcessGroup, int]:
    """The tensor-parallel group `init_distributed` made and this process's rank in it, for code that is handed
    vocab-parallel logits but no ParallelContext (objectives/mlm.py `vocab_parallel_loss`, as megatron-core's
    cross-entropy found them)."""
    return parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_rank()


def barrier() -> None:
    """dist.barrier over every rank, on the device this process computes on. NCCL's barrier is an all-reduce of
    one element: given no device it takes the current one and warns (every GPU run's log had "barrier(): using
    the device under current context"). Binding the device in init_process_group (device_id=) would mute it too,
    but then NCCL splits every megatron group from the world's communicator, which hung or slowed megatron-core
    runs elsewhere (NVIDIA-NeMo/RL#3073, Automodel#378)."""
    nccl = dist.get_backend() == "nccl"
    dist.barrier(device_ids=[torch.cuda.current_device()] if nccl else None)


def destroy_distributed() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# Seeding
# ------------------------------------------------------------------------------------------------


class TensorParallelRNG:
    """A second RNG stream for randomness inside tensor-parallel regions (attention dropout).

    Activations that are replicated across TP ranks (embeddings, residual stream) must draw the
    same dropout masks on every TP peer, so they use the default generator, seeded identically.
    Attention probabilities are sharded by head: each TP rank must draw *different* masks, so they
    use this stream, seeded per TP rank. megatron's own tracker of this kind is CUDA-only; this one
    swaps the default CPU or CUDA generator state in and out and works on both.
    """

    def __init__(self):
        self._states: dict[str, torch.Tensor] = {}
        self.tp_size = 1
        """Tensor-parallel ranks the stream serves (seed_everything)."""

    def seed(self, seed: int, tp_size: int = 1) -> None:
        self.tp_size = tp_size
        with torch.random.fork_rng(devices=[torch.cuda.current_device()]
                                   if torch.cuda.is_available() else []):
            torch.manual_seed(seed)
            self._states = {"cpu": torch.get_rng_state()}
            if torch.cuda.is_available():
                self._states["cuda"] = torch.cuda.get_rng_state()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self._states)

    def load_state_dict(self, states: dict[str, torch.Tensor]) -> None:
        self._states = dict(states)

    def bypassed(self) -> bool:
        """Whether `fork` leaves the default generator in place: in code torch.compile traces at TP=1.
        One TP rank has no peer whose masks must differ; swapping generator states cannot be traced (a
        graph break around every attention with dropout), and compiled code draws its own random numbers
        (Inductor's Philox), not eager's sequence, either way."""
        return self.tp_size == 1 and torch.compiler.is_compiling()

    @contextlib.contextmanager
    def fork(self, device: torch.device):
        """Run the block with this stream as the default generator of `device`."""
        if not self._states:
            raise RuntimeError("TensorParallelRNG used before seed_everything()")
        if self.bypassed():
            yield
            return
        cuda = device.type == "cuda"
        key = "cuda" if cuda else "cpu"
        get_state = torch.cuda.get_rng_state if cuda else torch.get_rng_state
        set_state = torch.cuda.set_rng_state if cuda else torch.set_rng_state
        outer = get_state()
        set_state(self._states[key])
        try:
            yield
        finally:
            self._states[key] = get_state()
            set_state(outer)


tensor_parallel_rng = TensorParallelRNG()


def seed_everything(seed: int, ctx: ParallelContext) -> None:
    """Same default stream on TP peers (any TP degree gives the same replicated randomness);
    a distinct tensor-parallel stream per TP rank, as megatron's model_parallel_cuda_manual_seed."""
    torch.manual_seed(seed)
    tensor_parallel_rng.seed(seed + 2718 + ctx.tp_rank, ctx.tp_size)


def host_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. To a GPU through pinned memory with non_blocking: a copy from
    pageable memory makes the host wait until every kernel queued before it has run (a full
    synchronization per tensor), so the next micro-batch's kernels could not be queued ahead."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class ToHost:
    """A device tensor's value on its way to the host: the copy is queued without waiting (pinned
    memory and an event on a GPU) and `get()` waits for that copy only, not for the work queued after
    it. So the loop reads an update's loss while the GPU already runs the next update. `tensor` must
    not change after this (on a CPU it is not copied)."""

    def __init__(self, tensor: torch.Tensor):
        self.event = None
        if tensor.device.type != "cuda":
            self.host = tensor
            return
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.host.copy_(tensor, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def get(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host
