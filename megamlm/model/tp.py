"""Tensor-parallel shards <-> full tensors.

The model marks its sharded parameters (megatron's `tensor_model_parallel` / `partition_dim`, our
`vocab_parallel`); `full_shape` reads those attributes and is what initialization, resharding and
parameter counts use. Tools that work on files (resharding folders, ZeRO consolidation) need the same
facts by parameter name without building the model: `SHARD_RULES`, which `tests/test_convert.py`
checks against every variant's parameter attributes. Vocab-parallel tables are padded with zero rows to a multiple of
make_vocab_size_divisible_by × TP; their full form holds exactly `vocab_size` rows.

A gated FFN's first linear (model.gated_ffn) is megatron's strided partition: its full rows are
[activation half; gate half] and each rank holds its slice of both halves, [a_r; g_r] (stride 2), so
that every rank gates its own columns; `shard` / `unshard` are the one place that layout is written.
"""

from __future__ import annotations

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


_RULES = [(names.pattern(template), dim, vocab) for template, dim, vocab in SHARD_RULES]


def shard_stride(name: str, model: ModelConfig) -> int:
    """Halves each TP shard of `name` holds: 2 for a gated FFN's first linear, else 1."""
    return 2 if model.gated_ffn and names.pattern(names.FC1).match(name) else 1


def shard(full: torch.Tensor, dim: int, tp: int, rank: int, stride: int = 1) -> torch.Tensor:
    """A full tensor -> rank's shard along `dim`: its slice of each of the `stride` parts."""
    parts = full.chunk(tp * stride, dim=dim)
    return torch.cat(parts[rank::tp], dim=dim) if stride > 1 else parts[rank]


def unshard(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """The inverse of `shard` over every rank's shard."""
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([piece[j] for j in range(stride) for piece in pieces], dim=dim)


def tp_sharded(param: nn.Parameter) -> bool:
    """Each TP rank holds a different part of `param` (megatron's attribute); the rest are replicated."""
    return bool(getattr(param, "tensor_model_parallel", False))


def full_shape(param: nn.Parameter, tp_size: int, vocab_size: int | None = None) -> list[int]:
    """The TP=1 shape of this rank's `param`: the partition dim times tp_size; with `vocab_size`,
    vocab-parallel rows without their padding (else the padded rows)."""
    shape = list(getattr(param, "ds_shape", param.shape))  # ZeRO-3 keeps only a partition in .shape
    if tp_sharded(param):
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
        stride = shard_stride(name, model)
        parts = [tensor] * tp if dim is None else [shard(tensor, dim, tp, rank, stride) for rank in range(tp)]
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
            for rank, replica in enumerate(shards[1:] if check_replicas else [], 1):
                if not torch.equal(replica[name], first):
                    raise MegamlmError(f"{name}: replicated parameter differs between TP rank 0 and {rank}")
            tensor = first
        else:
            tensor = unshard([ranks[name] for ranks in shards], dim, shard_stride(name, model))
        full[name] = tensor[: model.vocab_size] if vocab else tensor
    return full
