"""MaskedLM: token embedding -> megatron-core TransformerBlock -> prediction head.

Shapes: b batch, s sequence, h hidden, np heads on this rank, V_local vocab rows on this rank,
n selected (masked) positions. Token ids are fairseq dictionary ids, padding = pad_token_id.

    logits_local = model(tokens [b, s], masked_positions [b, s] bool)   # [n, V_local] (training)
    loss = model.loss(logits_local, tokens_target[masked_positions])     # mean CE in nats
    logits = model.gather_logits(logits_local)                            # [n, vocab_size]
    logits = model(tokens)                                  # [b, s, vocab_size], every position

Inference from a model folder (trained, or converted from fairseq): megamlm.from_pretrained
(model/folder.py; the model itself knows nothing about folders or process groups).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
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
from megamlm.model.attention import flex_block_mask
from megamlm.model.embedding import TokenEmbedding
from megamlm.model.heads import ClapHead, RobertaLMHead, mark_vocab_parallel
from megamlm.model.init import init_parameters
from megamlm.model.layer import encoder_layer_spec
from megamlm.model.positions import Alibi
from megamlm.parallel import ParallelContext


def transformer_config(model: ModelConfig, tp_size: int,
                       params_dtype: torch.dtype = torch.float32) -> TransformerConfig:
    """megatron-core's config for our encoder. Fusions that need apex/CUDA kernels stay off;
    initialization is ours (TP-invariant, see init.py), so megatron's is skipped."""
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        ffn_hidden_size=model.ffn_hidden_size,
        kv_channels=model.head_dim,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        layernorm_epsilon=model.layernorm_epsilon,
        add_bias_linear=True,
        gated_linear_unit=False,
        activation_func=F.gelu,
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


def _mark_megatron_weights(module: nn.Module) -> None:
    """megatron sets TP attributes on weights only inside its own init, which we skip."""
    for sub in module.modules():
        if isinstance(sub, ColumnParallelLinear):
            set_tensor_model_parallel_attributes(sub.weight, True, 0, 1)
        elif isinstance(sub, RowParallelLinear):
            set_tensor_model_parallel_attributes(sub.weight, True, 1, 1)
        elif isinstance(sub, VocabParallelEmbedding):
            mark_vocab_parallel(sub.weight)


def perplexity(loss: float) -> float:
    """exp(MLM loss in nats), capped at e^50 so that a diverged loss still prints as a number."""
    return math.exp(min(loss, 50.0))


class MaskedLM(nn.Module):
    """A RoBERTa-style encoder with an MLM head, tensor-parallel over `ctx.tp_group`."""

    @staticmethod
    def unsupported_here(model: ModelConfig) -> str | None:
        """Why this machine cannot run `model` (checked by training before any long work), or None."""
        if model.attention_backend == "flex" and not torch.cuda.is_available():
            return ("model.attention_backend=flex needs a CUDA GPU (torch 2.13 has no FlexAttention "
                    "backward on CPU); use model.attention_backend=sdpa")
        return None

    def __init__(self, model: ModelConfig, ctx: ParallelContext, seed: int = 1,
                 params_dtype: torch.dtype = torch.float32):
        super().__init__()
        if (problem := MaskedLM.unsupported_here(model)) is not None:
            raise ConfigError(problem)
        self.config = model
        self.ctx = ctx
        tcfg = transformer_config(model, ctx.tp_size, params_dtype)
        self.padded_vocab_size = model.padded_vocab_size(ctx.tp_size)
        self.embedding = TokenEmbedding(model, tcfg, ctx.tp_group, self.padded_vocab_size)
        self.alibi = (Alibi(model.num_attention_heads, model.alibi_mode, ctx.tp_rank, ctx.tp_size)
                      if model.position == "alibi" else None)
        self.encoder = TransformerBlock(tcfg, encoder_layer_spec(model),
                                        post_layer_norm=model.layernorm == "pre",
                                        pg_collection=ctx.pg_collection)
        vocab_local = self.padded_vocab_size // ctx.tp_size
        self.lm_head = (ClapHead(model, ctx.tp_group) if model.head == "clap"
                        else RobertaLMHead(model, vocab_local, ctx.tp_group))
        # columns of this rank that are vocabulary padding must never take probability mass: -inf
        first = self.embedding.word_embeddings.vocab_start_index
        padded = torch.arange(first, first + vocab_local) >= model.vocab_size
        self.register_buffer("column_bias", torch.zeros(vocab_local).masked_fill(padded, float("-inf")),
                             persistent=False)
        _mark_megatron_weights(self)
        init_parameters(self, model, seed, ctx.tp_rank, ctx.tp_size)
        self.to(device=ctx.device, dtype=params_dtype)

    def parameter_count(self) -> int:
        """Parameters of the whole model (all TP ranks together), vocabulary padding excluded."""
        total = 0
        for param in self.parameters():
            shape = list(param.shape)
            if getattr(param, "tensor_model_parallel", False):
                shape[param.partition_dim] *= self.ctx.tp_size
            if getattr(param, "vocab_parallel", False):
                shape[0] = self.config.vocab_size
            total += math.prod(shape)
        return total

    def _attention_inputs(self, padding: torch.Tensor, dtype: torch.dtype,
                          documents: torch.Tensor | None):
        """(attention_mask, attention_bias) for the core attention; see attention.py.
        documents [b, s]: document index of each position (-1 on padding) when samples pack
        several documents and attention must stay within each (model.document_mask)."""
        b, s = padding.shape
        if self.config.attention_backend == "flex":
            groups = documents if documents is not None else padding.long().neg()  # -1 on padding
            slopes = None if self.alibi is None else torch.stack(self.alibi.slopes_before_after())
            return flex_block_mask(groups), slopes
        # [b, s] -> [b, 1, 1, s]: -inf on padded keys
        bias = torch.zeros(b, 1, 1, s, dtype=dtype, device=padding.device)
        bias = bias.masked_fill(padding[:, None, None, :], float("-inf"))
        if documents is not None:
            # [b, 1, s, 1] vs [b, 1, 1, s] -> [b, 1, s, s]: real queries see only their document
            query_doc, key_doc = documents[:, None, :, None], documents[:, None, None, :]
            bias = bias.masked_fill((query_doc >= 0) & (query_doc != key_doc), float("-inf"))
        if self.alibi is not None:
            # [b, 1, s|1, s] + [1, np, s, s] -> [b, np, s, s], shared by all layers
            bias = bias + self.alibi(s, dtype)[None]
        return None, bias

    def hidden_states(self, tokens: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s] -> last-layer features [s, b, h] (also used by fine-tuning heads);
        `documents` is used only with model.document_mask."""
        padding = tokens.eq(self.config.pad_token_id)
        x = self.embedding(tokens, padding)
        mask, bias = self._attention_inputs(padding, x.dtype, documents if self.config.document_mask else None)
        return self.encoder(hidden_states=x, attention_mask=mask, attention_bias=bias)

    def forward(self, tokens: torch.Tensor, masked_positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """Training: masked_positions selects positions in row-major (b, s) order, either as a
        [b, s] bool mask or as the [n] flat indices b_i * s + s_i (what the loader provides: selecting
        by a mask has to wait for the device to count it, a host sync in the middle of the forward);
        the result is this rank's vocabulary shard [n, V_local] (padded columns -inf), ready for `loss`.
        Inference: without masked_positions, logits at every position over the whole vocabulary,
        [b, s, vocab_size] (gathered over tensor-parallel ranks; differentiable only at TP=1).
        """
        hidden = self.hidden_states(tokens, documents)  # [s, b, h]
        if masked_positions is None:
            features = hidden.transpose(0, 1).reshape(-1, hidden.size(-1))  # [s, b, h] -> [b*s, h]
        else:
            if masked_positions.dtype == torch.bool:
                masked_positions = masked_positions.flatten().nonzero().squeeze(1)
            s = tokens.size(1)
            features = hidden[masked_positions % s, masked_positions // s]  # [n, h]
        logits = self.lm_head(features, self.embedding.word_embeddings.weight, self.column_bias)
        if masked_positions is None:
            # [b*s, V] -> [b, s, V]
            return self.gather_logits(logits).view(*tokens.shape, -1)
        return logits

    def loss(self, logits_local: torch.Tensor, targets: torch.Tensor,
             reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy (nats) over the selected positions, mean or sum; targets [n] are real ids."""
        # copy: megatron's kernel subtracts the max in place
        logits = logits_local.to(torch.float32, copy=True)
        losses = vocab_parallel_cross_entropy(logits, targets)
        return losses.sum() if reduction == "sum" else losses.mean()

    def gather_logits(self, logits_local: torch.Tensor) -> torch.Tensor:
        """[..., V_local] shards -> [..., vocab_size] on every rank (padding columns dropped), for
        evaluation and inference (megatron's gather allocates on CUDA, this one on any device)."""
        if self.ctx.tp_size == 1:
            return logits_local[..., : self.config.vocab_size]
        with torch.no_grad():
            shards = [torch.empty_like(logits_local) for _ in range(self.ctx.tp_size)]
            dist.all_gather(shards, logits_local.contiguous(), group=self.ctx.tp_group)
            return torch.cat(shards, dim=-1)[..., : self.config.vocab_size]
