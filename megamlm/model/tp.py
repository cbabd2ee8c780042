"""Tensor-parallel shards <-> full tensors.

The model marks its sharded parameters (megatron's `tensor_model_parallel` / `partition_dim`, our
`vocab_parallel`); `full_shape` reads those attributes and is what initialization, resharding and
parameter counts use. Tools that work on files (resharding folders, ZeRO consolidation) need the same
facts by parameter name without building the model: `SHARD_RULES`, which `tests/test_convert.py`
checks against every variant's parameter attributes. Vocab-parallel tables are padded with zero rows to a multiple of
make_vocab_size_divisible_by × TP; their full form holds exactly `vocab_size` rows.
"""

from __future__ import annotations

import re

import math

import torch
from torch import nn

from megamlm.config import ModelConfig
from megamlm.errors import MegamlmError
from megamlm.model import names

# (megamlm parameter name template, partition dim, vocab-parallel rows)
SHARD_RULES: list[tuple[str, int, bool]] = [
    (names.WORD_EMBEDDINGS, 0, True),
    (names.LM_HEAD_WEIGHT, 0, True),
    (names.LM_HEAD_BIAS, 0, True),
    (names.QKV, 0, False),
    (names.FC1, 0, False),
    (names.ATTENTION_OUT.replace("{kind}", "weight"), 1, False),  # row-parallel: the bias is replicated
    (names.FC2.replace("{kind}", "weight"), 1, False),
    (names.ALIBI_SLOPES, 1, False),
]


def _pattern(template: str) -> re.Pattern:
    """The template's names, also under ELECTRA's generator prefix (a second encoder's names)."""
    escaped = re.escape(template).replace(r"\{i\}", r"\d+").replace(r"\{kind\}", "(weight|bias)")
    return re.compile(f"({re.escape(names.GENERATOR_PREFIX)})?{escaped}$")


_RULES = [(_pattern(template), dim, vocab) for template, dim, vocab in SHARD_RULES]


def full_shape(param: nn.Parameter, tp_size: int, vocab_size: int | None = None) -> list[int]:
    """The TP=1 shape of this rank's `param`: the partition dim times tp_size; with `vocab_size`,
    vocab-parallel rows without their padding (else the padded rows)."""
    shape = list(getattr(param, "ds_shape", param.shape))  # ZeRO-3 keeps only a partition in .shape
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size
    if vocab_size is not None and getattr(param, "vocab_parallel", False):
        shape[0] = vocab_size
    return shape


def parameter_count(module: nn.Module, tp_size: int, vocab_size: int) -> int:
    """Parameters of the whole model (all TP ranks together), vocabulary padding excluded."""
    return sum(math.prod(full_shape(p, tp_size, vocab_size)) for p in module.parameters())


def shard_rule(name: str) -> tuple[int | None, bool]:
    """(partition dim or None if replicated, whether rows are vocab-padded) of a parameter."""
    for pattern, dim, vocab in _RULES:
        if pattern.match(name):
            return dim, vocab
    return None, False


def split_full(full: dict[str, torch.Tensor], model: ModelConfig, tp: int) -> list[dict[str, torch.Tensor]]:
    """Full tensors -> one dict per TP rank, shaped like that rank's parameters."""
    padded = model.padded_vocab_size(tp)
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for name, tensor in full.items():
        dim, vocab = shard_rule(name)
        if vocab:
            tensor = torch.cat([tensor, tensor.new_zeros(padded - tensor.shape[0], *tensor.shape[1:])])
        parts = [tensor] * tp if dim is None else tensor.chunk(tp, dim=dim)
        for rank, part in enumerate(parts):
            shards[rank][name] = part.clone()
    return shards


def merge_shards(shards: list[dict[str, torch.Tensor]], model: ModelConfig,
                 check_replicas: bool = True) -> dict[str, torch.Tensor]:
    """One dict per TP rank -> full tensors (vocab padding dropped; replicated tensors: rank 0's,
    checked to agree on every rank unless `check_replicas` is off)."""
    full = {}
    for name, first in shards[0].items():
        dim, vocab = shard_rule(name)
        if dim is None:
            for rank, shard in enumerate(shards[1:] if check_replicas else [], 1):
                if not torch.equal(shard[name], first):
                    raise MegamlmError(f"{name}: replicated parameter differs between TP rank 0 and {rank}")
            tensor = first
        else:
            tensor = torch.cat([shard[name] for shard in shards], dim=dim)
        full[name] = tensor[: model.vocab_size] if vocab else tensor
    return full
