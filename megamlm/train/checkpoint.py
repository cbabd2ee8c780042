"""Checkpoints that survive preemption: DeepSpeed shards + our per-rank state, an atomic `latest`.

Layout under <run_dir>/checkpoints/:
  step00000500/                    DeepSpeed's files (model, optimizer/ZeRO shards, schedule; the
                                   flat engine writes DeepSpeed's stage-0 layout)
  step00000500/rank00000.pt        this rank's RNG states (CPU, CUDA, tensor-parallel stream)
  step00000500/megamlm.json        step, data position, data seed, rollbacks, config, and the size
                                   and sha256 of every other file of the folder
  step00000500/complete            written by rank 0 after every rank finished writing: the sha256
                                   of megamlm.json
  latest                           name of the newest complete checkpoint, replaced atomically

A checkpoint without `complete` (interrupted while writing) is never chosen by resume (a save whose
writing fails, say on a full disk, removes its folder and raises SaveError); one whose
files differ from their recorded hashes (damaged on disk) is skipped by `--resume auto` with a
warning, and refused when named explicitly. Hashing is spread over the ranks (file i: rank i mod
world size), as is verification; before the ranks start, the launcher skips (or refuses) the same
checkpoints as far as megamlm.json and the files' sizes tell (`checkpoint_folders.newest_intact`).

The run directory belongs to one run: `train/preflight.py` refuses to start a new run over an old one
(unless asked to move it aside) and never touches files it did not write.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megamlm.config import Config, ConfigError, as_yaml
from megamlm.data.stream import StreamPosition
from megamlm.errors import MegamlmError, error_line, peer_gone
from megamlm.files import CHECKPOINT_LATEST, CHECKPOINT_META, RUN_CHECKPOINTS, describe_files
from megamlm.parallel import ParallelContext, barrier, seed_everything, tensor_parallel_rng
from megamlm.train.checkpoint_folders import (COMPLETE_FILE, RunDirError, checkpoint_problem,
                                              complete_tags, first_intact, newest_complete, read_meta,
                                              require_complete, written_zero_stage)
from megamlm.train.elastic import (Layout, base_optimizer, convert_position, load_full_state, read_full_state,
                                   written_layout)


class SaveError(MegamlmError):
    """A checkpoint could not be written (a full disk, a quota); the complete ones before it stay."""


@dataclass
class TrainState:
    """What the loop needs besides the engine to continue exactly where it stopped."""

    step: int = 0
    position: StreamPosition = field(default_factory=StreamPosition)
    data_seed: int = 1
    rollbacks: int = 0
    rng: dict | None = None
    """RNG states read from a checkpoint; the loop applies them right before its next update."""
    resharded: str | None = None
    """Set when the checkpoint came from another layout: "TP=2 DP=1 ZeRO-0 into TP=1 DP=2 ZeRO-1"."""
    note: str | None = None
    """What a changed global batch did to the data position (--allow-batch-change)."""

    def restore_rng(self) -> None:
        if self.rng is not None:
            set_rng_state(self.rng)
            self.rng = None


def checkpoint_bytes(cfg: Config, parameters: int, dp: int) -> int:
    """Bytes of one checkpoint folder, every rank's files together (the tiny model's folders in 7 layouts
    are within 1% of it; tests/test_checkpoint_disk.py). Adam's two fp32 moments (8 bytes a parameter)
    and an fp32 copy of the weights (4) always; DeepSpeed's ZeRO optimizers keep that copy in their own
    files, so their model files add the weights in the run's dtype, except at ZeRO-3 (weights
    partitioned into the optimizer files). The flat engine and fp32 at stage 0 save the fp32 weights
    once (DeepSpeed's stage-0 layout)."""
    train = cfg.train
    stage = train.engine_zero_stage(dp)
    if train.engine == "flat" or (stage == 0 and train.precision == "fp32"):
        return 12 * parameters
    module = 0 if stage >= 3 else 4 if train.precision == "fp32" else 2
    return (12 + module) * parameters


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rng_state() -> dict:
    state = {"cpu": torch.get_rng_state(), "tensor_parallel": tensor_parallel_rng.state_dict()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    tensor_parallel_rng.load_state_dict(state["tensor_parallel"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpoints:
    def __init__(self, run_dir: str | Path, keep_last: int, allow_batch_change: bool = False):
        self.root = Path(run_dir) / RUN_CHECKPOINTS
        self.keep_last = keep_last
        self.allow_batch_change = allow_batch_change
        """A checkpoint of another global batch may be resumed (its data position converted in samples)."""
        self.rank = dist.get_rank()
        # the folder is made by the first save: a run that fails before it leaves nothing in train.run_dir
        # that would make the same command, its input fixed, refuse the folder as a user's (preflight.py)

    def save(self, engine, state: TrainState, cfg: Config) -> Path:
        """Collective: every rank calls it. A rank whose writing fails (a full disk, a quota) removes the
        unfinished folder and raises SaveError; so does every other rank, once its collective loses that
        rank's process."""
        tag = f"step{state.step:08d}"
        folder = self.root / tag
        self.root.mkdir(parents=True, exist_ok=True)
        if self.rank == 0 and folder.exists():  # a leftover of an interrupted save of this step
            shutil.rmtree(folder)
        barrier()
        failure = None
        try:
            engine.save_checkpoint(str(self.root), tag=tag, save_latest=False)
            torch.save(rng_state(), folder / f"rank{self.rank:05d}.pt.tmp")
            os.replace(folder / f"rank{self.rank:05d}.pt.tmp", folder / f"rank{self.rank:05d}.pt")
            barrier()
            files = self._hash_files(folder)
            if self.rank == 0:
                meta = {"step": state.step, "position": state.position.state_dict(),
                        "data_seed": state.data_seed, "rollbacks": state.rollbacks,
                        "world_size": dist.get_world_size(), "zero_stage": engine.zero_optimization_stage(),
                        "config": cfg.to_dict(), "files": files}
                text = json.dumps(meta, indent=1, default=list)
                _atomic_write(folder / CHECKPOINT_META, text)
                _atomic_write(folder / COMPLETE_FILE, hashlib.sha256(text.encode()).hexdigest())
        except (OSError, RuntimeError) as err:  # torch's zip writer reports a short write as a RuntimeError
            if (folder / COMPLETE_FILE).exists():
                raise
            mark = peer_gone(err)  # another rank's writing failed first, and its process ended
            if mark:
                failure = f"another rank's process ended: {mark}"
            elif not folder.exists():  # ... and it removed the folder this rank was still writing into
                failure = "another rank's writing failed first and removed the unfinished folder"
            else:
                failure = f"{type(err).__name__}: {error_line(err)}"
        if failure is not None:  # out of the except block: its traceback held the writer's open file
            raise self._failed_save(tag, failure)
        if self.rank == 0:
            _atomic_write(self.root / CHECKPOINT_LATEST, tag)
            self._prune()
        barrier()
        return folder

    def _failed_save(self, tag: str, failure: str) -> SaveError:
        """Remove an unfinished checkpoint folder; the error that says what is left and how to go on."""
        shutil.rmtree(self.root / tag, ignore_errors=True)
        newest = self.newest()
        free = shutil.disk_usage(self.root).free / 2**30
        if newest is None:
            go_on = "no complete checkpoint yet: a new run starts over"
        else:
            go_on = (f"a checkpoint of this run takes {self._bytes(newest) / 2**30:.2f} GiB; --resume auto continues "
                     f"from {newest}")
        return SaveError(f"saving checkpoint {tag} failed ({failure}); its unfinished folder is removed, "
                         f"{self.root} has {free:.2f} GiB free; {go_on}")

    def room_warning(self, each: int) -> str | None:
        """A line when the checkpoints' filesystem has less free space than they will take at their
        peak, less what complete ones here take already: train.keep_last complete ones and the one
        being written (the oldest is deleted after a save completes). `each`: `checkpoint_bytes`."""
        taken = sum(map(self._bytes, self.complete_tags()))
        on_disk = next(p for p in (self.root, *self.root.parents) if p.exists())  # before the first save: its parent
        needed, free = (self.keep_last + 1) * each - taken, shutil.disk_usage(on_disk).free
        if free >= needed:
            return None
        return (f"{self.root} has {free / 2**30:.1f} GiB free; the run's checkpoints need {needed / 2**30:.1f} "
                f"GiB more ({self.keep_last} kept (train.keep_last) + 1 being written, ~{each / 2**30:.2f} GiB "
                f"each): a save that finds the disk full ends the run (the complete checkpoints stay)")

    def _bytes(self, tag: str) -> int:
        """What checkpoint `tag`'s files take."""
        return sum(f.stat().st_size for f in (self.root / tag).iterdir())

    def _mine(self, names: list[str]) -> list[str]:
        """This rank's share of a folder's files (hashing and verifying are spread over the ranks)."""
        return names[self.rank::dist.get_world_size()]

    def _hash_files(self, folder: Path) -> dict:
        """Collective: {file: {bytes, sha256}} of every file in the folder, on rank 0."""
        names = sorted(p.name for p in folder.iterdir() if p.is_file())
        mine = describe_files(folder, self._mine(names))
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        return {name: part[name] for part in parts for name in part}

    def verify(self, tag: str) -> str | None:
        """Collective: None if the checkpoint's files are as written (or it predates hashes), else
        one line naming the first damaged file."""
        problem = checkpoint_problem(self.root / tag, self._mine)
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        return next((p for p in problems if p), None)

    def newest_verified(self) -> tuple[str | None, list[str]]:
        """Collective: (the newest complete checkpoint whose files verify, a line per newer one that
        did not)."""
        return first_intact(self.root, self.verify)

    def set_aside_after(self, tag: str) -> Path | None:
        """Rank 0: move complete checkpoints newer than `tag` (a resume from an older one) into
        checkpoints/abandoned-<time>/, so that `latest` and keep-last see only this timeline."""
        newer = [t for t in self.complete_tags() if t > tag]
        if self.rank != 0 or not newer:
            return None
        target = self.root / f"abandoned-{time.strftime('%Y%m%d-%H%M%S')}"
        target.mkdir()
        for t in newer:
            os.replace(self.root / t, target / t)
        _atomic_write(self.root / CHECKPOINT_LATEST, tag)
        return target

    def _prune(self) -> None:
        complete = self.complete_tags()
        for tag in complete[: max(0, len(complete) - self.keep_last)]:
            shutil.rmtree(self.root / tag, ignore_errors=True)

    def complete_tags(self) -> list[str]:
        return complete_tags(self.root)

    def newest(self) -> str | None:
        return newest_complete(self.root)

    def require_complete(self, tag: str) -> Path:
        return require_complete(self.root, tag)

    def meta(self, tag: str) -> dict:
        return read_meta(self.root, tag)

    def resume_stage(self, tag: str, cfg: Config, dp: int) -> int:
        return resume_stage(self.root, tag, cfg, dp, self.allow_batch_change)

    def load(self, engine, schedule, tag: str, cfg: Config, ctx: ParallelContext) -> TrainState:
        """Collective: restore the engine and the loop state (RNG states included, applied by
        `TrainState.restore_rng` so nothing in between can advance them). A checkpoint of another
        layout is resharded (megamlm.train.elastic); `TrainState.resharded` then says from what."""
        folder = self.require_complete(tag)
        meta = self.meta(tag)
        written = written_layout(meta, written_zero_stage(meta))
        running = Layout.of(cfg, ctx.dp_size, engine.zero_optimization_stage())
        position, note = convert_position(StreamPosition(**meta["position"]), written, running,
                                          self.allow_batch_change, source=str(folder))
        if written.same_shards(running) and running.engine == "deepspeed":
            engine.load_checkpoint(str(self.root), tag=tag, load_optimizer_states=True,
                                   load_lr_scheduler_states=True)
        else:
            names = [name for name, _ in engine.module.named_parameters()]
            load_full_state(engine, schedule, read_full_state(folder, written, names, cfg))
        # the run's AdamW settings (optim.*): DeepSpeed's load puts back the parameter groups as written, which
        # would keep a resumed run's changed betas / eps / weight decay from taking effect
        for group in base_optimizer(engine.optimizer).param_groups:
            group.update(cfg.optim.adamw())
        # per-rank streams (dropout) carry over to the same ranks (also across a ZeRO stage change)
        same_ranks = (written.tp, written.dp) == (running.tp, running.dp)
        rng = torch.load(folder / f"rank{self.rank:05d}.pt", weights_only=False) if same_ranks else \
            reseeded_rng(cfg.train.seed + meta["step"], ctx)
        return TrainState(step=meta["step"], position=position, data_seed=meta["data_seed"],
                          rollbacks=meta["rollbacks"], rng=rng,
                          resharded=None if written.same_shards(running) else f"{written} into {running}",
                          note=note)


def _check_same_model(folder: Path, meta: dict, cfg: Config) -> None:
    differ = [f"{key}: checkpoint {as_yaml(written)} vs run {as_yaml(running)}"
              for key, (running, written) in cfg.model.architecture_differences(meta["config"]["model"]).items()]
    if differ:
        raise RunDirError(f"{folder} holds another model ({'; '.join(differ)}); resume with the run's "
                          f"config (--config {folder.parent.parent / 'config.yaml'}) or start a new run "
                          f"with train.init_from")


def reseeded_rng(seed: int, ctx: ParallelContext) -> dict:
    """The RNG states `seed_everything(seed)` gives, without changing the current ones: per-rank
    streams (dropout) cannot carry over to another set of ranks, so they restart from a seed that
    depends only on the run's seed and update."""
    saved = rng_state()
    seed_everything(seed, ctx)
    fresh = rng_state()
    set_rng_state(saved)
    return fresh


def resume_stage(root: Path, tag: str, cfg: Config, dp: int, allow_batch_change: bool) -> int:
    """The ZeRO stage to resume checkpoint `tag` at: the stage of the engine that wrote it when
    the run keeps its layout and configured stage (e.g. ZeRO-1 at DP=1 from before the stage-0
    rule: DeepSpeed's own loader, bit-exact), else the stage this layout gets (resharded).
    Refuses, before any engine exists (and before the ranks start: train/preflight.py), a checkpoint
    of another model or global batch, or past train.steps."""
    folder, meta = root / tag, read_meta(root, tag)
    _check_same_model(folder, meta, cfg)
    written = written_layout(meta, written_zero_stage(meta))
    stage = cfg.train.engine_zero_stage(dp)
    if ((written.tp, written.dp, written.engine) == (cfg.parallel.tensor_parallel, dp, cfg.train.engine)
            and meta["config"]["train"]["zero_stage"] == cfg.train.zero_stage):
        stage = written.zero_stage
    convert_position(StreamPosition(**meta["position"]), written, Layout.of(cfg, dp, stage),
                     allow_batch_change, source=str(folder))
    if meta["step"] > cfg.train.steps:
        raise ConfigError(f"train.steps={cfg.train.steps} but {tag} is at update {meta['step']}: raise "
                          f"train.steps to continue the run")
    return stage
