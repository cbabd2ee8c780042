"""Where a run continues from: the checkpoint `--resume` names, and the rollback after a loss spike."""

from __future__ import annotations

import dataclasses
import math

from megamlm.config import Config, ConfigError, as_yaml
from megamlm.errors import CorruptFileError
from megamlm.parallel import ParallelContext
from megamlm.train.checkpoint import Checkpoints, TrainState
from megamlm.train.guard import TrainingDiverged
from megamlm.train.log import Log
from megamlm.train.schedule import lr_at


def resume_tag(checkpoints: Checkpoints, resume: str, log: Log) -> str | None:
    """The checkpoint `resume` names (a tag, or `auto`: the newest whose files verify); None when
    `auto` finds none."""
    if resume == "auto":
        tag, skipped = checkpoints.newest_verified()
        for line in skipped:
            log.event("warning", 0, f"warning: {line}; resuming from the previous one", message=line)
        if tag is None:
            log.drop_after(0)
        return tag
    checkpoints.require_complete(resume)
    problem = checkpoints.verify(resume)
    if problem is not None:
        raise CorruptFileError(f"--resume {resume}: {problem}")
    return resume


CHANGE_NOTES = {
    "train.seed": "the training data order continues the checkpoint's, dropout too on the same layout; validation "
                  "draws new masks, so valid losses before and after the resume differ, and a rollback's data order "
                  "uses the new seed",
}
"""What a config change on resume does that its new value alone does not say."""


def _learning_rate_change(cfg: Config, before: dict, step: int) -> str:
    """"; the next update's learning rate A -> B" where the changes move it (train.steps moves wsd's decay and
    cosine's default period, an optim key the schedule itself); "" where it stays, or the checkpoint's optim
    section is not one this version reads."""
    keys = {field.name for field in dataclasses.fields(cfg.optim)}
    try:
        then_optim = dataclasses.replace(cfg.optim, **{key: value for key, value in before.get("optim", {}).items()
                                                       if key in keys})
        then = lr_at(step, then_optim, before["train"]["steps"])
    except (ConfigError, TypeError, KeyError):
        return ""
    now = lr_at(step, cfg.optim, cfg.train.steps)
    return "" if math.isclose(then, now, rel_tol=1e-9) else f"; the next update's learning rate {then:.3g} -> {now:.3g}"


def load_resumed(cfg: Config, ctx: ParallelContext, checkpoints: Checkpoints, engine, schedule, tag: str,
                 log: Log) -> TrainState:
    """Load checkpoint `tag` (checked by `Checkpoints.resume_stage`); checkpoints newer than it are set aside,
    log lines after it dropped."""
    state = checkpoints.load(engine, schedule, tag, cfg, ctx)
    moved = checkpoints.set_aside_after(tag)
    log.drop_after(state.step)
    if moved is not None:
        log.event("warning", state.step, f"warning: checkpoints newer than {tag} moved to {moved}",
                  message=f"checkpoints newer than {tag} moved to {moved}")
    where = f"resumed update {state.step} written at {state.resharded}" if state.resharded else \
        f"resumed from {checkpoints.root / tag} at update {state.step}"
    where += f"; {state.note}" if state.note else ""
    before = checkpoints.meta(tag)["config"]
    changed = cfg.changes_since(before)
    if changed:  # nothing changes silently: the run's config.yaml is rewritten with the new values
        where += "; changed since the checkpoint: " + ", ".join(
            f"{key} {as_yaml(then)} -> {as_yaml(now)}" + (f" ({CHANGE_NOTES[key]})" if key in CHANGE_NOTES else "")
            for key, (then, now) in changed.items()) + _learning_rate_change(cfg, before, state.step)
    log.event("resume", state.step, where, message=where, resharded=state.resharded,
              changed={key: list(values) for key, values in changed.items()})
    return state


def roll_back(cfg: Config, ctx: ParallelContext, engine, schedule, checkpoints: Checkpoints,
              state: TrainState, step: int, log: Log, reason: str) -> TrainState:
    """Update `step` failed the spike guard: reload the last good checkpoint, change the data seed,
    continue (or give up). Returns the restored state."""
    rollbacks = state.rollbacks + 1
    tag, skipped = checkpoints.newest_verified()
    for line in skipped:
        log.event("warning", step, f"warning: {line}; rolling back to an older one", message=line)
    if rollbacks > cfg.train.max_rollbacks or tag is None:
        why = ("no checkpoint to roll back to (lower train.save_interval)" if tag is None
               else f"gave up after {cfg.train.max_rollbacks} rollbacks (train.max_rollbacks)")
        log.event("abort", step, f"update {step}: {reason}; {why}")
        raise TrainingDiverged(f"training diverged at update {step}: {reason}; {why}")
    restored = checkpoints.load(engine, schedule, tag, cfg, ctx)
    restored.rollbacks = rollbacks
    restored.data_seed = cfg.train.seed + 1000 * rollbacks
    log.event("rollback", step,
              f"update {step}: {reason} -> rolled back to {tag} with data seed "
              f"{restored.data_seed} (rollback {rollbacks}/{cfg.train.max_rollbacks})",
              rollbacks=rollbacks)
    return restored
