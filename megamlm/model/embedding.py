"""Input embeddings over a vocab-parallel token table (fairseq RobertaEncoder.forward_embedding).

Order of operations, as in the reference:
    e = E[tokens]                                (VocabParallelEmbedding: each rank owns a row range)
    e = normalize(e)                             if normalize_embeddings (CLAP)
    e = 0 where token == vocab_size              if zero_mask (zero-clap: the mask is the zero vector)
    x = e * sqrt(h) (or * 1) + positions(tokens) (+ T[token_types(tokens)], BERT)
    x = dropout(LayerNorm(x)) ; x = 0 at padding
"""

from __future__ import annotations

import math

import torch
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
from torch import nn

from megamlm.config import ModelConfig
from megamlm.model.dropout import dropout
from megamlm.model.norm import l2_normalize, norm
from megamlm.model.positions import PositionEncoding, sample_starts


def token_types(tokens: torch.Tensor, model: ModelConfig, segments: torch.Tensor | None = None) -> torch.Tensor:
    """[b, s] ids -> [b, s] token types: separators strictly before each position in its sample
    (packed rows: `segments`), capped at model.token_types - 1 (BERT's A = 0, B = 1)."""
    separators = tokens.eq(model.separator_token_id).long()
    before = torch.cumsum(separators, dim=1) - separators
    if segments is not None:
        before = before - before.gather(1, sample_starts(segments))
    return before.clamp(max=model.token_types - 1)


class TokenEmbedding(nn.Module):
    def __init__(self, model: ModelConfig, transformer_config, tp_group, padded_vocab_size: int,
                 positions: PositionEncoding | None):
        """`positions`: the position encoding when it has an input term (else None)."""
        super().__init__()
        self.model = model
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab_size, model.embedding_dim, init_method=nn.init.zeros_,
            config=transformer_config, tp_group=tp_group)
        self.positions = positions
        self.token_types = nn.Embedding(model.token_types, model.embedding_dim) if model.token_types else None
        self.layernorm = norm(model, model.embedding_dim) if model.embedding_layernorm else None
        self.scale = math.sqrt(model.embedding_dim) if model.scale_embeddings else 1.0

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor,
                segments: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, padding [b, s] -> embeddings [s, b, e] (zero at padded positions; e = model.embedding_dim,
        the hidden size unless factorized, ALBERT); `segments`:
        packed rows (positions restart at each sample)."""
        model = self.model
        if model.zero_mask:
            is_mask = tokens >= model.vocab_size
            tokens = tokens.clamp(max=model.vocab_size - 1)
        e = self.word_embeddings(tokens)  # [b, s, e], already reduced over the TP group
        if model.normalize_embeddings:
            e = l2_normalize(e)
        if model.zero_mask:
            e = e * ~is_mask[..., None]
        x = e * self.scale
        if self.positions is not None:
            # a fixed table (sinusoidal) is fp32 buffers, which DeepSpeed does not cast: the model's dtype,
            # as fairseq's half models add it (else bf16/fp16 runs would carry fp32 into bf16 layers)
            x = x + self.positions.embed(tokens, segments).to(x.dtype)
        if self.token_types is not None:
            x = x + self.token_types(token_types(tokens, model, segments))
        if self.layernorm is not None:
            x = self.layernorm(x)
        x = dropout(x, model.hidden_dropout, self.training) * ~padding[..., None]
        # [b, s, e] -> [s, b, e], with the strides every layer's output has: at b = 1 (packed rows)
        # .contiguous() would keep the transpose's (e, s·e, 1), and a compiled layer would be compiled twice,
        # once for layer 0's input and once for the others' (Dynamo guards on strides)
        return x.transpose(0, 1).clone(memory_format=torch.contiguous_format)
