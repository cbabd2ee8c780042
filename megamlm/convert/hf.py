"""Hugging Face `RobertaForMaskedLM` <-> megamlm key table (full TP=1 tensors), both directions.

One declarative table maps each HF key to a megamlm key; the only non-renaming steps are
megatron's fused QKV (per head [q_h; k_h; v_h] rows) and HF's token-type embedding (RoBERTa has a
single type, so its row 0 is a constant added to every position: folded into the position table).
"""

from __future__ import annotations

import torch

from megamlm.config import ModelConfig

# (HF key, megamlm key); {i} is the layer index
HF_ROBERTA_KEYS: list[tuple[str, str]] = [
    ("roberta.embeddings.word_embeddings.weight", "embedding.word_embeddings.weight"),
    ("roberta.embeddings.position_embeddings.weight", "embedding.positions.weight"),
    ("roberta.embeddings.LayerNorm.weight", "embedding.layernorm.weight"),
    ("roberta.embeddings.LayerNorm.bias", "embedding.layernorm.bias"),
    ("roberta.encoder.layer.{i}.attention.output.dense.weight",
     "encoder.layers.{i}.self_attention.linear_proj.weight"),
    ("roberta.encoder.layer.{i}.attention.output.dense.bias",
     "encoder.layers.{i}.self_attention.linear_proj.bias"),
    ("roberta.encoder.layer.{i}.attention.output.LayerNorm.weight",
     "encoder.layers.{i}.post_attention_layernorm.weight"),
    ("roberta.encoder.layer.{i}.attention.output.LayerNorm.bias",
     "encoder.layers.{i}.post_attention_layernorm.bias"),
    ("roberta.encoder.layer.{i}.intermediate.dense.weight", "encoder.layers.{i}.mlp.linear_fc1.weight"),
    ("roberta.encoder.layer.{i}.intermediate.dense.bias", "encoder.layers.{i}.mlp.linear_fc1.bias"),
    ("roberta.encoder.layer.{i}.output.dense.weight", "encoder.layers.{i}.mlp.linear_fc2.weight"),
    ("roberta.encoder.layer.{i}.output.dense.bias", "encoder.layers.{i}.mlp.linear_fc2.bias"),
    ("roberta.encoder.layer.{i}.output.LayerNorm.weight", "encoder.layers.{i}.post_mlp_layernorm.weight"),
    ("roberta.encoder.layer.{i}.output.LayerNorm.bias", "encoder.layers.{i}.post_mlp_layernorm.bias"),
    ("lm_head.dense.weight", "lm_head.dense.weight"),
    ("lm_head.dense.bias", "lm_head.dense.bias"),
    ("lm_head.layer_norm.weight", "lm_head.layernorm.weight"),
    ("lm_head.layer_norm.bias", "lm_head.layernorm.bias"),
    ("lm_head.bias", "lm_head.bias"),
]
HF_QKV = "roberta.encoder.layer.{i}.attention.self.{part}.{kind}"
MEGAMLM_QKV = "encoder.layers.{i}.self_attention.linear_qkv.{kind}"
HF_TOKEN_TYPE = "roberta.embeddings.token_type_embeddings.weight"


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Separate q, k, v ([h, ...] rows, heads contiguous) -> megatron's fused per-head layout."""
    # [h, ...] -> [np, hn, ...] each; stack -> [np, 3, hn, ...] -> [3h, ...]
    parts = [t.reshape(num_heads, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.stack(parts, dim=1).reshape(-1, *q.shape[1:])


def split_qkv(qkv: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron's fused per-head QKV -> separate q, k, v ([h, ...] rows, heads contiguous)."""
    # [3h, ...] -> [np, 3, hn, ...]; each [:, j] -> [h, ...]
    grouped = qkv.reshape(num_heads, 3, -1, *qkv.shape[1:])
    return tuple(grouped[:, j].reshape(-1, *qkv.shape[1:]) for j in range(3))


def _rename(state: dict[str, torch.Tensor], pairs, num_layers: int) -> dict[str, torch.Tensor]:
    """Apply (source key, target key) pairs; pairs with {i} once per layer."""
    return {dst.format(i=i): state[src.format(i=i)] for src, dst in pairs
            for i in (range(num_layers) if "{i}" in src else [None])}


def hf_roberta_to_megamlm(hf_state: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """A RobertaForMaskedLM state dict -> full megamlm tensors for a post-LN `roberta` head model."""
    out = _rename(hf_state, HF_ROBERTA_KEYS, model.num_layers)
    for i in range(model.num_layers):
        for kind in ("weight", "bias"):
            q, k, v = (hf_state[HF_QKV.format(i=i, part=p, kind=kind)] for p in ("query", "key", "value"))
            out[MEGAMLM_QKV.format(i=i, kind=kind)] = fuse_qkv(q, k, v, model.num_attention_heads)
    if HF_TOKEN_TYPE in hf_state:
        out["embedding.positions.weight"] = out["embedding.positions.weight"] + hf_state[HF_TOKEN_TYPE][0]
    return out


def megamlm_to_hf_roberta(full: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse: full megamlm tensors -> RobertaForMaskedLM's state dict (tied decoder included)."""
    out = _rename(full, [(ours, theirs) for theirs, ours in HF_ROBERTA_KEYS], model.num_layers)
    for i in range(model.num_layers):
        for kind in ("weight", "bias"):
            parts = split_qkv(full[MEGAMLM_QKV.format(i=i, kind=kind)], model.num_attention_heads)
            for name, tensor in zip(("query", "key", "value"), parts):
                out[HF_QKV.format(i=i, part=name, kind=kind)] = tensor
    out[HF_TOKEN_TYPE] = torch.zeros(1, model.hidden_size)  # RoBERTa's single token type, folded away
    out["lm_head.decoder.weight"] = full["embedding.word_embeddings.weight"]
    out["lm_head.decoder.bias"] = full["lm_head.bias"]
    return out
