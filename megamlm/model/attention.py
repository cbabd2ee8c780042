"""Bidirectional core attention plugged into megatron-core's SelfAttention through the layer spec.

megatron-core's DotProductAttention needs CUDA (global memory buffer) and has no path for an
additive bias, so this module replaces it. It receives this rank's heads only:
query/key/value [s, b, np, hn] and returns [s, b, np * hn].

Backends
  sdpa  `attention_bias` is an additive float tensor broadcastable to [b, np, s, s]: the
        shard's ALiBi bias plus -inf on padded keys, built once per forward by the encoder and
        shared by every layer.
  flex  FlexAttention: ALiBi is a `score_mod` and key padding / document boundaries a BlockMask,
        no bias is materialized and key blocks a query block cannot see are skipped.
        `attention_bias` is then the [2, np] slopes (before, after) or None, and `attention_mask`
        the BlockMask from `flex_block_mask`, built once per forward and shared by every layer.
        CUDA only for training: torch 2.13 has no FlexAttention backward on CPU.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

from megamlm.config import ConfigError
from megamlm.model.dropout import dropout
from megamlm.parallel import tensor_parallel_rng


class BidirectionalAttention(MegatronModule):
    """softmax(q·kᵀ/√hn + bias) v over this rank's heads, no causal mask."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, cp_comm_type=None,
                 softmax_scale=None, pg_collection=None, *, backend: str = "sdpa",
                 alibi_offset: float = 0.0):
        super().__init__(config=config)
        self.backend = backend
        self.alibi_offset = alibi_offset
        self.dropout_p = config.attention_dropout
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        s, b, np_local, hn = query.shape
        # [s, b, np, hn] -> [b, np, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0
        if self.backend == "flex":
            out = self._flex(q, k, v, attention_mask, attention_bias)
        else:
            # heads are sharded: each TP rank needs its own dropout stream
            with tensor_parallel_rng.fork(q.device) if dropout_p > 0 else contextlib.nullcontext():
                if dropout_p > 0 and q.device.type == "cpu":
                    out = self._cpu_attention_with_dropout(q, k, v, attention_bias)
                else:
                    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_bias, dropout_p=dropout_p,
                                                         scale=self.softmax_scale)
        # [b, np, s, hn] -> [s, b, np * hn]
        return out.permute(2, 0, 1, 3).reshape(s, b, np_local * hn)

    def _cpu_attention_with_dropout(self, q, k, v, bias):
        # On CPU, SDPA with dropout runs this same unfused math, with torch's slow dropout mask
        scale = self.softmax_scale if self.softmax_scale is not None else q.size(-1) ** -0.5
        # [b, np, s, hn] x [b, np, hn, s] -> [b, np, s, s]
        scores = torch.matmul(q * scale, k.transpose(-2, -1))
        if bias is not None:
            scores.add_(bias)  # in place: a fresh [b, np, s, s] buffer costs more than the add
        probs = dropout(torch.softmax(scores, dim=-1), self.dropout_p, training=True)
        # [b, np, s, s] x [b, np, s, hn] -> [b, np, s, hn]
        return torch.matmul(probs, v)

    def _flex(self, q, k, v, block_mask, slopes):
        if self.training and self.dropout_p > 0:
            raise ConfigError("model.attention_backend=flex has no attention dropout; "
                              "set model.attention_dropout=0 or use attention_backend=sdpa")
        offset = self.alibi_offset

        def alibi(score, b, h, q_idx, kv_idx):
            distance = kv_idx - q_idx
            before = slopes[0, h] * torch.clamp(distance, max=0)
            after = slopes[1, h] * (distance - offset)
            return score + torch.where(distance > 0, -after, before).to(score.dtype)

        return _flex_attention(q.device.type)(q, k, v, score_mod=None if slopes is None else alibi,
                                              block_mask=block_mask, scale=self.softmax_scale)


def flex_block_mask(groups: torch.Tensor):
    """[b, s] key groups (-1 on padding, else the document index; 0 when samples are not split into
    documents) -> the FlexAttention BlockMask: real queries see the real keys of their own
    document, padding queries every real key (as on the SDPA path, so no row is empty). The kernel
    skips key blocks that are all padding or all another document."""
    from torch.nn.attention.flex_attention import create_block_mask

    def visible(b, h, q_idx, kv_idx):
        query, key = groups[b, q_idx], groups[b, kv_idx]
        return (key >= 0) & ((query < 0) | (key == query))

    b, s = groups.shape
    # compiled on GPU: the eager construction materializes [b, s, s] index tensors (GiBs at 8192)
    return create_block_mask(visible, b, None, s, s, device=groups.device,
                             _compile=groups.device.type == "cuda")


@functools.cache
def _flex_attention(device_type: str):
    """Compiled FlexAttention on GPU; on CPU the eager reference (forward only), used by tests to
    check the score_mod against the materialized bias."""
    from torch.nn.attention.flex_attention import flex_attention

    # the training loader pads to one width under Flex, but evaluation, fine-tuning and inference
    # pass any width. The default (automatic dynamic shapes after the first recompile) avoids dynamo's
    # recompile limit, past which FlexAttention silently falls back to an eager path that
    # materializes the scores (seen on an H100: base at 8192 ran at 1% MFU with dynamic=False).
    return torch.compile(flex_attention) if device_type == "cuda" else flex_attention
