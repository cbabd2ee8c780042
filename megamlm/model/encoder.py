"""Encoder: token embedding -> megatron-core TransformerBlock -> hidden states, on this rank's shard.

Shapes: b batch, s sequence, h hidden, np heads on this rank. Token ids are fairseq dictionary ids,
padding = pad_token_id.

    hidden = Encoder(model, ctx)(tokens [b, s])        # [s, b, h], identical on every TP rank

The encoder knows its tensor-parallel shard (`ParallelContext`) and nothing about objectives: an
objective (megamlm/objectives/) subclasses or wraps it and adds its heads; GLUE uses it bare. Its
parts are chosen by name from registries: the position encoding (positions.POSITIONS) and the
attention backend (backends.ATTENTION_BACKENDS), which the layer spec plugs into megatron-core.
Parameter names are wave 1's checkpoint names (init seeds each parameter by its name too), so
position tables stay under `embedding.positions` and ALiBi's learned slopes under `alibi`.
"""

from __future__ import annotations

import functools

import torch
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from megamlm.config import ConfigError, ModelConfig
from megamlm.model.activation import activation_function
from megamlm.model import bias_activation
from megamlm.model.backends import ATTENTION_BACKENDS
from megamlm.model.embedding import TokenEmbedding
from megamlm.model.heads import mark_vocab_parallel
from megamlm.model.init import init_parameters
from megamlm.model.layer import encoder_block_spec
from megamlm.model.norm import norm_parameter_count
from megamlm.model.positions import Alibi, build_position
from megamlm.model.tp import parameter_count, shard_stride
from megamlm.parallel import ParallelContext


def transformer_config(model: ModelConfig, tp_size: int,
                       params_dtype: torch.dtype = torch.float32) -> TransformerConfig:
    """megatron-core's config for our encoder. Fusions that need apex/CUDA kernels stay off;
    initialization is ours (TP-invariant, see init.py), so megatron's is skipped."""
    return TransformerConfig(
        num_layers=1 if model.share_layers else model.num_layers,  # a shared layer is built once
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        ffn_hidden_size=model.ffn_hidden_size,
        kv_channels=model.head_dim,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        layernorm_epsilon=model.layernorm_epsilon,
        add_bias_linear=model.bias,
        gated_linear_unit=model.gated_ffn,
        # with model.bias_activation=triton the FFN's first linear applies it (layer.py BiasActivationLinear)
        activation_func=(activation_function(model) if model.bias_activation == "torch"
                         else bias_activation.applied_by_the_linear),
        normalization="LayerNorm",
        tensor_model_parallel_size=tp_size,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
    )


def attended_keys(model: ModelConfig, seq_length: int) -> list[int]:
    """Keys each query of a layer attends to (LayerAttention.keys_per_query): the sequence in a global
    layer; in a local one at most the window + 1 (local_window / 2 on each side and itself), plus
    BigBird's global tokens and random blocks."""
    return [pattern.keys_per_query(seq_length) for pattern in model.layer_attention()]


def encoder_flops_per_token(model: ModelConfig, seq_length: int) -> float:
    """Matmul FLOPs per token of the encoder body, forward + backward (3 × forward):
    6·L·(4h² + (g+1)·h·f) for the projections (g = 2 for a gated FFN's doubled first linear, else 1)
    and 12·h·Σ_layers k_l for q·kᵀ and p·v, k_l the keys a query attends to (`attended_keys`: s in a
    global layer, the window in a local one; bidirectional: not halved); a shared layer (ALBERT)
    counts every application, a factorized embedding its e -> h projection."""
    h, f, L, e = model.hidden_size, model.ffn_hidden_size, model.num_layers, model.embedding_dim
    g = 2 if model.gated_ffn else 1
    attention = 12 * h * sum(attended_keys(model, seq_length))
    return 6 * L * (4 * h * h + (g + 1) * h * f) + attention + (6 * e * h if e != h else 0)


def encoder_parameter_count(model: ModelConfig, input_size: int | None = None) -> int:
    """Parameters of the Encoder from the architecture alone (vocabulary padding excluded; a shared
    layer once); with `input_size`, the encoder without an embedding of its own (reading embeddings
    of that width)."""
    h, f, e, V = model.hidden_size, model.ffn_hidden_size, model.embedding_dim, model.vocab_size
    b = int(model.bias)
    g = 2 if model.gated_ffn else 1
    norm = functools.partial(norm_parameter_count, model)
    if input_size is None:
        count = V * e
        if model.position == "learned":
            count += (model.max_positions + model.pad_token_id + 1) * e
        if model.embedding_layernorm:
            count += norm(e)
        count += model.token_types * e
        input_size = e
    else:
        count = 0
    count += input_size * h + h if input_size != h else 0  # the embedding projection
    layer = (3 * h * h + 3 * h * b) + (h * h + h * b) + (h * g * f + g * f * b) + (f * h + h * b) + 2 * norm(h)
    count += (1 if model.share_layers else model.num_layers) * layer
    if model.layernorm == "pre":
        count += norm(h) - (0 if model.first_layer_norm else norm(h))  # the final norm; layer 0's
    if model.position == "alibi" and model.alibi_mode == "learned":
        count += 2 * model.num_attention_heads
    return count


class Encoder(nn.Module):
    """A RoBERTa-style encoder, tensor-parallel over `ctx.tp_group`.

    `initialize=False` leaves the weights unset for a subclass that adds heads first and then calls
    `initialize` once over all of them. `input_size` builds an encoder without a token embedding of
    its own: it reads embeddings [s, b, input_size] made by another encoder's (ELECTRA's generator
    shares the discriminator's). Embeddings narrower or wider than the hidden size (that input_size,
    or ALBERT's model.embedding_size) pass a linear projection first."""

    @staticmethod
    def unsupported_here(model: ModelConfig) -> str | None:
        """Why this machine cannot run `model` (checked by training before any long work), or None."""
        return (ATTENTION_BACKENDS[model.attention_backend].unsupported_here(model)
                or bias_activation.unsupported_here(model))

    def __init__(self, model: ModelConfig, ctx: ParallelContext, seed: int = 1,
                 params_dtype: torch.dtype = torch.float32, *, initialize: bool = True,
                 input_size: int | None = None):
        super().__init__()
        if (problem := Encoder.unsupported_here(model)) is not None:
            raise ConfigError(problem)
        self.config = model
        self.ctx = ctx
        tcfg = transformer_config(model, ctx.tp_size, params_dtype)
        self.padded_vocab_size = model.padded_vocab_size(ctx.tp_size)
        position = build_position(model, ctx.tp_rank, ctx.tp_size)
        if input_size is None:
            self.embedding = TokenEmbedding(model, tcfg, ctx.tp_group, self.padded_vocab_size,
                                            position if position.input_term else None)
            input_size = model.embedding_dim
        else:  # the embedding (and any position table in it) is the other encoder's
            self.embedding = None
        # embeddings of another width (ALBERT's factorized E, ELECTRA's generator) -> hidden_size
        self.embedding_projection = (nn.Linear(input_size, model.hidden_size)
                                     if input_size != model.hidden_size else None)
        self.alibi = position if isinstance(position, Alibi) else None  # wave 1's name: alibi.log_slopes
        self.attention = ATTENTION_BACKENDS[model.attention_backend].from_config(model, position)
        self.encoder = TransformerBlock(tcfg, encoder_block_spec(model, self.attention),
                                        post_layer_norm=model.layernorm == "pre",
                                        pg_collection=ctx.pg_collection)
        if initialize:
            self.initialize(seed, params_dtype)

    def initialize(self, seed: int, params_dtype: torch.dtype = torch.float32) -> None:
        """Mark megatron's sharded weights, draw every parameter (init.py) and move to the device."""
        for name, sub in self.named_modules():  # megatron sets these only inside its own init, which we skip
            if isinstance(sub, ColumnParallelLinear):
                stride = shard_stride(f"{name}.weight", self.config)  # a gated FFN's first linear: 2 halves
                set_tensor_model_parallel_attributes(sub.weight, True, 0, stride)
                if sub.bias is not None:  # megatron marked it already, with stride 1
                    sub.bias.partition_stride = stride
            elif isinstance(sub, RowParallelLinear):
                set_tensor_model_parallel_attributes(sub.weight, True, 1, 1)
            elif isinstance(sub, VocabParallelEmbedding):
                mark_vocab_parallel(sub.weight)
        init_parameters(self, self.config, seed, self.ctx.tp_rank, self.ctx.tp_size)
        self.to(device=self.ctx.device, dtype=params_dtype)

    def parameter_count(self) -> int:
        """Parameters of the whole model (all TP ranks together), vocabulary padding excluded."""
        return parameter_count(self, self.ctx.tp_size, self.config.vocab_size)

    def hidden_states(self, tokens: torch.Tensor, documents: torch.Tensor | None = None,
                      segments: torch.Tensor | None = None, embedded: torch.Tensor | None = None,
                      host_layout: tuple | None = None) -> torch.Tensor:
        """tokens [b, s] -> last-layer features [s, b, h]. `documents` [b, s] (document index, -1 on
        padding) keeps attention within each document, used only with model.document_mask;
        `segments` [b, s] marks the samples of packed rows (Batch.segments; None: one per row);
        `embedded` [s, b, input_size]: the tokens' embeddings, for an encoder built with input_size;
        `host_layout`: (tokens, documents, segments) on the CPU with the same padding (Batch.host_layout),
        where the attention inputs read the layout's sizes without waiting for the device (None: from
        the device's)."""
        padding = tokens.eq(self.config.pad_token_id)
        x = self.embedding(tokens, padding, segments) if embedded is None else embedded
        if self.embedding_projection is not None:
            x = self.embedding_projection(x)  # [s, b, e] -> [s, b, h]
        documents = documents if self.config.document_mask else None
        host = None
        if host_layout is not None:
            host_tokens, host_documents, host_segments = host_layout
            host = (host_tokens.eq(self.config.pad_token_id), host_documents if documents is not None else None,
                    host_segments)
        prepared = self.attention.prepare_layers(self.config.layer_attention(), padding, documents, segments,
                                                 x.dtype, host)
        # megatron's attention_mask slot carries the backend's prepared inputs per pattern (attention.py);
        # a shared layer (ALBERT) is a one-layer block applied num_layers times
        for _ in range(self.config.num_layers if self.config.share_layers else 1):
            x = self.encoder(hidden_states=x, attention_mask=prepared)
        return x

    forward = hidden_states
