"""Parameter initialization that does not depend on the tensor-parallel degree.

model.init names a scheme (INIT_SCHEMES). bert is fairseq's init_bert_params: weights and embeddings
~ N(0, 0.02), biases 0, LayerNorm 1/0, the position pad row 0 (and the token pad row 0 unless CLAP /
zero-clap build the table without padding_idx). modernbert is transformers' ModernBertPreTrainedModel
init: a normal truncated at ±2σ, σ scaled down by sqrt(2 · layers) for the projections that write
into the residual stream (Megatron's and GPT-2's scaled init); the pad rows as in bert (transformers
draws its pad row too, but nothing reads it: padded keys are masked and padded positions have no loss).

Each parameter is drawn whole, at its TP=1 shape, from a generator seeded by (seed, parameter
name), and this rank keeps its slice along the parameter's `partition_dim`. Vocab-parallel tables
draw their `vocab_size` real rows and pad with zero rows, because the padded size depends on TP.
So the same seed gives the same model at any TP degree and in any construction order.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from megamlm.config import ModelConfig
from megamlm.model import names
from megamlm.model.norm import NORM_TYPES
from megamlm.model.tp import full_shape, shard, tp_sharded

_NOT_RANDOM = ("beta", "log_slopes")  # set by their modules from the config / Press et al.


@dataclass(frozen=True)
class InitScheme:
    cutoff: float | None
    """Draws are cut at ± cutoff·σ (torch's trunc_normal_); None: a plain normal."""
    scaled: tuple[str, ...]
    """Name templates (model/names.py) whose σ is init_std / sqrt(2 · num_layers) (ELECTRA's generator's
    too, with the discriminator's num_layers: one config initializes both)."""
    width_scaled_classifier: bool = False
    """A fine-tuning head's classification layer has σ = hidden_size^-0.5 (else init_std)."""


INIT_SCHEMES = {
    "bert": InitScheme(cutoff=None, scaled=()),
    # transformers' ModernBertPreTrainedModel._init_weights: "in" (init_std) for the embeddings, Wqkv and
    # Wi; "out" (init_std / sqrt(2 L)) for both Wo and the head's dense layer; "final_out" (h^-0.5) for
    # the sequence classifier; cutoff factor 2
    "modernbert": InitScheme(cutoff=2.0, scaled=(names.ATTENTION_OUT, names.FC2, names.LM_HEAD_DENSE),
                             width_scaled_classifier=True),
}
"""model.init -> its scheme (the names of ModelConfig.init)."""


def _draw(shape: list[int], std: float, cutoff: float | None, generator: torch.Generator) -> torch.Tensor:
    full = torch.empty(shape)
    if cutoff is None:
        return full.normal_(0.0, std, generator=generator)
    return torch.nn.init.trunc_normal_(full, 0.0, std, -cutoff * std, cutoff * std, generator=generator)


def _std(model: ModelConfig, name: str) -> float:
    """σ of the weight `name` under model.init: scaled for the output projections its scheme names."""
    scaled = any(names.pattern(template).match(name) for template in INIT_SCHEMES[model.init].scaled)
    return model.init_std / math.sqrt(2.0 * model.num_layers) if scaled else model.init_std


@torch.no_grad()
def init_head_linear(linear: nn.Linear, model: ModelConfig, like: str | None,
                     generator: torch.Generator) -> None:
    """A linear layer of a head outside the model (fine-tuning), drawn by model.init's scheme from
    `generator`: with the σ of the model's weight `like` (e.g. the MLM head's dense layer), or for
    like=None the scheme's classification-layer σ; bias 0."""
    scheme = INIT_SCHEMES[model.init]
    if like is not None:
        std = _std(model, like)
    else:
        std = model.hidden_size ** -0.5 if scheme.width_scaled_classifier else model.init_std
    linear.weight.copy_(_draw(list(linear.weight.shape), std, scheme.cutoff, generator))
    if linear.bias is not None:
        linear.bias.zero_()


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


@torch.no_grad()
def init_parameters(module: nn.Module, model: ModelConfig, seed: int, tp_rank: int,
                    tp_size: int) -> None:
    zero_token_pad_row = model.head != "clap" and not model.zero_mask
    scheme = INIT_SCHEMES[model.init]
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
        full = _draw(shape, _std(model, name), scheme.cutoff, _generator(seed, name))
        if vocab_parallel:
            if zero_token_pad_row:
                full[model.pad_token_id] = 0
            padded = full_shape(param, tp_size)[0]
            full = torch.cat([full, full.new_zeros(padded - model.vocab_size, *shape[1:])])
        if name.endswith("positions.weight"):
            full[model.pad_token_id] = 0
        if tp_sharded(param):
            full = shard(full, param.partition_dim, tp_size, tp_rank, getattr(param, "partition_stride", 1))
        param.copy_(full)
