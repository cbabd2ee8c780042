"""The run's log: a human line per event on stdout, JSON lines in <run_dir>/log.jsonl, TensorBoard
scalars (rank 0 writes; other ranks' calls do nothing)."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from megamlm.console import print_line


class Log:
    """Human lines on stdout and JSON lines in run_dir/log.jsonl (rank 0), TensorBoard scalars.

    The files are created with the first event: a run that fails before it (a missing input, a bad
    train.init_from) leaves no run behind, and the same command runs again once the input is fixed, without
    --resume or --overwrite."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.enabled, self.path = enabled, run_dir / "log.jsonl"
        self.jsonl = self.tb = None

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.path, "a")
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(self.path.parent / "tensorboard"))

    def event(self, kind: str, step: int, text: str | None = None, **values) -> None:
        if not self.enabled:
            return
        if self.jsonl is None:
            self._open()
        self.jsonl.write(json.dumps({"event": kind, "step": step, "time": time.time(), **values}) + "\n")
        self.jsonl.flush()
        for key, value in values.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.tb.add_scalar(f"{kind}/{key}", value, step)
        if text:
            print_line(text)

    def drop_after(self, step: int) -> None:
        """After a resume from `step`: drop the lines of updates after it (they are redone), so that
        log.jsonl holds each update once."""
        if not self.enabled or not self.path.is_file():
            return
        was_open = self.jsonl is not None
        if was_open:
            self.jsonl.close()
        kept = [line for line in self.path.read_text().splitlines(keepends=True)
                if _step_of(line) is None or _step_of(line) <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.path)
        if was_open:
            self.jsonl = open(self.path, "a")

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.tb.close()


@dataclass
class LogWindow:
    """The updates the next train line reports on: those since the last line or rollback (the rollback's
    discarded updates are not), their real tokens, the token slots they filled and the time they waited for
    data, over the time they took: evaluations and checkpoints between them are `paused()` out, as
    Megatron stops its interval timer."""

    start: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    slots: int = 0
    data_wait: float = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @contextmanager
    def paused(self) -> Iterator[None]:
        pause_start = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - pause_start


def train_line(step: int, steps: int, metric: str, values: dict, extra: dict, eta: str) -> str:
    """The human line of a `train` event (`values`: its JSON fields; `extra`: the objective's own)."""
    return (f"update {step}/{steps} | loss {values['loss']:.4f} | {metric} "
            f"{values[metric]:.1f} | lr {values['lr']:.2e} | grad norm {values['grad_norm']:.3f}"
            + "".join(f" | {name} {value:.3f}" for name, value in extra.items())
            + f" | {values['tokens_per_s']:,.0f} tok/s | MFU "
            + (f"{100 * values['mfu']:.2f}%" if values["mfu"] is not None else "n/a")
            + f" | fill {100 * values['fill']:.1f}% | data wait {100 * values['data_wait']:.1f}%"
            + (f" | corrupt samples skipped {values['corrupt_samples']}" if values["corrupt_samples"] else "")
            + (f" | updates skipped {values['skipped_updates']}" if values["skipped_updates"] else "")
            + f" | ETA {eta}")


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None
