"""Learning-rate schedules with fairseq's semantics, as a scheduler DeepSpeed steps and checkpoints.

cosine (fairseq cosine_lr_scheduler, t_mult 1, lr_shrink 1):
    t <  warmup:  lr = min + (max - min) · t / warmup              (warm-up from min_lr)
    t >= warmup:  lr = min + ½(max - min)(1 + cos(π (t - warmup) / period))
  The reference set the period longer than the run (146390 vs 133082 updates), so the run ends
  before the floor; period defaults to 1.1 × steps here.
polynomial (fairseq polynomial_decay, fine-tuning): warm-up from 0, then
    lr = end + (max - end) · (1 - (t - warmup) / (total - warmup))^power
warmup_times_polynomial (TF BERT/ELECTRA's create_optimizer): the decay counted from update 0, times
the warm-up ramp:
    lr = (end + (max - end) · (1 - t / total)^power) · min(1, t / warmup)
constant: warm-up from 0, then max.
"""

from __future__ import annotations

import math

from megamlm.config import OptimConfig


def lr_at(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Learning rate of update number `step` (0-based: the first update uses lr_at(0))."""
    peak, warmup = optim.lr, optim.warmup_steps
    if optim.schedule == "cosine":
        if step < warmup:
            return optim.min_lr + (peak - optim.min_lr) * step / warmup
        period = optim.period_steps or round(1.1 * total_steps)
        progress = ((step - warmup) % period) / period
        return optim.min_lr + 0.5 * (peak - optim.min_lr) * (1 + math.cos(math.pi * progress))
    if optim.schedule == "warmup_times_polynomial":
        fraction = min(step, total_steps) / max(total_steps, 1)
        ramp = min(1.0, step / warmup) if warmup else 1.0
        return (optim.end_lr + (peak - optim.end_lr) * (1 - fraction) ** optim.power) * ramp
    if step < warmup:
        return peak * step / warmup
    if optim.schedule == "constant":
        return peak
    remaining = max(total_steps - warmup, 1)
    fraction = min(step - warmup, remaining) / remaining
    return optim.end_lr + (peak - optim.end_lr) * (1 - fraction) ** optim.power


class Schedule:
    """Sets the optimizer's learning rate before each update; DeepSpeed calls step() after it and
    saves state_dict() in its checkpoints."""

    def __init__(self, optimizer, optim: OptimConfig, total_steps: int):
        self.optimizer, self.optim, self.total_steps = optimizer, optim, total_steps
        self.step_count = 0
        self._apply()

    def _apply(self) -> None:
        lr = lr_at(self.step_count, self.optim, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def step_back(self) -> None:
        """Undo the last step(): the update it followed was skipped (train/flat.py learns that one
        update late), and a skipped update does not advance the schedule."""
        self.step_count -= 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = state["step_count"]
        self._apply()
