"""Parameter initialization that does not depend on the tensor-parallel degree.

fairseq's init_bert_params: weights and embeddings ~ N(0, 0.02), biases 0, LayerNorm 1/0, the
position pad row 0 (and the token pad row 0 unless CLAP / zero-clap build the table without
padding_idx).

Each parameter is drawn whole, at its TP=1 shape, from a generator seeded by (seed, parameter
name), and this rank keeps its slice along the parameter's `partition_dim`. Vocab-parallel tables
draw their `vocab_size` real rows and pad with zero rows, because the padded size depends on TP.
So the same seed gives the same model at any TP degree and in any construction order.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from megamlm.config import ModelConfig
from megamlm.model.norm import NORM_TYPES
from megamlm.model.tp import full_shape, shard

_NOT_RANDOM = ("beta", "log_slopes")  # set by their modules from the config / Press et al.


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


@torch.no_grad()
def init_parameters(module: nn.Module, model: ModelConfig, seed: int, tp_rank: int,
                    tp_size: int) -> None:
    zero_token_pad_row = model.head != "clap" and not model.zero_mask
    norms = tuple(m for m in module.modules() if isinstance(m, NORM_TYPES))
    norm_params = {id(p) for m in norms for p in m.parameters()}
    for name, param in module.named_parameters():
        if name.rsplit(".", 1)[-1] in _NOT_RANDOM:
            continue
        if id(param) in norm_params:
            param.fill_(1.0 if name.endswith("weight") else 0.0)
            continue
        if name.endswith("bias"):
            param.zero_()
            continue
        shape = full_shape(param, tp_size, model.vocab_size)
        vocab_parallel = getattr(param, "vocab_parallel", False)
        full = torch.empty(shape).normal_(0.0, model.init_std, generator=_generator(seed, name))
        if vocab_parallel:
            if zero_token_pad_row:
                full[model.pad_token_id] = 0
            padded = full_shape(param, tp_size)[0]
            full = torch.cat([full, full.new_zeros(padded - model.vocab_size, *shape[1:])])
        if name.endswith("positions.weight"):
            full[model.pad_token_id] = 0
        if getattr(param, "tensor_model_parallel", False):
            full = shard(full, param.partition_dim, tp_size, tp_rank, getattr(param, "partition_stride", 1))
        param.copy_(full)
