"""Hugging Face `RobertaForMaskedLM` <-> megamlm key table (full TP=1 tensors), both directions.

One declarative table maps each HF key to a megamlm key; the only non-renaming steps are
megatron's fused QKV (per head [q_h; k_h; v_h] rows) and HF's token-type embedding (RoBERTa has a
single type, so its row 0 is a constant added to every position: folded into the position table).
"""

from __future__ import annotations

import torch

from megamlm.config import ModelConfig
from megamlm.model import names
from megamlm.model.names import weight_and_bias

# RoBERTa is post-LN: megatron's post-LN slots
POST_LN = {"attention": names.ATTENTION_NORM.replace("{attn_norm}", names.LAYER_NORM_SLOTS["post"]["attn_norm"]),
           "mlp": names.MLP_NORM.replace("{mlp_norm}", names.LAYER_NORM_SLOTS["post"]["mlp_norm"])}
# (HF key, megamlm key); {i} is the layer index
HF_ROBERTA_KEYS: list[tuple[str, str]] = [
    ("roberta.embeddings.word_embeddings.weight", names.WORD_EMBEDDINGS),
    ("roberta.embeddings.position_embeddings.weight", names.POSITION_TABLE),
    *weight_and_bias("roberta.embeddings.LayerNorm.{kind}", names.EMBEDDING_NORM),
    *weight_and_bias("roberta.encoder.layer.{i}.attention.output.dense.{kind}", names.ATTENTION_OUT),
    *weight_and_bias("roberta.encoder.layer.{i}.attention.output.LayerNorm.{kind}", POST_LN["attention"]),
    *weight_and_bias("roberta.encoder.layer.{i}.intermediate.dense.{kind}", names.FC1),
    *weight_and_bias("roberta.encoder.layer.{i}.output.dense.{kind}", names.FC2),
    *weight_and_bias("roberta.encoder.layer.{i}.output.LayerNorm.{kind}", POST_LN["mlp"]),
    *weight_and_bias("lm_head.dense.{kind}", names.LM_HEAD_DENSE),
    *weight_and_bias("lm_head.layer_norm.{kind}", names.LM_HEAD_NORM),
    ("lm_head.bias", names.LM_HEAD_BIAS),
]
HF_QKV = "roberta.encoder.layer.{i}.attention.self.{part}.{kind}"
HF_TOKEN_TYPE = "roberta.embeddings.token_type_embeddings.weight"
HF_DECODER = "lm_head.decoder.{kind}"

# (RobertaConfig attribute, megamlm ModelConfig field); positions: fairseq's layout, 2 rows more
HF_ROBERTA_CONFIG: list[tuple[str, str]] = [
    ("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"), ("num_hidden_layers", "num_layers"),
    ("num_attention_heads", "num_attention_heads"), ("intermediate_size", "ffn_hidden_size"),
    ("hidden_dropout_prob", "hidden_dropout"), ("attention_probs_dropout_prob", "attention_dropout"),
    ("layer_norm_eps", "layernorm_epsilon"),
]
POSITION_OFFSET = 2
"""RoBERTa's position table has max_positions + 2 rows (fairseq: rows 0-1 unused, padding_idx 1)."""
HF_ROBERTA_FIXED = {"hidden_act": "gelu", "type_vocab_size": 1, "pad_token_id": 1, "bos_token_id": 0,
                    "eos_token_id": 2, "tie_word_embeddings": True}
"""What RobertaForMaskedLM must have for megamlm's baseline variant to compute the same function."""


def roberta_config_values(model: ModelConfig) -> dict:
    """RobertaConfig keyword arguments for a megamlm baseline model."""
    return {**{theirs: getattr(model, ours) for theirs, ours in HF_ROBERTA_CONFIG},
            "max_position_embeddings": model.max_positions + POSITION_OFFSET, **HF_ROBERTA_FIXED}


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
            out[names.QKV.format(i=i, kind=kind)] = fuse_qkv(q, k, v, model.num_attention_heads)
    if HF_TOKEN_TYPE in hf_state:
        out[names.POSITION_TABLE] = out[names.POSITION_TABLE] + hf_state[HF_TOKEN_TYPE][0]
    return out


def megamlm_to_hf_roberta(full: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse: full megamlm tensors -> RobertaForMaskedLM's state dict (tied decoder included)."""
    out = _rename(full, [(ours, theirs) for theirs, ours in HF_ROBERTA_KEYS], model.num_layers)
    for i in range(model.num_layers):
        for kind in ("weight", "bias"):
            parts = split_qkv(full[names.QKV.format(i=i, kind=kind)], model.num_attention_heads)
            for name, tensor in zip(("query", "key", "value"), parts):
                out[HF_QKV.format(i=i, part=name, kind=kind)] = tensor
    out[HF_TOKEN_TYPE] = torch.zeros(1, model.hidden_size)  # RoBERTa's single token type, folded away
    out[HF_DECODER.format(kind="weight")] = full[names.WORD_EMBEDDINGS]
    out[HF_DECODER.format(kind="bias")] = full[names.LM_HEAD_BIAS]
    return out
