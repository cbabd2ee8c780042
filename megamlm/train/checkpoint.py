"""Checkpoints that survive preemption: DeepSpeed shards + our per-rank state, an atomic `latest`.

Layout under <run_dir>/checkpoints/:
  step00000500/                    DeepSpeed's files (model, optimizer/ZeRO shards, schedule)
  step00000500/rank00000.pt        this rank's RNG states (CPU, CUDA, tensor-parallel stream)
  step00000500/megamlm.json        step, data position, data seed, rollbacks, config
  step00000500/complete            written by rank 0 after every rank finished writing
  latest                           name of the newest complete checkpoint, replaced atomically

A checkpoint without `complete` (interrupted while writing) is never chosen by resume.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megamlm.config import Config
from megamlm.data.stream import StreamPosition
from megamlm.parallel import tensor_parallel_rng


@dataclass
class TrainState:
    """What the loop needs besides the engine to continue exactly where it stopped."""

    step: int = 0
    position: StreamPosition = field(default_factory=StreamPosition)
    data_seed: int = 1
    rollbacks: int = 0
    rng: dict | None = None
    """RNG states read from a checkpoint; the loop applies them right before its next update."""

    def restore_rng(self) -> None:
        if self.rng is not None:
            set_rng_state(self.rng)
            self.rng = None


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
    def __init__(self, run_dir: str | Path, keep_last: int):
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last
        self.rank = dist.get_rank()
        self.root.mkdir(parents=True, exist_ok=True)

    def save(self, engine, state: TrainState, cfg: Config) -> Path:
        """Collective: every rank calls it."""
        tag = f"step{state.step:08d}"
        folder = self.root / tag
        if self.rank == 0 and folder.exists():  # a leftover of an interrupted save of this step
            shutil.rmtree(folder)
        dist.barrier()
        engine.save_checkpoint(str(self.root), tag=tag, save_latest=False)
        torch.save(rng_state(), folder / f"rank{self.rank:05d}.pt.tmp")
        os.replace(folder / f"rank{self.rank:05d}.pt.tmp", folder / f"rank{self.rank:05d}.pt")
        dist.barrier()
        if self.rank == 0:
            meta = {"step": state.step, "position": state.position.state_dict(),
                    "data_seed": state.data_seed, "rollbacks": state.rollbacks,
                    "world_size": dist.get_world_size(), "config": cfg.to_dict()}
            _atomic_write(folder / "megamlm.json", json.dumps(meta, indent=1, default=list))
            _atomic_write(folder / "complete", "")
            _atomic_write(self.root / "latest", tag)
            self._prune()
        dist.barrier()
        return folder

    def _prune(self) -> None:
        complete = self.complete_tags()
        for tag in complete[: max(0, len(complete) - self.keep_last)]:
            shutil.rmtree(self.root / tag, ignore_errors=True)

    def complete_tags(self) -> list[str]:
        return sorted(p.name for p in self.root.glob("step*") if (p / "complete").exists())

    def newest(self) -> str | None:
        """The `latest` checkpoint if complete, else the newest complete one, else None."""
        pointer = self.root / "latest"
        if pointer.exists():
            tag = pointer.read_text().strip()
            if (self.root / tag / "complete").exists():
                return tag
        complete = self.complete_tags()
        return complete[-1] if complete else None

    def load(self, engine, tag: str) -> TrainState:
        """Collective: restore the engine and the loop state (RNG states included, applied by
        `TrainState.restore_rng` so nothing in between can advance them)."""
        folder = self.root / tag
        if not (folder / "complete").exists():
            raise FileNotFoundError(f"{folder} is not a complete checkpoint")
        meta = json.loads((folder / "megamlm.json").read_text())
        if meta["world_size"] != dist.get_world_size():
            raise ValueError(f"{folder} was written by {meta['world_size']} processes, this run has "
                             f"{dist.get_world_size()}; resume with the same layout")
        engine.load_checkpoint(str(self.root), tag=tag, load_optimizer_states=True,
                               load_lr_scheduler_states=True)
        return TrainState(step=meta["step"], position=StreamPosition(**meta["position"]),
                          data_seed=meta["data_seed"], rollbacks=meta["rollbacks"],
                          rng=torch.load(folder / f"rank{self.rank:05d}.pt", weights_only=False))

