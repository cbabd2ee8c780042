"""Prediction heads over the vocab-parallel embedding, applied to the selected positions only.

Both heads get features [n, h] (n = number of masked positions) that are identical on every
tensor-parallel rank, and return this rank's logit columns [n, V_local]. Before the vocabulary
projection the features pass `copy_to_tensor_model_parallel_region` (identity forward, all-reduce
backward) so that the replicated parameters below receive the gradient of the whole vocabulary.
`column_bias` [V_local] (0, or -inf on vocabulary-padding columns) is added inside the projection's
addmm: masking the [n, V_local] logits afterwards would cost a pass over them forward and backward.
`project` is that last step: F.linear for the logits, or a loss over its operands (x, weight, bias)
that never forms them (model/head_loss.py); it runs inside the head's forward, where ZeRO-3 has
gathered the head's parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from torch import nn

from megamlm.config import ModelConfig
from megamlm.model.activation import activation_function
from megamlm.model.norm import l2_normalize, norm


def vocab_padding_bias(vocab_start: int, vocab_local: int, vocab_size: int) -> torch.Tensor:
    """[V_local] column bias of a vocabulary shard: 0 on real columns, -inf on vocabulary padding
    (which must never take probability mass)."""
    padded = torch.arange(vocab_start, vocab_start + vocab_local) >= vocab_size
    return torch.zeros(vocab_local).masked_fill(padded, float("-inf"))


def mark_vocab_parallel(param: nn.Parameter) -> nn.Parameter:
    """Rows are split over TP ranks like the embedding (init and checkpoint tools rely on it)."""
    set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)
    param.vocab_parallel = True
    return param


class RobertaLMHead(nn.Module):
    """fairseq RobertaLMHead (= BERT's, ALBERT's): LayerNorm(act(dense(h))) @ Eᵀ + bias (model.activation;
    dense maps the features to the embedding table's width, ALBERT's E)."""

    def __init__(self, model: ModelConfig, vocab_local: int, tp_group, input_size: int | None = None):
        """`input_size`: width of the features when it is not the model's (ELECTRA's generator)."""
        super().__init__()
        self.tp_group = tp_group
        self.dense = nn.Linear(input_size or model.hidden_size, model.embedding_dim, bias=model.bias)
        self.activation = activation_function(model)
        self.layernorm = norm(model, model.embedding_dim)
        self.bias = mark_vocab_parallel(nn.Parameter(torch.zeros(vocab_local)))
        self.weight = (None if model.tie_embeddings else
                       mark_vocab_parallel(nn.Parameter(torch.empty(vocab_local, model.embedding_dim))))

    def projection(self, features: torch.Tensor, embedding_weight: torch.Tensor,
                   column_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x [n, h], weight [V_local, h], bias [V_local]) with logits = x · weightᵀ + bias."""
        x = self.layernorm(self.activation(self.dense(features)))
        x = copy_to_tensor_model_parallel_region(x, group=self.tp_group)
        weight = embedding_weight if self.weight is None else self.weight
        return x, weight, self.bias + column_bias.to(self.bias.dtype)  # buffers stay fp32 under DeepSpeed bf16

    def forward(self, features: torch.Tensor, embedding_weight: torch.Tensor, column_bias: torch.Tensor,
                project=F.linear) -> torch.Tensor:
        return project(*self.projection(features, embedding_weight, column_bias))


class ClapHead(nn.Module):
    """CLAP head: beta * <h, normalize(E_v)>; h is not normalized, beta is a learnable scalar.

    Row norms need no communication: each rank normalizes the rows it owns. beta is replicated
    but each rank's logits cover only its vocabulary shard, so beta's gradient is summed over the
    TP group (copy_to_... is identity forward, all-reduce backward).
    """

    def __init__(self, model: ModelConfig, tp_group):
        super().__init__()
        self.tp_group = tp_group
        # shape [1], not fairseq's []: DeepSpeed's DP broadcast views every parameter as bytes,
        # which a 0-dim tensor cannot do (the converters reshape)
        self.beta = nn.Parameter(torch.full((1,), float(model.clap_initial_beta)))

    def projection(self, features: torch.Tensor, embedding_weight: torch.Tensor,
                   column_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x [n, h], weight [V_local, h], bias [V_local]) with logits = x · weightᵀ + bias."""
        x = copy_to_tensor_model_parallel_region(features, group=self.tp_group)
        beta = copy_to_tensor_model_parallel_region(self.beta, group=self.tp_group)
        # beta * (h · E_v) computed as (beta * h) · E_v: scales [n, h], not the [n, V_local] logits
        return beta * x, l2_normalize(embedding_weight), column_bias.to(embedding_weight.dtype)

    def forward(self, features: torch.Tensor, embedding_weight: torch.Tensor, column_bias: torch.Tensor,
                project=F.linear) -> torch.Tensor:
        return project(*self.projection(features, embedding_weight, column_bias))
