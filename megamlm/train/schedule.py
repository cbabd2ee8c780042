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
wsd (warmup-stable-decay; transformers' get_wsd_schedule with min_lr_ratio = min / max): warm-up from
min_lr as cosine's, max until the last D = decay_steps updates of the run, then with p = (t - (total - D)) / D
    lr = min + (max - min) · f(p),  f = 1 - sqrt(p) | 1 - p | ½(1 + cos(π p))   (decay_shape)
  and min from update `total` on.
"""

from __future__ import annotations

import math

from megamlm.config import OptimConfig


WSD_DECAY_SHAPES = {"1-sqrt": lambda p: 1 - math.sqrt(p), "linear": lambda p: 1 - p,
                    "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p))}
"""optim.decay_shape -> the fraction of (max - min) left at the decay's progress p in [0, 1]."""


def lr_at(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Learning rate of update number `step` (0-based: the first update uses lr_at(0))."""
    peak, warmup = optim.lr, optim.warmup_steps
    if optim.schedule in ("cosine", "wsd") and step < warmup:
        return optim.min_lr + (peak - optim.min_lr) * step / warmup
    if optim.schedule == "cosine":
        period = optim.period_steps or round(1.1 * total_steps)
        progress = ((step - warmup) % period) / period
        return optim.min_lr + 0.5 * (peak - optim.min_lr) * (1 + math.cos(math.pi * progress))
    if optim.schedule == "wsd":
        decay = optim.wsd_decay_steps(total_steps)
        if step < total_steps - decay:
            return peak  # stable: exactly the peak, as transformers' factor 1.0
        progress = min(step - (total_steps - decay), decay) / decay
        return optim.min_lr + (peak - optim.min_lr) * WSD_DECAY_SHAPES[optim.decay_shape](progress)
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
