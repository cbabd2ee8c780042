"""GLUE fine-tuning: a pretrained encoder + a classification head, trained with a named recipe.

    input     <s> A </s></s> B </s>        (fairseq ids; right-padded with 1, or packed)
    head      <s> features -> dense -> tanh -> out_proj  (RobertaClassificationHead; the folder's
              model.classifier / classifier_pooling may name another, objectives/classification.py)
    loss      cross-entropy, or MSE for STS-B (labels / 5)
    recipe    glue/recipes.py: fairseq's RoBERTa recipe (the reference's: AdamW (0.9, 0.98), weight decay
              0.1, dropout 0.1, polynomial decay after a ~6% warm-up, 10 epochs) or ELECTRA's
    epochs    validation after each

The pretrained variant's model options come from its folder's config.yaml. Data parallel over
the running world (gradients all-reduced over the DP group); a world of one on CPU.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megamlm.config import ModelConfig, OptimConfig
from megamlm.data.packing import best_fit_decreasing
from megamlm.data.tokenizer import BOS, EOS, Tokenizer
from megamlm.errors import MegamlmError, check_ranges, did_you_mean
from megamlm.objectives.classification import CLASSIFIER_HEADS, Pooling
from megamlm.glue.metrics import best_of, compute_metrics
from megamlm.glue.optimizer import build_optimizer
from megamlm.glue.recipes import RECIPES, Recipe
from megamlm.glue.tasks import Example, Task
from megamlm.parallel import ParallelContext, host_to_device
from megamlm.train.schedule import lr_at


PROGRESS_SECONDS = 60.0
"""Seconds between progress lines within an epoch (each reads the loss from the device once)."""


@dataclass
class FinetuneOptions:
    """What a user sets; every None is the recipe's value (glue/recipes.py, per task and model size)."""

    recipe: str = "fairseq"
    """The fine-tuning recipe (RECIPES: fairseq, the reference's; electra)."""
    epochs: int | None = None
    """Passes over the training rows."""
    batch_size: int | None = None
    """Sequences per update."""
    lr: float | None = None
    """Peak learning rate."""
    max_length: int | None = None
    """Tokens per input (at most a learned position table's size); longer pairs are truncated, the
    longer sentence first."""
    weight_decay: float | None = None
    """AdamW's decoupled weight decay."""
    dropout: float | None = None
    """Hidden and attention dropout while fine-tuning, whatever the folder trained with."""
    classifier_dropout: float | None = None
    """Dropout on the classification layer's input (fairseq's pooler_dropout: 0; BERT's and ELECTRA's code:
    0.1)."""
    layerwise_lr_decay: float | None = None
    """ELECTRA's layer-wise learning-rate decay: the head trains at the learning rate, each layer below at
    `decay` times the one above, the embedding lowest (`layer_lr_scales`); 1: one learning rate."""
    packing: Literal["packed", "padded"] = "packed"
    """packed: a batch's sequences end to end in rows as wide as its longest one (best-fit
    decreasing), positions and attention per sequence, the head on each sequence's <s>, so the linear
    layers compute no padding (SST-2 1.5x, RTE 1.4x faster on CPU, BENCHMARKS.md); padded: one
    right-padded row per sequence (fairseq's layout; the recorded GLUE runs before session 8)."""
    predict: bool = False
    """Also predict each task's test files with the best epoch's weights (glue/submission.py)."""
    save: bool = False
    """Write each task's best seed at its best epoch as a model folder (<out>/models/<TASK>, run.py)."""
    overrides: tuple[str, ...] = ()
    """Dotted overrides of the folder's config, e.g. model.classifier_pooling=mean (`megamlm glue
    --checkpoint DIR ... model.classifier=mlm_head`), applied after `dropout` (so they may set one of
    the two dropouts alone)."""

    def __post_init__(self):
        if self.recipe not in RECIPES:
            raise MegamlmError(f"unknown fine-tuning recipe {self.recipe!r}; allowed: {', '.join(RECIPES)}"
                               f"{did_you_mean(self.recipe, RECIPES)}")
        if self.epochs is not None and self.epochs < 0:
            raise MegamlmError(f"epochs {self.epochs}: must be >= 0 (0: score the dev rows with the folder's weights)")
        bounds = {"batch_size": ">= 1", "lr": "> 0",
                  "max_length": ">= 6 (a pair's 4 special tokens and a token of each sentence)",
                  "weight_decay": ">= 0", "dropout": "[0, 1)", "classifier_dropout": "[0, 1)",
                  "layerwise_lr_decay": "[0, 1] (0: the head alone trains; 1: one learning rate)"}
        values = {name: getattr(self, name) for name in bounds if getattr(self, name) is not None}  # None: the recipe's
        check_ranges([(f"--{name.replace('_', '-')} {value:g}", value, bounds[name]) for name, value in values.items()])

    def recipe_for(self, task: Task, model: ModelConfig) -> Recipe:
        """The recipe resolved for `task` and `model`, with what this user set."""
        return RECIPES[self.recipe].for_task(task, model, {f: getattr(self, f) for f in RECIPE_OPTIONS})

    def with_recipe(self) -> FinetuneOptions:
        """These options with the recipe's values filled in where they do not vary per task or model."""
        shared = RECIPES[self.recipe].shared()
        return dataclasses.replace(self, **{f: shared[f] for f in RECIPE_OPTIONS
                                            if getattr(self, f) is None and f in shared})


RECIPE_OPTIONS = tuple(f.name for f in dataclasses.fields(FinetuneOptions)
                       if f.name in {r.name for r in dataclasses.fields(Recipe)})
"""The options that override a recipe's field of the same name."""


class SentenceClassifier(nn.Module):
    """The pretrained Encoder (without its objective's heads) + the classification head its config names
    (model.classifier, reading model.classifier_pooling's features)."""

    def __init__(self, body: nn.Module, num_classes: int, seed: int, pretrained: dict[str, torch.Tensor] | None = None,
                 dropout: float = 0.0, name: str = ""):
        """`pretrained`: the model folder's full tensors, for a head that starts from some of them (all of
        them when the folder has a classification head `name`); `dropout`: on the head's classification
        layer's input while training."""
        super().__init__()
        self.body = body
        model = body.config
        self.head = CLASSIFIER_HEADS[model.classifier](model, num_classes, dropout)
        # identical on every rank: a generator seeded by the fine-tuning seed, not the global RNG
        self.pretrained = (self.head.restore(name, pretrained or {}) if name else []) or self.head.initialize(
            model, torch.Generator().manual_seed(seed), pretrained or {})
        """The folder's tensors the head started from (none: drawn)."""
        self.head.to(body.ctx.device)

    def forward(self, tokens: torch.Tensor, pooling: Pooling, segments: torch.Tensor | None = None,
                host_layout: tuple | None = None) -> torch.Tensor:
        """tokens [b, s] (one sequence per row, or packed rows with segments [b, s]) -> [n, classes], the
        n sequences `pooling` places (in its order). host_layout: (tokens, None, segments) on the CPU."""
        hidden = self.body(tokens, segments=segments, host_layout=host_layout)  # [s, b, h]
        return self.head(pooling(hidden))  # [n, h] -> [n, classes]


def layer_lr_scales(model: SentenceClassifier, decay: float | None) -> dict[str, float]:
    """Parameter name -> learning-rate scale: decay^(L + 2 - depth), with depth 0 for the embedding (and a
    learned position encoding), i + 1 for layer i (a shared layer: 1), L + 1 for the final norm and L + 2
    for the classification head, as google-research/electra's `_get_layer_lrs`; all 1 when decay is None."""
    top = model.body.config.num_layers + 2
    scales = {}
    for name, _ in model.named_parameters():
        parts = name.split(".")
        if parts[0] == "head":
            depth = top
        elif parts[1:3] == ["encoder", "layers"]:
            depth = int(parts[3]) + 1
        elif parts[1] == "encoder":  # the final norm (pre-LN)
            depth = top - 1
        else:  # the embedding, its projection, a learned position encoding
            depth = 0
        scales[name] = 1.0 if decay is None else decay ** (top - depth)
    return scales


def param_groups(model: SentenceClassifier, recipe: Recipe) -> list[dict]:
    """One optimizer group per (learning-rate scale, weight decay), highest scale first; 1-dimensional
    parameters (norm weights, biases) without weight decay unless the recipe decays them."""
    scales = layer_lr_scales(model, recipe.layerwise_lr_decay)
    groups: dict[tuple[float, float], list] = {}
    for name, param in model.named_parameters():
        decay = recipe.weight_decay if recipe.decay_norms_and_biases or param.dim() > 1 else 0.0
        groups.setdefault((scales[name], decay), []).append(param)
    return [{"params": params, "lr_scale": scale, "weight_decay": decay}
            for (scale, decay), params in sorted(groups.items(), key=lambda item: -item[0][0])]


def encode(examples: list[Example], tokenizer: Tokenizer, max_length: int) -> list[list[int]]:
    """`<s> A </s>` or `<s> A </s></s> B </s>` (WordPiece: `[CLS] A [SEP] B [SEP]`, the tokenizer's
    pair_separator), the longer sentence truncated first when too long."""
    out = []
    for example in examples:
        parts = [tokenizer.encode(text).tolist() for text in example.texts]
        budget = max_length - 2 - (len(tokenizer.pair_separator) if len(parts) == 2 else 0)
        while sum(map(len, parts)) > budget:
            longest = max(range(len(parts)), key=lambda i: len(parts[i]))
            parts[longest].pop()
        ids = [BOS, *parts[0], EOS]
        if len(parts) == 2:
            ids += [*tokenizer.pair_separator[1:], *parts[1], EOS]  # RoBERTa: </s></s>; BERT: [SEP]
        out.append(ids)
    return out


def collate(sequences: list[list[int]], pad: int) -> torch.Tensor:
    tokens = torch.full((len(sequences), max(map(len, sequences))), pad, dtype=torch.long)
    for i, ids in enumerate(sequences):
        tokens[i, : len(ids)] = torch.tensor(ids)
    return tokens


def pack(sequences: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sequences end to end in rows as wide as the longest (best-fit decreasing) -> tokens [r, w],
    segments [r, w] (each position's sequence within its row, -1 on padding) and starts [n], the flat
    index of each sequence's first token, in the sequences' order."""
    width = max(map(len, sequences))
    rows = best_fit_decreasing(np.array([len(ids) for ids in sequences]), width)
    tokens = torch.full((len(rows), width), pad, dtype=torch.long)
    segments = torch.full((len(rows), width), -1, dtype=torch.long)
    starts = torch.empty(len(sequences), dtype=torch.long)
    for row, members in enumerate(rows):
        column = 0
        for segment, i in enumerate(members):
            span = slice(column, column + len(sequences[i]))
            tokens[row, span], segments[row, span] = torch.tensor(sequences[i]), segment
            starts[i] = row * width + column
            column = span.stop
    return tokens, segments, starts


def classify(model: SentenceClassifier, sequences: list[list[int]], pad: int, packing: str,
             device: torch.device) -> torch.Tensor:
    """Logits [n, classes] of the sequences, in their order, in the layout `packing` names."""
    lengths = [len(ids) for ids in sequences]
    kind = model.body.config.classifier_pooling
    if packing == "packed":
        tokens, segments, starts = pack(sequences, pad)
        pooling = Pooling.of(starts, lengths, tokens.numel(), kind).to(device)
        return model(host_to_device(tokens, device), pooling, host_to_device(segments, device),
                     host_layout=(tokens, None, segments))
    tokens = collate(sequences, pad)
    pooling = Pooling.of(torch.arange(len(sequences)) * tokens.size(1), lengths, tokens.numel(), kind).to(device)
    return model(host_to_device(tokens, device), pooling, host_layout=(tokens, None, None))


def _loss(logits: torch.Tensor, labels: torch.Tensor, regression: bool) -> torch.Tensor:
    """Summed over the batch (normalized by the global batch size by the caller)."""
    if regression:
        return F.mse_loss(logits.squeeze(-1).float(), labels.float(), reduction="sum")
    return F.cross_entropy(logits.float(), labels.long(), reduction="sum")


@torch.no_grad()
def predict(model: SentenceClassifier, sequences: list[list[int]], task: Task, batch_size: int,
            pad: int, ctx: ParallelContext, packing: str) -> np.ndarray:
    model.eval()
    outputs = []
    for start in range(0, len(sequences), batch_size):
        logits = classify(model, sequences[start:start + batch_size], pad, packing, ctx.device).float()
        outputs.append(logits.squeeze(-1) if task.labels is None else logits.argmax(-1))
    model.train()
    return torch.cat(outputs).cpu().numpy()


def finetune(model: SentenceClassifier, task: Task, train: list[Example], dev: list[Example],
             tokenizer: Tokenizer, options: FinetuneOptions, seed: int, ctx: ParallelContext,
             log=print, test: dict[str, list[Example]] | None = None,
             extra_dev: dict[str, list[Example]] | None = None) -> dict:
    """Train with the recipe; returns {"epochs": [...], "best": {...}, "updates": n}, and with `test`
    ({submission name: a test file's rows}) "test": {name: predictions of the best epoch's weights}.
    With `test` or options.save the model ends at the best epoch's weights. 0 epochs: the dev rows are
    scored once with the weights as loaded (epoch 0). `extra_dev` ({suffix: rows}, Task.extra_dev) is
    scored each epoch too, as `<metric>_<suffix>`."""
    pad = model.body.config.pad_token_id
    body = model.body.config
    recipe = options.recipe_for(task, body)
    batch_size = recipe.batch_size
    if batch_size % ctx.dp_size:
        raise MegamlmError(f"batch size {batch_size} is not divisible by data parallel {ctx.dp_size}")
    max_length = min(recipe.max_length, body.max_positions) if body.position == "learned" else recipe.max_length
    train_ids = encode(train, tokenizer, max_length)
    train_labels = torch.tensor([x.label for x in train])
    # suffix ("": the dev set) -> its rows' ids and labels
    dev_sets = {suffix: (encode(rows, tokenizer, max_length), np.array([x.label for x in rows]))
                for suffix, rows in {"": dev, **(extra_dev or {})}.items()}
    per_epoch = math.ceil(len(train) / batch_size)
    total, warmup = recipe.updates(task, per_epoch)
    schedule = OptimConfig(lr=recipe.lr, min_lr=0.0, schedule=recipe.schedule, end_lr=0.0, power=1.0,
                           warmup_steps=warmup, betas=recipe.betas, eps=recipe.eps)
    optimizer = build_optimizer(param_groups(model, recipe), recipe)
    generator = torch.Generator().manual_seed(seed)
    history, update = [], 0

    restore = bool(test) or options.save  # then the model ends at its best epoch's weights

    def validate(epoch: int, start: float, train_loss: float | None) -> None:
        """Score the dev rows; keep the weights of the best epoch so far (when they are restored)."""
        nonlocal best_weights
        metrics = {}
        for suffix, (ids, labels) in dev_sets.items():
            scores = compute_metrics(task.metrics, predict(model, ids, task, batch_size * 2, pad, ctx,
                                                           options.packing), labels)
            metrics.update({f"{key}_{suffix}" if suffix else key: value for key, value in scores.items()})
        history.append({"epoch": epoch, "train_loss": train_loss, "seconds": time.perf_counter() - start,
                        **metrics})
        log(f"{task.name} seed {seed} epoch {epoch}/{recipe.epochs}: "
            + ("" if train_loss is None else f"train loss {train_loss:.4f} | ")
            + " | ".join(f"{k} {v:.4f}" for k, v in metrics.items()) + f" | {history[-1]['seconds']:.0f}s")
        if restore and best_of(task.metrics[0], history, lambda e: e) is history[-1]:
            best_weights = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}

    best_weights = None
    if not recipe.epochs:  # evaluation only: the folder's weights (e.g. a model `--save` wrote), as epoch 0
        validate(0, time.perf_counter(), None)
    model.train()
    for epoch in range(1, recipe.epochs + 1):
        # summed on the device in float64 (what adding Python floats did), read once per epoch: a read
        # per update would make the host wait for every step's kernels before queuing the next
        start, loss_sum = time.perf_counter(), torch.zeros((), dtype=torch.float64, device=ctx.device)
        shown = start
        order = torch.randperm(len(train), generator=generator).tolist()  # same on every rank
        for first in range(0, len(order), batch_size):
            batch = order[first:first + batch_size][ctx.dp_rank::ctx.dp_size]
            for group in optimizer.param_groups:
                group["lr"] = lr_at(update, schedule, total) * group["lr_scale"]
            logits = classify(model, [train_ids[i] for i in batch], pad, options.packing, ctx.device)
            global_batch = len(order[first:first + batch_size])
            loss = _loss(logits, host_to_device(train_labels[batch], ctx.device), task.labels is None) / global_batch
            optimizer.zero_grad(set_to_none=False)
            loss.backward()
            value = loss.detach()
            if ctx.dp_size > 1:  # each rank's loss is its share of the global batch mean: sum them
                for tensor in [value] + [p.grad for p in model.parameters() if p.grad is not None]:
                    dist.all_reduce(tensor, group=ctx.dp_group)
            if recipe.clip_grad:
                torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip_grad)
            optimizer.step()
            loss_sum += value.double()
            update += 1
            if time.perf_counter() - shown >= PROGRESS_SECONDS:  # a long epoch shows it is moving (one read)
                shown, done = time.perf_counter(), first // batch_size + 1
                log(f"{task.name} seed {seed} epoch {epoch}/{recipe.epochs}: update {done}/{per_epoch} | train loss "
                    f"{loss_sum.item() / done:.4f} | ETA {(shown - start) * (per_epoch - done) / done:.0f}s")
        validate(epoch, start, loss_sum.item() / per_epoch)
    result = {"epochs": history, "best": best_of(task.metrics[0], history, lambda e: e), "updates": update,
              "schedule_updates": total, "recipe": dataclasses.asdict(recipe)}
    if restore:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(best_weights[name])
    if test:
        result["test"] = {name: predict(model, encode(rows, tokenizer, max_length), task, batch_size * 2, pad, ctx,
                                        options.packing).tolist() for name, rows in test.items()}
    return result
