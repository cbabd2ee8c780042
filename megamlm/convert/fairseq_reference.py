"""The fork's RoBERTa forward written directly against a fairseq state dict and cfg.

An implementation independent of megamlm's model code (no megatron, no shared helpers), following
the reference semantics (../shared/reference/fairseq-alibi-clap.md sections 1-2): it is the "fairseq
side" of every conversion's parity check, since fairseq itself does not install beside torch 2.x.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _get(m: dict, name: str, default):
    value = m.get(name)
    return default if value is None else value


def fairseq_alibi_slopes(n: int) -> list[float]:
    """fairseq/utils.py `alibi` slopes (Press et al.), head order as in the fork."""
    def power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        return [start * start ** i for i in range(n)]
    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + fairseq_alibi_slopes(2 * closest)[0::2][: n - closest]


def _positions(padding: torch.Tensor, pad: int) -> torch.Tensor:
    """fairseq make_positions: first real token at pad + 1, padding at pad."""
    keep = (~padding).long()
    return torch.cumsum(keep, dim=1) * keep + pad


def _sinusoidal(num: int, dim: int, pad: int) -> torch.Tensor:
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float) * -(math.log(10000) / (half - 1)))
    angles = torch.arange(num, dtype=torch.float)[:, None] * freq[None]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(num, 1)], dim=1)
    table[pad] = 0
    return table


@torch.no_grad()
def fairseq_logits(state: dict[str, torch.Tensor], model_cfg: dict, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [b, t] (fairseq ids, pad 1) -> logits [b, t, V] in float32, eval mode."""
    w = {k.removeprefix("encoder."): v.float() for k, v in state.items() if k.startswith("encoder.")}
    pad = 1
    E = w["sentence_encoder.embed_tokens.weight"]
    V, C = E.shape
    H = int(_get(model_cfg, "encoder_attention_heads", 12))
    d = C // H
    clap = bool(_get(model_cfg, "contrastive_pretraining", False))
    zero_masking = bool(_get(model_cfg, "zero_masking", False))
    b, t = tokens.shape

    src = tokens
    if zero_masking:
        is_mask = src >= V
        src = src.clamp(max=V - 1)
    padding = src.eq(pad)
    x = E[src]
    if clap and _get(model_cfg, "l2norm_embedding", True):
        x = F.normalize(x, dim=-1)
    if zero_masking:
        x = x * (~is_mask)[..., None]
    if not _get(model_cfg, "no_scale_embedding", True):
        x = x * math.sqrt(C)
    alibi = bool(_get(model_cfg, "encoder_alibi", False))
    if not alibi and not _get(model_cfg, "no_token_positional_embeddings", False):
        positions = _positions(padding, pad)
        if _get(model_cfg, "encoder_learned_pos", True):
            x = x + w["sentence_encoder.embed_positions.weight"][positions]
        else:
            x = x + _sinusoidal(int(positions.max()) + 1, C, pad)[positions]
    if "sentence_encoder.layernorm_embedding.weight" in w:
        x = F.layer_norm(x, (C,), w["sentence_encoder.layernorm_embedding.weight"],
                         w["sentence_encoder.layernorm_embedding.bias"], 1e-5)
    x = x * (~padding)[..., None]

    bias = torch.zeros(H, t, t)
    # ALiBi written as the fork writes it, not megamlm's alibi_score: this is the independent oracle
    if alibi:
        rel = (torch.arange(t)[None, :] - torch.arange(t)[:, None]).abs().float()
        if _get(model_cfg, "encoder_alibi_asymmetrical", False):
            rel = rel - 0.5 * torch.triu(torch.ones(t, t), diagonal=1)
        bias = -torch.tensor(fairseq_alibi_slopes(H))[:, None, None] * rel[None]
    bias = bias[None].expand(b, H, t, t).masked_fill(padding[:, None, None, :], float("-inf"))

    pre = bool(_get(model_cfg, "encoder_normalize_before", False))
    layers = int(_get(model_cfg, "encoder_layers", 12))

    def ln(x, name):
        return F.layer_norm(x, (C,), w[f"{name}.weight"], w[f"{name}.bias"], 1e-5)

    def lin(x, name):
        return F.linear(x, w[f"{name}.weight"], w[f"{name}.bias"])

    for i in range(layers):
        p = f"sentence_encoder.layers.{i}"
        residual = x
        if pre:
            x = ln(x, f"{p}.self_attn_layer_norm")
        q = lin(x, f"{p}.self_attn.q_proj") * d ** -0.5
        k, v = lin(x, f"{p}.self_attn.k_proj"), lin(x, f"{p}.self_attn.v_proj")
        q, k, v = (z.view(b, t, H, d).transpose(1, 2) for z in (q, k, v))
        attn = torch.softmax(q @ k.transpose(-1, -2) + bias, dim=-1) @ v
        x = residual + lin(attn.transpose(1, 2).reshape(b, t, C), f"{p}.self_attn.out_proj")
        if not pre:
            x = ln(x, f"{p}.self_attn_layer_norm")
        residual = x
        if pre:
            x = ln(x, f"{p}.final_layer_norm")
        x = residual + lin(F.gelu(lin(x, f"{p}.fc1")), f"{p}.fc2")
        if not pre:
            x = ln(x, f"{p}.final_layer_norm")
    if pre:
        x = ln(x, "sentence_encoder.layer_norm")

    out = w.get("lm_head.weight", E)
    if clap:
        return w["lm_head.beta"] * F.linear(x, F.normalize(out, dim=-1))
    x = F.layer_norm(F.gelu(lin(x, "lm_head.dense")), (C,), w["lm_head.layer_norm.weight"],
                     w["lm_head.layer_norm.bias"], 1e-5)
    return F.linear(x, out, w["lm_head.bias"])
