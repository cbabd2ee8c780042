"""What a run refuses before any work: a layout its world cannot hold or a global batch it cannot split,
more NCCL processes on a machine than it has GPUs, an objective this machine cannot train, a
train.init_from that is no model folder or of another architecture, a run directory that holds another
run or a user's files, or cannot be written, a checkpoint to resume that is unfinished, damaged (in its
megamlm.json or a file's size: `--resume auto` skips it, as the ranks do), of another model or global
batch, or past train.steps, a tokenizer of another vocabulary size, shards that are neither
built nor buildable, or built with another dictionary or too small for one update. Every rank checks as
it starts (`loop.train`; the shards once they are built, before it builds its model); `megamlm train
--nproc N` (and `--check`) checks all of it once before it starts the ranks (`check_before_launch`), so
a mistake is one line in a second, not one a rank after each imported torch and DeepSpeed (and built its
model, for a checkpoint's or train.init_from's refusal).

The run directory belongs to one run: a new run never starts over an old one (unless asked to move it
aside, or the old one trained nothing there is to keep: `trained_nothing`) and never touches files it did
not write.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path

from megamlm.config import Config, ConfigError, as_yaml, load_config
from megamlm.errors import CorruptFileError
from megamlm.data.shards import planned_build
from megamlm.data.stream import ShardSet
from megamlm.data.tokenizer import Tokenizer
from megamlm.data.updates import UpdateShape
from megamlm.files import RUN_CHECKPOINTS, RUN_FINAL, check_writable
from megamlm.model.folder import run_folder_problem, saved_names, what_it_holds
from megamlm.objectives import Objective, get_objective
from megamlm.parallel import check_gpus, check_world_size, process_backend
from megamlm.train.checkpoint import resume_stage
from megamlm.train.checkpoint_folders import (RunDirError, checkpoint_problem, complete_tags, newest_intact,
                                              require_complete)


def check_before_launch(cfg: Config, processes: int, nodes: int, resume: str | None, overwrite: bool,
                        allow_batch_change: bool) -> str:
    """What each of `processes` ranks on this machine (of `nodes` machines alike) would refuse first (the
    layout, the global batch's split over it, the GPUs, `check_before_work`, `check_run_dir`, a checkpoint
    to resume that is not complete or of another model or global batch, the tokenizer, the shards
    (`check_train_shards`) or what builds them), checked once, by the process that would start them.
    Nothing is written. Returns what the run would do, in a line (`megamlm train --check` prints it)."""
    world = processes * nodes
    check_world_size(cfg.parallel, world)
    tp = cfg.parallel.tensor_parallel
    dp = world // tp
    accumulation = cfg.train.accumulation_steps(dp)
    check_gpus(process_backend(cfg.parallel), processes)
    check_before_work(cfg, get_objective(cfg))
    run_dir = Path(cfg.train.run_dir)
    step = check_run_dir(run_dir, resume, overwrite)
    tag, skipped = resumed_checkpoint(run_dir / RUN_CHECKPOINTS, resume)
    if tag is not None:
        resume_stage(run_dir / RUN_CHECKPOINTS, tag, cfg, dp, allow_batch_change)
    tokenizer = load_tokenizer(cfg)
    build = planned_build(cfg.data)
    if build is None:
        check_train_shards(cfg, tokenizer, dp)
    machines = f" ({nodes} machines x {processes})" if nodes > 1 else ""
    if tag is not None:
        start = f"resumes from {tag}" + "".join(f" ({line})" for line in skipped)
    elif step is not None:  # --overwrite, or a run that trained nothing
        start = f"starts over (its run at update {step} is moved aside)"
    else:
        start = "starts at update 0" + (" (no checkpoint to resume)" if resume == "auto" else "")
    return (f"{world} rank{'s' * (world > 1)}{machines}: tensor parallel {tp} x data parallel {dp}, "
            f"accumulation {accumulation}; train.run_dir={run_dir} {start}; data.shards={cfg.data.shards}"
            + (" (built first from data.build_from)" if build is not None else ""))


def resumed_checkpoint(root: Path, resume: str | None) -> tuple[str | None, list[str]]:
    """The checkpoint the ranks would resume (`newest_intact` for `auto`: a damaged newer one is
    skipped, with a line, as the ranks skip it) and the lines; a named one that is not complete or
    is damaged is refused as the ranks refuse it (train/restart.py: resume_tag)."""
    if resume == "auto":
        return newest_intact(root)
    if resume is not None:
        require_complete(root, resume)
        if (problem := checkpoint_problem(root / resume, hashes=False)) is not None:
            raise CorruptFileError(f"--resume {resume}: {problem}")
    return resume, []


def load_tokenizer(cfg: Config) -> Tokenizer:
    """data.tokenizer; refused when its dictionary is not model.vocab_size symbols."""
    tokenizer = Tokenizer.load(cfg.data.tokenizer, zero_clap=cfg.model.zero_mask)
    if len(tokenizer.dictionary) != cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} differs from the dictionary of data.tokenizer="
            f"{cfg.data.tokenizer} ({len(tokenizer.dictionary)} symbols); set model.vocab_size="
            f"{len(tokenizer.dictionary)}")
    return tokenizer


def check_train_shards(cfg: Config, tokenizer: Tokenizer, dp: int) -> None:
    """What the ranks' train streams would refuse of a finished build before they read a token: shards of
    another dictionary, no train split or no readable shard (`ShardSet`), fewer samples than one update
    takes. The samples are counted where the manifest has them, at the build's seq_length (a packed row
    holds one sample or more, so fewer samples are fewer rows too); at another length each shard's index
    would be read: the ranks count them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a shard left out as damaged: each rank names it
        shards = ShardSet(cfg.data.shards, "train", tokenizer.dictionary.sha256)
    if cfg.data.seq_length == shards.manifest["seq_length"]:
        samples = int(shards.block_counts(cfg.data.seq_length, cfg.data.block_mode).sum())
        UpdateShape.of(cfg, dp).refuse_unfilled(shards.folder, samples, samples)


def check_before_work(cfg: Config, objective: Objective) -> None:
    """What would otherwise fail minutes in (or with a confusing message): one line now."""
    if (problem := objective.unsupported_here()) is not None:
        raise ConfigError(problem)
    if cfg.train.init_from:
        folder = Path(cfg.train.init_from)
        if not (folder / "config.yaml").is_file():
            raise ConfigError(f"train.init_from={folder}: not a model folder (no config.yaml)" + what_it_holds(folder))
        if (problem := run_folder_problem(folder)) is not None:
            raise ConfigError(f"train.init_from={folder}: {problem}")
        check_same_architecture(cfg, objective, folder, load_config([folder / "config.yaml"]), saved_names(folder))


def check_same_architecture(cfg: Config, objective: Objective, folder: Path, source: Config, saved: set[str]) -> None:
    """train.init_from: the folder's model (config `source`, parameters `saved`) is the run's."""
    differ = [f"{key}: run {as_yaml(running)} vs {as_yaml(theirs)}"
              for key, (running, theirs) in cfg.model.architecture_differences(vars(source.model)).items()]
    differ += objective.architecture_differences(source, saved)
    if differ:
        raise ConfigError(f"train.init_from={folder} holds a different architecture: {'; '.join(differ)} "
                          f"(start from its config.yaml: --config {folder}/config.yaml)")


def run_at(run_dir: Path) -> int | None:
    """The update a run directory's run has reached (newest complete checkpoint, else its log), or
    None when it holds no run."""
    tags = complete_tags(run_dir / RUN_CHECKPOINTS)
    if tags:
        return int(tags[-1].removeprefix("step"))
    log = run_dir / "log.jsonl"
    if not log.is_file():
        return None
    steps = [0]
    for line in log.read_text(errors="replace").splitlines():
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return max(steps)


RUN_FILES = ("log.jsonl", "config.yaml", RUN_CHECKPOINTS, "tensorboard", RUN_FINAL)
"""What training writes into train.run_dir."""


def trained_nothing(run_dir: Path, step: int) -> bool:
    """A run at `step` (`run_at`) left nothing to continue or keep: no update logged, no checkpoint, no
    final model (stopped or crashed in its setup or first updates: a Ctrl-C after its first lines, an
    out-of-memory first update). A plain rerun starts it over; its files are moved aside as --overwrite moves
    a run's."""
    return step == 0 and not complete_tags(run_dir / RUN_CHECKPOINTS) and not (run_dir / RUN_FINAL).exists()


def check_run_dir(run_dir: Path, resume: str | None, overwrite: bool) -> int | None:
    """Refuse a run dir that holds another run (unless `overwrite`, or it `trained_nothing`) or a user's
    files where training would write, or that cannot be written; the update its run has reached (None: no
    run there)."""
    if resume is not None and overwrite:
        raise RunDirError("--resume and --overwrite exclude each other")
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"train.run_dir={run_dir} is a file, not a folder")
    step = run_at(run_dir)
    if step is not None and resume is None:
        if not overwrite and not trained_nothing(run_dir, step):
            raise RunDirError(f"train.run_dir={run_dir} holds a run at update {step}; pass --resume auto "
                              f"to continue it, --overwrite to start over (the old run is moved aside), "
                              f"or choose another train.run_dir")
        return step  # its folder is checked once the old run is moved aside
    if step is None:
        users = [name for name in RUN_FILES if (run_dir / name).exists()]
        if users:
            raise RunDirError(f"train.run_dir={run_dir} holds {', '.join(users)} but no megamlm run "
                              f"(no log.jsonl): megamlm would write there; choose another train.run_dir")
    _check_writable_run_dir(run_dir)
    return step


def _check_writable_run_dir(run_dir: Path) -> None:
    check_writable(run_dir, "train.run_dir")
    if (run_dir / RUN_CHECKPOINTS).is_dir():
        check_writable(run_dir / RUN_CHECKPOINTS, "checkpoint folder")


def prepare_run_dir(run_dir: Path, resume: str | None, overwrite: bool, rank: int) -> str | None:
    """Before any work: `check_run_dir`; with `overwrite` (or a run that `trained_nothing`), rank 0 moves
    the run that is there aside, returning the log's line that says where."""
    step = check_run_dir(run_dir, resume, overwrite)
    if step is None or resume is not None:
        return None
    why = "--overwrite" if overwrite else "it trained nothing to continue (no update logged, no checkpoint)"
    line = None
    if rank == 0:
        moved = run_dir.with_name(f"{run_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(run_dir, moved)
        line = f"{why}: the run that was in {run_dir} is now {moved}"
    _check_writable_run_dir(run_dir)
    return line
