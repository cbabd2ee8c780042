"""megamlm encoders for Hugging Face `transformers` (trust_remote_code): every positional encoding
(learned, sinusoidal, none, ALiBi symmetric / offset / learned), both heads (RoBERTa, CLAP), and
BERT's / ALBERT's parts (token types, a factorized embedding, a shared layer, tanh GELU).

Standalone (torch + transformers only); parameter names are megamlm's full (TP=1) names, so an
exported model.safetensors is megamlm's state dict. Token ids are fairseq dictionary ids (pad 1).
"""

import contextlib
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput


class MegamlmConfig(PretrainedConfig):
    model_type = "megamlm"

    def __init__(self, megamlm=None, **kwargs):
        self.megamlm = dict(megamlm or {})
        """megamlm's `model:` config section, verbatim."""
        kwargs.setdefault("pad_token_id", self.megamlm.get("pad_token_id", 1))
        kwargs.setdefault("bos_token_id", 0)
        kwargs.setdefault("eos_token_id", 2)
        super().__init__(**kwargs)


def embedding_dim(m):
    return m.get("embedding_size") or m["hidden_size"]


def activation(m):
    return functools.partial(F.gelu, approximate="tanh") if m.get("activation") == "gelu_tanh" else F.gelu


# ALiBi is copied here, not imported from megamlm.model.positions: this file ships alone with exported
# models and must load in transformers without megamlm installed
def alibi_slopes(n):
    def power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        return [start * start ** i for i in range(n)]
    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + alibi_slopes(2 * closest)[0::2][: n - closest]


class Alibi(nn.Module):
    """Bias [np, s, s] added to q·k/√d: -m·(i-j) for keys before the query, -m·(j-i-offset) after."""

    def __init__(self, heads, mode):
        super().__init__()
        self.heads, self.mode = heads, mode
        if mode == "learned":
            self.log_slopes = nn.Parameter(torch.tensor(alibi_slopes(heads)).log().repeat(2, 1))

    def forward(self, length, device):
        # fixed slopes are computed here, not kept in a buffer: transformers builds the model on the
        # meta device and only restores what the checkpoint holds
        if self.mode == "learned":
            s_before, s_after = self.log_slopes.exp()
        else:
            s_before = s_after = torch.tensor(alibi_slopes(self.heads), device=device)
        i = torch.arange(length, device=device)
        rel = (i[None, :] - i[:, None]).float()  # key - query
        offset = 0.5 if self.mode == "offset" else 0.0
        return torch.where(rel <= 0, s_before[:, None, None] * rel, -s_after[:, None, None] * (rel - offset))


class Embedding(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m
        e = embedding_dim(m)
        self.word_embeddings = nn.Embedding(m["vocab_size"], e)
        if m["position"] == "learned":
            self.positions = nn.Embedding(m["max_positions"] + m["pad_token_id"] + 1, e)
        if m.get("token_types", 0):
            self.token_types = nn.Embedding(m["token_types"], e)
        self.layernorm = nn.LayerNorm(e, eps=m["layernorm_epsilon"]) if m["embedding_layernorm"] else None

    def forward(self, tokens, padding):
        m = self.m
        if m["zero_mask"]:
            is_mask = tokens >= m["vocab_size"]
            tokens = tokens.clamp(max=m["vocab_size"] - 1)
        e = self.word_embeddings(tokens)
        if m["normalize_embeddings"]:
            e = F.normalize(e, dim=-1)
        if m["zero_mask"]:
            e = e * ~is_mask[..., None]
        x = e * (math.sqrt(embedding_dim(m)) if m["scale_embeddings"] else 1.0)
        keep = (~padding).long()
        positions = torch.cumsum(keep, dim=1) * keep + m["pad_token_id"]  # fairseq make_positions
        if m["position"] == "learned":
            x = x + self.positions(positions)
        elif m["position"] == "sinusoidal":
            half = embedding_dim(m) // 2
            freq = torch.exp(torch.arange(half, device=x.device, dtype=torch.float) * -(math.log(10000) / (half - 1)))
            angles = positions.float()[..., None] * freq
            table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)
            if embedding_dim(m) % 2:
                table = F.pad(table, (0, 1))
            x = x + table * ~padding[..., None]
        if m.get("token_types", 0):  # type = separators before the token (BERT: A 0, B 1)
            separators = tokens.eq(m["separator_token_id"]).long()
            types = (torch.cumsum(separators, dim=1) - separators).clamp(max=m["token_types"] - 1)
            x = x + self.token_types(types)
        if self.layernorm is not None:
            x = self.layernorm(x)
        return x * ~padding[..., None]


def sdpa_kernels(device_type, key_length, masked):
    """SDPA's kernels for these keys: torch's choice, except cuDNN's where it is wrong. From torch 2.11
    on Hopper, cuDNN's backward with a mask returns NaN in dQ when the key length is 64 mod 128 and a
    query's log-sum-exp is below -88.7 (pytorch#196678), which ALiBi gives padded queries; such batches
    run on the memory-efficient kernel. A copy of megamlm.model.attention.sdpa_kernels (this file
    imports only torch and transformers; tests/test_attention.py checks that the two agree)."""
    if device_type == "cuda" and masked and key_length % 128 == 64:
        return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])
    return contextlib.nullcontext()


class SelfAttention(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.heads, h = m["num_attention_heads"], m["hidden_size"]
        self.linear_qkv = nn.Linear(h, 3 * h)
        self.linear_proj = nn.Linear(h, h)

    def forward(self, x, bias):
        b, s, h = x.shape
        # megatron's fused layout: [b, s, 3h] -> [b, s, np, 3, hn] -> q, k, v [b, np, s, hn]
        q, k, v = self.linear_qkv(x).view(b, s, self.heads, 3, -1).permute(3, 0, 2, 1, 4)
        with sdpa_kernels(q.device.type, k.size(-2), bias is not None):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.linear_fc1 = nn.Linear(m["hidden_size"], m["ffn_hidden_size"])
        self.linear_fc2 = nn.Linear(m["ffn_hidden_size"], m["hidden_size"])
        self.activation = activation(m)

    def forward(self, x):
        return self.linear_fc2(self.activation(self.linear_fc1(x)))


class Layer(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.pre = m["layernorm"] == "pre"
        h, eps = m["hidden_size"], m["layernorm_epsilon"]
        first, second = (("input_layernorm", "pre_mlp_layernorm") if self.pre
                         else ("post_attention_layernorm", "post_mlp_layernorm"))
        self.self_attention, self.mlp = SelfAttention(m), MLP(m)
        self.norms = (first, second)
        setattr(self, first, nn.LayerNorm(h, eps=eps))
        setattr(self, second, nn.LayerNorm(h, eps=eps))

    def forward(self, x, bias):
        first, second = (getattr(self, n) for n in self.norms)
        if self.pre:
            x = x + self.self_attention(first(x), bias)
            return x + self.mlp(second(x))
        x = first(x + self.self_attention(x, bias))
        return second(x + self.mlp(x))


class Encoder(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.applications = m["num_layers"]
        self.layers = nn.ModuleList(Layer(m) for _ in range(1 if m.get("share_layers") else m["num_layers"]))
        self.final_layernorm = (nn.LayerNorm(m["hidden_size"], eps=m["layernorm_epsilon"])
                                if m["layernorm"] == "pre" else None)

    def forward(self, x, bias):
        for i in range(self.applications):
            x = self.layers[i % len(self.layers)](x, bias)  # a shared layer (ALBERT) every time
        return x if self.final_layernorm is None else self.final_layernorm(x)


class Head(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.clap = m["head"] == "clap"
        h, e, v = m["hidden_size"], embedding_dim(m), m["vocab_size"]
        if self.clap:
            self.beta = nn.Parameter(torch.ones(1))
        else:
            self.dense = nn.Linear(h, e)
            self.activation = activation(m)
            self.layernorm = nn.LayerNorm(e, eps=m["layernorm_epsilon"])
            self.bias = nn.Parameter(torch.zeros(v))
            if not m["tie_embeddings"]:
                self.weight = nn.Parameter(torch.zeros(v, e))

    def forward(self, x, embedding):
        if self.clap:
            return self.beta * F.linear(x, F.normalize(embedding, dim=-1))
        weight = getattr(self, "weight", embedding)
        return F.linear(self.layernorm(self.activation(self.dense(x))), weight, self.bias)


class MegamlmForMaskedLM(PreTrainedModel):
    config_class = MegamlmConfig
    base_model_prefix = "megamlm"

    def __init__(self, config):
        super().__init__(config)
        m = config.megamlm
        self.embedding = Embedding(m)
        if embedding_dim(m) != m["hidden_size"]:
            self.embedding_projection = nn.Linear(embedding_dim(m), m["hidden_size"])
        self.alibi = Alibi(m["num_attention_heads"], m["alibi_mode"]) if m["position"] == "alibi" else None
        self.encoder = Encoder(m)
        self.lm_head = Head(m)
        self.post_init()

    def _init_weights(self, module):
        pass  # weights always come from the exported checkpoint

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        """input_ids [b, s] fairseq ids -> logits [b, s, vocab_size] at every position."""
        m = self.config.megamlm
        padding = input_ids.eq(m["pad_token_id"])
        if attention_mask is not None:
            padding = padding | attention_mask.eq(0)
        x = self.embedding(input_ids, padding)
        if embedding_dim(m) != m["hidden_size"]:
            x = self.embedding_projection(x)
        b, s = input_ids.shape
        bias = torch.zeros(b, 1, 1, s, dtype=x.dtype, device=x.device).masked_fill(
            padding[:, None, None, :], float("-inf"))
        if self.alibi is not None:
            bias = bias + self.alibi(s, x.device).to(x.dtype)[None]  # [b, 1, 1, s] + [1, np, s, s]
        logits = self.lm_head(self.encoder(x, bias), self.embedding.word_embeddings.weight)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)
        return MaskedLMOutput(loss=loss, logits=logits)
