"""fp16's dynamic loss scale, kept on the device (the flat engine's; DeepSpeed keeps its own on the host).

The rule is DeepSpeed's `DynamicLossScaler` with megamlm's settings (`FP16_LOSS_SCALING`, which
`train/engine.py` also hands DeepSpeed), so both engines scale alike:
- an update with an inf/NaN gradient is skipped; it halves the scale (not below the minimum) once the
  hysteresis is used up, and otherwise uses up one unit of hysteresis;
- after `loss_scale_window` clean updates since the last overflow, the scale doubles and the
  hysteresis is restored.
Each update's rule is a handful of `torch.where`s on 0-dim tensors: no host read.

An overflow that would halve a scale already at the minimum means the gradients overflow at any
scale: DeepSpeed stops the run there ("Current loss scale already at minimum"). Here `floor_overflow`
flags that update on the device, the flat engine brings the flag to the host with the skip flag, and
the loop rolls back to the last checkpoint as it does for a non-finite loss (or stops, saying why).
"""

from __future__ import annotations

import torch

FP16_LOSS_SCALING = {"initial_scale_power": 7, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1e-4}
"""Dynamic loss scaling as fairseq: start at 2^7, halve on overflow (after one unit of hysteresis),
double after 1,000 clean updates. DeepSpeed's fp16 section takes these names."""


class DynamicLossScale:
    """`scale` (a 0-dim fp32 device tensor) multiplies the loss before the backward; `update(found_inf)`
    applies the rule after each update's step."""

    def __init__(self, device: torch.device, initial_scale_power: int, loss_scale_window: int, hysteresis: int,
                 min_loss_scale: float):
        self.window, self.hysteresis_max, self.min_scale = loss_scale_window, hysteresis, min_loss_scale
        self.scale = torch.tensor(2.0 ** initial_scale_power, device=device)
        self.hysteresis = torch.tensor(float(hysteresis), device=device)
        self.iteration = torch.zeros((), dtype=torch.int64, device=device)
        self.last_overflow = torch.full((), -1, dtype=torch.int64, device=device)
        self.floor_overflow = torch.zeros((), device=device)
        """1 if the last update overflowed with the scale at the minimum and no hysteresis left (where
        DeepSpeed raises), else 0."""

    @classmethod
    def from_settings(cls, device: torch.device) -> DynamicLossScale:
        return cls(device, **FP16_LOSS_SCALING)

    def update(self, found_inf: torch.Tensor) -> None:
        """found_inf: 0-dim, 1 if this update's gradients held an inf/NaN (it was skipped)."""
        overflow = found_inf > 0
        shrink = overflow & (self.hysteresis <= 1)
        self.floor_overflow = (shrink & (self.scale <= self.min_scale)).float()
        stable = self.iteration - self.last_overflow - 1
        grow = ~overflow & (stable > 0) & (stable % self.window == 0)
        self.scale = torch.where(shrink, (self.scale / 2).clamp(min=self.min_scale),
                                 torch.where(grow, self.scale * 2, self.scale))
        self.hysteresis = torch.where(overflow & ~shrink, self.hysteresis - 1,
                                      torch.where(grow, torch.full_like(self.hysteresis, self.hysteresis_max),
                                                  self.hysteresis))
        self.last_overflow = torch.where(overflow, self.iteration, self.last_overflow)
        self.iteration = self.iteration + 1

    def state_dict(self) -> dict:
        """DeepSpeed's names for the same state (host values: read at a checkpoint)."""
        return {"cur_scale": self.scale.item(), "cur_hysteresis": int(self.hysteresis.item()),
                "cur_iter": int(self.iteration.item()), "last_overflow_iter": int(self.last_overflow.item())}

    def load_state_dict(self, state: dict) -> None:
        for tensor, key in ((self.scale, "cur_scale"), (self.hysteresis, "cur_hysteresis"),
                            (self.iteration, "cur_iter"), (self.last_overflow, "last_overflow_iter")):
            tensor.fill_(state[key])
