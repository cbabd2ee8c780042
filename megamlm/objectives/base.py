"""What a pretraining objective is, and the registry that names them (torchtitan's TrainSpec).

An objective owns its model's heads (a module built on the Encoder), how samples are corrupted and
what the targets are, forward + loss, its FLOPs per token and its validation metric. The training
loop, validation, `megamlm eval`, `megamlm plan`, model folders and conversion get it by name:

    objective = get_objective(cfg)                  # cfg.objective.name, default "mlm"
    model = objective.build_model(ctx)
    stream = MaskedBatches(shards, objective.corruption(tokenizer, seed), ...)
    out = objective.loss(model, batch)               # LossOutput(loss_sum, count, metrics)

Adding one = a module with a subclass decorated by `@register_objective` + a config + its tests
(README, "Extending megamlm").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, NamedTuple

import torch
from torch import nn

from megamlm.config import Config, ConfigError
from megamlm.data.batch import Batch, Corruption
from megamlm.data.tokenizer import Tokenizer
from megamlm.parallel import ParallelContext


class LossOutput(NamedTuple):
    """One micro-batch's loss as fairseq weighs it: Σ over the update / Σ count over the update."""

    loss_sum: torch.Tensor
    """Summed loss (nats) over the batch's `count` terms; differentiable, float32 or wider."""
    count: int
    """Loss terms (e.g. masked tokens), known from the batch before the forward (objective.count)."""
    metrics: dict[str, torch.Tensor]
    """Further sums over the same terms (e.g. correct predictions); logged divided by the count."""


class Objective(ABC):
    """Base of every objective; `cfg` is the whole experiment."""

    name: ClassVar[str]
    metric: ClassVar[str] = "ppl"
    """The validation metric `summary` adds next to the loss (lower is better)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def unsupported_here(self) -> str | None:
        """Why this machine or config cannot train the objective (checked before any work), or None."""
        return None

    @abstractmethod
    def build_model(self, ctx: ParallelContext, params_dtype: torch.dtype = torch.float32) -> nn.Module:
        """The trainable module (an Encoder with this objective's heads), seeded by train.seed."""

    @abstractmethod
    def corruption(self, tokenizer: Tokenizer, seed: int) -> Corruption:
        """How a sample is corrupted and which positions are targets, seeded by (seed, epoch, sample);
        `tokenizer` gives the dictionary's ids (mask, ordinary) and word starts."""

    def count(self, batch: Batch) -> int:
        """Loss terms of the batch (the update's loss is their sum / their number)."""
        return int(batch.target_index.numel())

    @abstractmethod
    def loss(self, model, batch: Batch) -> LossOutput:
        """Forward + loss on a batch already on the device. `model` is what build_model returned, or
        the DeepSpeed engine wrapping it (call it for the forward; `.module` is the model)."""

    @abstractmethod
    def flops_per_token(self, seq_length: int) -> float:
        """Model FLOPs per token of a training update (forward + backward), for MFU and plans."""

    @abstractmethod
    def summary(self, loss: float) -> dict[str, float]:
        """Metrics derived from the mean loss (validation, logs): {metric: value}."""

    def log_values(self, model: nn.Module) -> dict[str, float]:
        """Scalars of the model worth a column in the training log (e.g. CLAP's beta)."""
        return {}


OBJECTIVES: dict[str, type[Objective]] = {}
"""objective.name -> class; filled by @register_objective."""


def register_objective(cls: type[Objective]) -> type[Objective]:
    if cls.name in OBJECTIVES and OBJECTIVES[cls.name] is not cls:
        raise ValueError(f"objective {cls.name!r} is registered twice")
    OBJECTIVES[cls.name] = cls
    return cls


def get_objective(cfg: Config) -> Objective:
    try:
        cls = OBJECTIVES[cfg.objective.name]
    except KeyError:
        raise ConfigError(f"objective.name={cfg.objective.name!r} is not an objective; "
                          f"allowed: {' | '.join(sorted(OBJECTIVES))}") from None
    return cls(cfg)
