"""What a pretraining objective is, and the registry that names them (torchtitan's TrainSpec).

An objective owns its model's heads (a module built on the Encoder), how samples are corrupted and
what the targets are, forward + loss, its FLOPs per token and its validation metric. The training
loop, validation, `megamlm eval`, `megamlm plan`, model folders and conversion get it by name:

    objective = get_objective(cfg)                  # cfg.objective.name, default "mlm"
    model = objective.build_model(ctx)
    stream = MaskedBatches(shards, objective.corruption(tokenizer, seed), ...)
    out = objective.loss(model, batch)               # LossOutput(loss_sum [k], count [k], metrics)

An objective's loss is a sum of k terms, each a mean over its own units (MLM: one term over the masked
tokens; ELECTRA: the generator's over the masked tokens + λ · the discriminator's over every real
token). Each term is summed over the whole update (all ranks and micro-batches) and divided by its
number of units there, so the result does not depend on how the global batch is split.

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
from megamlm.data.pairs import Pairing
from megamlm.data.tokenizer import Tokenizer
from megamlm.errors import did_you_mean
from megamlm.parallel import ParallelContext, ToHost


class LossOutput(NamedTuple):
    """One micro-batch's loss as fairseq weighs it: per term, Σ over the update / Σ count over the update."""

    loss_sum: torch.Tensor
    """[k] summed loss (nats, coefficient included) of each term (Objective.loss_terms) over the
    batch's units of that term; differentiable, float32 or wider."""
    count: list[int]
    """[k] units of each term (e.g. masked tokens), known from the batch before the forward
    (objective.count)."""
    metrics: dict[str, torch.Tensor]
    """Further sums over the batch (e.g. correct predictions), any shape; the objective's
    `finish_metrics` turns the update's sums into logged values."""

    def mean(self) -> torch.Tensor:
        """This batch's loss on its own: Σ_k loss_sum_k / count_k."""
        counts = torch.tensor(self.count, dtype=self.loss_sum.dtype, device=self.loss_sum.device)
        return (self.loss_sum / counts.clamp(min=1)).sum()


class Objective(ABC):
    """Base of every objective; `cfg` is the whole experiment."""

    name: ClassVar[str]
    metric: ClassVar[str] = "ppl"
    """The validation metric `summary` adds next to the loss (lower is better)."""
    loss_terms: ClassVar[tuple[str, ...]] = ("mlm",)
    """Names of the loss's terms, in LossOutput order; the loss is their sum."""
    conversion_targets: ClassVar[tuple[str, ...]] = ()
    """The formats `megamlm convert` writes this objective's model to (checked by `probe` on a probe batch)."""
    masked_lm_inside: ClassVar[bool] = False
    """The model is mlm's MaskedLM plus the heads `fresh_head` names (NSP, SOP): conversion takes the
    MaskedLM."""

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

    def pairing(self, seed: int) -> Pairing | None:
        """How samples become sentence pairs before corruption (NSP, SOP), or None (they stay as read)."""
        return None

    def count(self, batch: Batch) -> list[int]:
        """Units of each loss term in the batch, from the batch alone (no forward): by default the
        prediction targets of the one term."""
        return [int(batch.target_index.numel())]

    @abstractmethod
    def loss(self, model, batch: Batch) -> LossOutput:
        """Forward + loss on a batch already on the device. `model` is what build_model returned, or
        the DeepSpeed engine wrapping it (call it for the forward; `.module` is the model)."""

    @abstractmethod
    def parameter_count(self) -> int:
        """Parameters of build_model's model from the config alone (`megamlm plan`), vocabulary
        padding excluded."""

    @abstractmethod
    def flops_per_token(self, seq_length: int) -> float:
        """Model FLOPs per token of a training update (forward + backward), for MFU and plans."""

    @abstractmethod
    def summary(self, terms: dict[str, float]) -> dict[str, float]:
        """Metrics derived from the mean loss of each term (validation, logs): {metric: value, ...}."""

    def finish_metrics(self, sums: dict[str, torch.Tensor], counts: list[float]) -> dict[str, float]:
        """Logged values from the metric sums over an update or a validation (all ranks) and the
        units of each loss term there; by default each sum per unit of the first term."""
        return {name: float(value) / max(counts[0], 1.0) for name, value in sums.items()}

    def log_values(self, model: nn.Module) -> dict[str, float]:
        """Scalars of the model worth a column in the training log (e.g. CLAP's beta)."""
        return {}

    def fresh_head(self, name: str) -> bool:
        """Whether parameter `name` is a head of this objective that a folder written by another
        objective lacks (train.init_from starts it from its initialization)."""
        return False

    def probe(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """What conversions compare on a probe batch tokens [b, s]: [b, s, ...] from the model in eval
        mode (the masked-LM objectives: the logits at every position)."""
        return model(tokens)

    def architecture_differences(self, source: Config, saved: set[str]) -> list[str]:
        """Why a folder written with config `source`, holding the parameters `saved`, cannot start this run's
        model beyond model.* (train.init_from checks those): `key: run X vs Y` per setting; none by default."""
        return []

    def heads_from_folder(self, heads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This objective's head parameters among a folder's classification heads (train.init_from
        starts them from there): none by default."""
        return {}

    def exported(self, name: str) -> bool:
        """Whether parameter `name` goes into exported model folders (<run_dir>/final); checkpoints
        keep everything."""
        return True

    def build_pretrained(self, ctx: ParallelContext, saved: set[str]) -> nn.Module:
        """The model for a folder holding the parameters `saved` (an export may leave a part out)."""
        return self.build_model(ctx)


OBJECTIVES: dict[str, type[Objective]] = {}
"""objective.name -> class; filled by @register_objective."""


def register_objective(cls: type[Objective]) -> type[Objective]:
    if cls.name in OBJECTIVES and OBJECTIVES[cls.name] is not cls:
        raise ValueError(f"objective {cls.name!r} is registered twice")
    OBJECTIVES[cls.name] = cls
    return cls


def objective_class(cfg: Config) -> type[Objective]:
    """The class objective.name registers (its facts, without checking the config as building does)."""
    try:
        return OBJECTIVES[cfg.objective.name]
    except KeyError:
        raise ConfigError(f"objective.name={cfg.objective.name!r} is not an objective; "
                          f"allowed: {' | '.join(sorted(OBJECTIVES))}"
                          f"{did_you_mean(cfg.objective.name, OBJECTIVES)}") from None


def get_objective(cfg: Config) -> Objective:
    return objective_class(cfg)(cfg)


class LossTotals:
    """Adds up LossOutputs over micro-batches (on the device, no host sync) and over a process group
    in one all-reduce: what an update's log line and a validation report."""

    def __init__(self, objective: Objective, counts: torch.Tensor | None = None):
        """`counts`: [k] units of each term, when already known for every rank (training counts them
        before the forward); None: summed from the outputs and reduced with the rest."""
        self.objective = objective
        self.known_counts = counts
        self.loss: torch.Tensor | None = None
        self.counts = torch.zeros(len(objective.loss_terms), dtype=torch.float64)
        self.metrics: dict[str, torch.Tensor] = {}

    def add(self, out: LossOutput) -> None:
        loss = out.loss_sum.detach().double().reshape(-1)
        self.loss = loss if self.loss is None else self.loss + loss
        self.counts += torch.tensor(out.count, dtype=torch.float64)
        for name, value in out.metrics.items():
            value = value.detach().double()
            self.metrics[name] = value if name not in self.metrics else self.metrics[name] + value

    def reduce(self, group=None) -> dict[str, float]:
        """{"loss": Σ terms, "<term>_loss" (k > 1), the objective's summary and finished metrics,
        "units": units of the first term}; one all-reduce over `group` (None: this process only)."""
        return self.start_reduce(group).result()

    def start_reduce(self, group=None) -> ReducedTotals:
        """`reduce`, queued: the all-reduce and the copy to the host start, nothing waits for the device
        until `result()`."""
        device = self.loss.device
        parts = [self.loss, *(m.reshape(-1) for m in self.metrics.values())]
        if self.known_counts is None:
            parts.append(self.counts.to(device))
        flat = torch.cat(parts)
        if group is not None and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flat, group=group)
        if self.known_counts is not None:  # reduced already: on the host with the rest, in one copy
            flat = torch.cat([flat, self.known_counts.to(device, torch.float64)])
        return ReducedTotals(self.objective, {name: m.shape for name, m in self.metrics.items()}, ToHost(flat))


class ReducedTotals:
    """An update's LossTotals reduced over the group, on their way to the host."""

    def __init__(self, objective: Objective, metric_shapes: dict[str, torch.Size], values: ToHost):
        self.objective, self.metric_shapes, self.values = objective, metric_shapes, values

    def result(self) -> dict[str, float]:
        """LossTotals.reduce's dict (waits for the copy)."""
        values = self.values.get().tolist()
        k = len(self.objective.loss_terms)
        counts = values[-k:]
        means = [total / max(count, 1.0) for total, count in zip(values[:k], counts)]
        terms = dict(zip(self.objective.loss_terms, means))
        sums, offset = {}, k
        for name, shape in self.metric_shapes.items():
            size = shape.numel()
            sums[name] = torch.tensor(values[offset:offset + size]).reshape(shape)
            offset += size
        result = {"loss": sum(means)}
        if k > 1:
            result.update({f"{name}_loss": value for name, value in terms.items()})
        return {**result, **self.objective.summary(terms), **self.objective.finish_metrics(sums, counts),
                "units": int(counts[0])}
