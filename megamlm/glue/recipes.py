"""Fine-tuning recipes: each paper's GLUE hyper-parameters, chosen by name (`megamlm glue --recipe`).

    fairseq  RoBERTa's (fairseq examples/roberta/config/finetuning; the reference's, the default): the
             task table's learning rate, batch size (16 or 32), updates and warm-up (~6%) for 10 epochs;
             polynomial decay after a linear warm-up; AdamW (0.9, 0.98), eps 1e-6, weight decay 0.1 on
             every parameter; dropout 0.1, none on the classifier's input; 512 tokens; no clipping.
    electra  google-research/electra's configure_finetuning.py and model/optimization.py: lr 1e-4 (the
             paper's table 7: 3e-4 small, 5e-5 large) with layer-wise decay 0.8 (0.9 large), batch 32,
             3 epochs (10 for RTE and STS-B), a linear decay from update 0 times a 10% warm-up ramp,
             Adam (0.9, 0.999), eps 1e-6, *without* bias correction (BERT's AdamWeightDecayOptimizer),
             weight decay 0.01 except on norms and biases, gradients clipped to global norm 1.0; dropout
             0.1, also on the classifier's input; 128 tokens.

A recipe resolves per task and model (`Recipe.for_task`); what a user sets (FinetuneOptions) wins.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megamlm.config import ModelConfig
from megamlm.glue.tasks import Task


@dataclass(frozen=True)
class Recipe:
    name: str
    epochs: int
    """Passes over the training rows."""
    batch_size: int | None
    """Sequences per update; None: the task table's (fairseq's 16 or 32)."""
    lr: float | None
    """Peak learning rate; None: the task table's."""
    layerwise_lr_decay: float
    """ELECTRA's layer-wise learning-rate decay (`finetune.layer_lr_scales`); 1: one learning rate."""
    max_length: int
    """Tokens per input (at most a learned position table's size); longer pairs are truncated."""
    weight_decay: float
    """Decoupled weight decay."""
    decay_norms_and_biases: bool
    """Whether weight decay applies to 1-dimensional parameters (norm weights, biases) too."""
    dropout: float
    """Hidden and attention dropout while fine-tuning, whatever the folder trained with."""
    classifier_dropout: float
    """Dropout on the classification layer's input."""
    warmup: float | None
    """Warm-up share of the updates (then updates = epochs × batches per epoch); None: the task table's
    updates and warm-up, scaled to the run (`Task.schedule`)."""
    schedule: str
    """optim.schedule's name: polynomial (decay after the warm-up) or warmup_times_polynomial (decay
    from update 0, times the warm-up ramp)."""
    betas: tuple[float, float]
    eps: float
    bias_correction: bool
    """Adam's bias correction (torch's AdamW); False: TF BERT/ELECTRA's AdamWeightDecayOptimizer."""
    clip_grad: float
    """Global gradient-norm clipping threshold; 0: none."""
    per_task: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Task name -> the fields that differ for it."""
    per_size: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """`model_size` -> the fields that differ for it."""

    def for_task(self, task: Task, model: ModelConfig, overrides: Mapping[str, Any] | None = None) -> Recipe:
        """Every field concrete for `task` and `model`: the table's lr / batch size where the recipe
        takes them, the task's and the model size's variations, then `overrides` (None values ignored)."""
        table = {"lr": task.lr, "batch_size": task.batch_size}
        values = {**{k: v for k, v in table.items() if getattr(self, k) is None},
                  **self.per_size.get(model_size(model), {}), **self.per_task.get(task.name, {}),
                  **{k: v for k, v in (overrides or {}).items() if v is not None}}
        return dataclasses.replace(self, **values, per_task={}, per_size={})

    def updates(self, task: Task, updates_per_epoch: int) -> tuple[int, int]:
        """(total, warm-up) updates of this resolved recipe's schedule for `task`."""
        if self.warmup is None:
            return task.schedule(self.epochs, updates_per_epoch)
        total = self.epochs * updates_per_epoch
        return total, round(self.warmup * total)

    def shared(self) -> dict[str, Any]:
        """The fields with one value for every task and model size (a report's options)."""
        varied = {k for changes in (*self.per_task.values(), *self.per_size.values()) for k in changes}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in varied | {"per_task", "per_size"} and getattr(self, f.name) is not None}


def model_size(model: ModelConfig) -> str:
    """ELECTRA's size names by hidden width: small (≤ 256), large (≥ 1024), base otherwise."""
    return "small" if model.hidden_size <= 256 else "large" if model.hidden_size >= 1024 else "base"


RECIPES: dict[str, Recipe] = {r.name: r for r in [
    Recipe("fairseq", epochs=10, batch_size=None, lr=None, layerwise_lr_decay=1.0, max_length=512,
           weight_decay=0.1, decay_norms_and_biases=True, dropout=0.1, classifier_dropout=0.0, warmup=None,
           schedule="polynomial", betas=(0.9, 0.98), eps=1e-6, bias_correction=True, clip_grad=0.0),
    Recipe("electra", epochs=3, batch_size=32, lr=1e-4, layerwise_lr_decay=0.8, max_length=128,
           weight_decay=0.01, decay_norms_and_biases=False, dropout=0.1, classifier_dropout=0.1, warmup=0.1,
           schedule="warmup_times_polynomial", betas=(0.9, 0.999), eps=1e-6, bias_correction=False,
           clip_grad=1.0, per_task={"RTE": {"epochs": 10}, "STS-B": {"epochs": 10}},
           per_size={"small": {"lr": 3e-4}, "large": {"lr": 5e-5, "layerwise_lr_decay": 0.9}}),
]}
"""--recipe name -> recipe (the first: the default)."""
PAPER_RECIPES = {"electra": "electra"}
"""objective.name -> the recipe of the paper that introduced it, where that is not the default; `megamlm
glue` notes it when another one fine-tunes such a folder (the default stays: one recipe compares objectives)."""
