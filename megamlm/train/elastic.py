"""Elastic resume: continue a checkpoint written at one layout (TP, DP, ZeRO stage, micro-batch ×
accumulation) at another, with the same global batch.

A checkpoint's DeepSpeed files hold every optimizer tensor (fp32 master weights, AdamW's two
moments) cut twice: by tensor parallelism (megamlm's shard rules, `megamlm.model.tp`) and by ZeRO's
data-parallel partitions (stage 0: none; 1/2: one flat range per rank, mapped to parameter names by
DeepSpeed's own `param_slice_mappings`, the index its universal checkpoints are made from; 3: each
parameter cut in DP equal parts). `read_full_state` indexes both cuts; `FullState.full` undoes them
into one full (TP=1) tensor per kind, one parameter at a time; `load_full_state` cuts each again for
the running engine through DeepSpeed's tensor-fragment API (`safe_set_full_fp32_param` /
`safe_set_full_optimizer_state`, which address ZeRO-1/2/3 and the bf16 optimizer alike), or the
parameters and torch's optimizer state at stage 0, or the flat engine's ranges (`FlatEngine.set_full`;
its files are in the stage-0 layout, so it also loads every checkpoint this way, its own included).

Every rank reads every file it needs, so the files are memory-mapped: the ranks of a node share one
copy in the page cache (and one read from the file system), and a rank's own memory holds the full
form of one parameter at a time, not the whole optimizer state (`benchmarks/elastic_memory.py`).

Why not DeepSpeed's `ds_to_universal` + `load_universal` as they are: the loader cannot fill a
stage-0 engine (every fp32 run on one DP rank is one), it reads the module from model-state files
of the *target* TP ranks (absent when TP grows), and its TP merge needs Megatron-DeepSpeed's
pattern lists; megamlm's shard rules already know each parameter's split.

What is not carried: per-rank random streams (dropout; the tensor-parallel stream) have no meaning
on another set of ranks, so they are reseeded from (train.seed, update) on every rank; the data
and masking streams are layout-independent already. fp16's dynamic loss scale restarts at its
initial value, except from the flat engine's files, which carry it (`loss_scaler`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from megamlm.config import Config, ConfigError, ModelConfig, config_from_dict
from megamlm.data.stream import StreamPosition
from megamlm.data.updates import UpdateShape
from megamlm.model.reshard import from_full
from megamlm.model.tp import merge_shards, shard_rule
from megamlm.train.flat import FlatEngine

KINDS = ("fp32", "exp_avg", "exp_avg_sq")
"""What the optimizer holds per parameter: the master weights and AdamW's two moments."""


@dataclass(frozen=True)
class Layout:
    """How a run is cut over its ranks; the global batch (in stream units: samples, or packed rows)
    is what must stay the same for the next update to take the samples it would have taken."""

    tp: int
    zero_stage: int
    update: UpdateShape
    """What one update takes from the stream (micro-batch, accumulation, DP size, packing)."""
    engine: str = "deepspeed"
    """train.engine (the flat engine writes stage-0 files but is not DeepSpeed's stage-0 engine)."""

    @classmethod
    def of(cls, cfg: Config, dp: int, zero_stage: int) -> Layout:
        return cls(cfg.parallel.tensor_parallel, zero_stage, UpdateShape.of(cfg, dp), cfg.train.engine)

    @property
    def dp(self) -> int:
        return self.update.dp_size

    def same_shards(self, other: Layout) -> bool:
        """The engine's own cut of the files fits (micro-batch and accumulation may differ)."""
        return (self.tp, self.dp, self.zero_stage, self.engine) == (other.tp, other.dp, other.zero_stage, other.engine)

    @property
    def engine_name(self) -> str:
        return "flat engine" if self.engine == "flat" else f"ZeRO-{self.zero_stage}"

    def __str__(self) -> str:
        return f"TP={self.tp} DP={self.dp} {self.engine_name}"


def written_layout(meta: dict, zero_stage: int) -> Layout:
    """The layout a checkpoint's megamlm.json records (older ones: derived from its config)."""
    cfg = config_from_dict(meta["config"])
    return Layout.of(cfg, meta["world_size"] // cfg.parallel.tensor_parallel, zero_stage)


def convert_position(position: StreamPosition, written: Layout, running: Layout, allow_batch_change: bool,
                     source: str = "the checkpoint") -> tuple[StreamPosition, str | None]:
    """The stream position at `running` of the one saved at `written` (a checkpoint is always taken
    between updates, so the position counts whole updates); with another global batch (only when
    allowed) the samples consumed are carried over, rounded down to whole updates: (position, note)."""
    w, r = written.update, running.update
    if w.packed != r.packed:
        raise ConfigError(f"{source} was written with data.packing={'packed' if w.packed else 'padded'}; "
                          f"resume with the same data.packing")
    updates, rest = divmod(position.batch, w.accumulation)
    if rest:
        raise ConfigError(f"{source}: stream position {position.batch} is not at an update boundary "
                          f"(accumulation {w.accumulation})")
    if w.global_batch == r.global_batch:
        return StreamPosition(position.epoch, updates * r.accumulation), None
    unit = "packed rows" if w.packed else "sequences"
    if not allow_batch_change:
        raise ConfigError(f"{source} was written with a global batch of {w.global_batch} {unit} "
                          f"({written}, micro {w.micro_batch} x accumulation {w.accumulation}), "
                          f"this run's is {r.global_batch}: set train.global_batch_size={w.global_batch}"
                          f" to continue the run, or pass --allow-batch-change to convert the data position in samples")
    consumed = updates * w.global_batch
    new_updates = consumed // r.global_batch
    repeated = consumed - new_updates * r.global_batch
    note = (f"global batch {w.global_batch} -> {r.global_batch} {unit}: data position "
            f"{consumed} {unit} into epoch {position.epoch} = update {new_updates} of the new batch"
            + (f" ({repeated} {unit} are seen again)" if repeated else ""))
    return StreamPosition(position.epoch, new_updates * r.accumulation), note


# ---- reading: DeepSpeed files -> full tensors ---------------------------------------------------------

def _load(path: Path) -> dict:
    # our own checkpoint: trusted; mmap: tensors are views of the file, read when a parameter is assembled
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


def _optimizer_file(folder: Path, dp_rank: int, tp_rank: int) -> dict:
    """A ZeRO partition's optimizer state (DeepSpeed prefixes the file name with bf16_ in bf16 runs)."""
    name = f"zero_pp_rank_{dp_rank}_mp_rank_{tp_rank:02d}_optim_states.pt"
    path = folder / f"bf16_{name}" if (folder / f"bf16_{name}").exists() else folder / name
    return _load(path)["optimizer_state_dict"]


@dataclass(frozen=True)
class Pieces:
    """One TP rank's tensor of one parameter and kind, as views of the checkpoint's (memory-mapped)
    flat tensors: nothing is read before `tensor()`."""

    parts: list[torch.Tensor]
    """1-D slices end to end (a ZeRO-3 part may run past the tensor: padding)."""
    shape: torch.Size
    """The shape of that rank's parameter."""

    @classmethod
    def whole(cls, tensor: torch.Tensor) -> Pieces:
        return cls([tensor.flatten()], tensor.shape)

    def tensor(self) -> torch.Tensor:
        flat = self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)
        return flat[: self.shape.numel()].view(self.shape)


Shard = dict[str, dict[str, Pieces]]
"""One TP rank's tensors: parameter name -> kind (KINDS) -> its pieces."""


def _stage0(folder: Path, tp_rank: int, names: list[str]) -> tuple[Shard, float]:
    """torch's optimizer state indexes parameters in model order (names); fp32 keeps the master
    weights in the module, bf16/fp16 (DeepSpeed's unfused mixed-precision optimizer) beside it."""
    states = _load(folder / f"mp_rank_{tp_rank:02d}_model_states.pt")
    optimizer = states["optimizer"]
    if "fp32_groups" in optimizer:
        masters = [t for group in optimizer["fp32_groups"] for t in group]
        moments = optimizer["optimizer_state_dict"]["state"]
    else:
        masters, moments = [states["module"][name] for name in names], optimizer["state"]
    shard = {name: {"fp32": Pieces.whole(masters[i]), **{k: Pieces.whole(moments[i][k]) for k in KINDS[1:]}}
             for i, name in enumerate(names)}
    return shard, float(moments[0]["step"])


def _stage12(folder: Path, tp_rank: int, dp: int) -> tuple[Shard, float]:
    """Each DP rank's flat partition holds a slice of each flattened parameter it overlaps
    (`param_slice_mappings`: name -> (start, numel) in the partition); slices follow DP rank order."""
    shapes = _load(folder / f"mp_rank_{tp_rank:02d}_model_states.pt")["param_shapes"]
    pieces: dict[str, dict[str, list[torch.Tensor]]] = {}
    for dp_rank in range(dp):
        optim = _optimizer_file(folder, dp_rank, tp_rank)
        moments = optim["base_optimizer_state"]["state"]
        for group, mapping in enumerate(optim["param_slice_mappings"]):
            flats = {"fp32": optim["single_partition_of_fp32_groups"][group],
                     **{k: moments[group][k] for k in KINDS[1:]}}
            for name, fragment in mapping.items():
                for kind, flat in flats.items():
                    pieces.setdefault(name, {}).setdefault(kind, []).append(
                        flat.narrow(0, fragment.start, fragment.numel))
    shape_of = {name: shape for group in shapes for name, shape in group.items()}
    shard = {name: {kind: Pieces(parts, shape_of[name]) for kind, parts in kinds.items()}
             for name, kinds in pieces.items()}
    return shard, float(moments[0]["step"])


def _stage3(folder: Path, tp_rank: int, dp: int) -> tuple[Shard, float]:
    """Each parameter is cut into DP parts of ceil(numel / DP) (the last padded), laid end to end in
    parameter order in every rank's flat group."""
    shapes = _load(folder / f"zero_pp_rank_0_mp_rank_{tp_rank:02d}_model_states.pt")["param_shapes"]
    flats: list[list[dict[str, torch.Tensor]]] = []  # [dp rank][group] -> kind -> flat
    for dp_rank in range(dp):
        optim = _optimizer_file(folder, dp_rank, tp_rank)
        moments = optim["optimizer_state_dict"]["state"]
        flats.append([{"fp32": flat, **{k: moments[group][k] for k in KINDS[1:]}}
                      for group, flat in enumerate(optim["fp32_flat_groups"])])
    shard = {}
    for group, group_shapes in enumerate(shapes):
        offset = 0
        for name, shape in group_shapes.items():
            part = math.ceil(shape.numel() / dp)
            shard[name] = {kind: Pieces([flats[r][group][kind].narrow(0, offset, part) for r in range(dp)], shape)
                           for kind in KINDS}
            offset += part
    return shard, float(moments[0]["step"])


@dataclass
class FullState:
    shards: list[Shard]
    """Per written TP rank: what its files hold, indexed (nothing read yet)."""
    model: ModelConfig
    """The written model (how its parameters are sharded)."""
    optimizer_step: float
    """AdamW's step count (the same for every parameter: each one is updated at every step)."""
    engine: dict
    """DeepSpeed's counters and the LR schedule's state, from the model-state file of rank 0."""

    @property
    def names(self) -> list[str]:
        return list(self.shards[0])

    def full(self, name: str, kind: str) -> torch.Tensor:
        """The full (TP=1) fp32 tensor of parameter `name`'s `kind` (KINDS), read now."""
        # replicated parameters: TP rank 0's copy, as DeepSpeed's universal checkpoints take it
        ranks = self.shards if shard_rule(name)[0] is not None else self.shards[:1]
        parts = [{name: shard[name][kind].tensor()} for shard in ranks]
        return merge_shards(parts, self.model, check_replicas=False)[name].float()


def read_full_state(folder: Path, written: Layout, names: list[str], cfg: Config) -> FullState:
    """Every optimizer tensor of checkpoint `folder`, to be read in full form parameter by parameter
    (`names`: the model's parameters in order, which a stage-0 file indexes by position)."""
    per_tp = []
    for tp_rank in range(written.tp):
        if written.zero_stage == 0:
            shard, step = _stage0(folder, tp_rank, names)
        elif written.zero_stage < 3:
            shard, step = _stage12(folder, tp_rank, written.dp)
        else:
            shard, step = _stage3(folder, tp_rank, written.dp)
        per_tp.append(shard)
    first = (folder / "mp_rank_00_model_states.pt") if written.zero_stage < 3 else \
        (folder / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    engine = {k: v for k, v in _load(first).items() if k in ("global_steps", "global_samples", "skipped_steps",
                                                               "lr_scheduler", "loss_scaler")}
    return FullState(per_tp, cfg.model, step, engine)


# ---- loading: full tensors -> the running engine ----------------------------------------------------

def _stepped_tensors(optimizer, base: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What torch's AdamW steps: the fp32 partitions of ZeRO-3, ZeRO-1/2 and the bf16 optimizer
    (each keeps them under its own name), or at stage 0 the parameters."""
    for flats in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition"):
        if hasattr(optimizer, flats):
            return list(getattr(optimizer, flats))
    return [p for group in base.param_groups for p in group["params"]]


def _init_optimizer_state(base: torch.optim.Optimizer, tensors: list[torch.Tensor]) -> None:
    """torch creates AdamW's state at its first step; create it now (as torch would) to overwrite it."""
    fused = bool(base.defaults.get("fused"))
    for p in tensors:
        state = base.state[p]
        state.setdefault("step", torch.zeros((), dtype=torch.float32, device=p.device if fused else "cpu"))
        for kind in KINDS[1:]:
            state.setdefault(kind, torch.zeros_like(p, memory_format=torch.preserve_format))


def _stage0_masters(engine, optimizer, base: torch.optim.Optimizer) -> dict[int, torch.Tensor] | None:
    """Stage 0: id(parameter) -> the tensor torch's AdamW steps for it (fp32: the parameter itself;
    bf16/fp16: DeepSpeed's fp32 copy); None under ZeRO, which cuts the masters into partitions."""
    if engine.zero_optimization_stage() != 0:
        return None
    if optimizer is base:
        return {id(p): p for group in base.param_groups for p in group["params"]}
    return {id(lp): hp for lps, hps in zip(optimizer.fp16_groups, optimizer.fp32_groups) for lp, hp in zip(lps, hps)}


def base_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch AdamW that steps: ZeRO's and the bf16 optimizer wrap it (`.optimizer`); otherwise itself."""
    return getattr(optimizer, "optimizer", optimizer)


@torch.no_grad()
def load_full_state(engine, schedule, state: FullState) -> None:
    """Collective: cut `state` for this rank and put it into the engine (module, master weights,
    moments, step count, schedule, DeepSpeed's counters)."""
    from deepspeed import zero
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    model: nn.Module = engine.module
    optimizer = engine.optimizer
    base = base_optimizer(optimizer)
    stepped = _stepped_tensors(optimizer, base)
    _init_optimizer_state(base, stepped)
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        optimizer._lazy_init_hp_params_optimizer_state()  # links each parameter to its moment fragments
    params = dict(model.named_parameters())
    flat = isinstance(engine, FlatEngine)
    masters = None if flat else _stage0_masters(engine, optimizer, base)
    if set(params) != set(state.names):
        missing, unexpected = sorted(set(params) - set(state.names)), sorted(set(state.names) - set(params))
        raise ConfigError(f"the checkpoint's parameters differ from the model's: missing {missing or 'none'}, "
                          f"unexpected {unexpected or 'none'}")
    for name, param in params.items():
        for kind in KINDS:  # one full tensor in memory at a time
            local = from_full(model, param, state.full(name, kind))
            if flat:
                engine.set_full(param, kind, local)
                continue
            if kind == "fp32":  # the module's copy; ZeRO-3 holds only this rank's partition of it
                with zero.GatheredParameters([param], modifier_rank=0) if hasattr(param, "ds_id") else \
                        contextlib.nullcontext():
                    param.data.copy_(local.to(param.dtype))
            if masters is not None:
                master = masters[id(param)]
                (master if kind == "fp32" else base.state[master][kind]).data.copy_(local)
            elif kind == "fp32":  # each rank sets the fragments its partition holds (ZeRO-1/2: maybe none of this one)
                safe_set_full_fp32_param(param, local)
            else:
                safe_set_full_optimizer_state(param, local, kind)
    for tensor in stepped:
        base.state[tensor]["step"].fill_(state.optimizer_step)
    schedule.load_state_dict(state.engine["lr_scheduler"])
    engine.global_steps = state.engine["global_steps"]
    engine.global_samples = state.engine["global_samples"]
    engine.skipped_steps = state.engine["skipped_steps"]
    if flat and engine.scaler is not None and "loss_scaler" in state.engine:  # the flat engine's fp16 files
        engine.scaler.load_state_dict(state.engine["loss_scaler"])
