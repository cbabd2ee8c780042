"""FlexAttention's pieces beyond the score_mod and the BlockMask: the compiled kernel with its
`kernel_options` (model.flex_kernel_options), and attention dropout.

Attention dropout, the exact post-softmax dropout from two passes. Dropout acts on the attention
probabilities, after the softmax; FlexAttention's `score_mod` acts on the scores, before it.
Dropping key j of query i there (score -> -inf) renormalizes over the kept keys. With m the keep
mask, p the drop probability and s the scores of one query:

    dropout:    out  = Σ_j e^{s_j} m_j v_j / ((1 - p) · Σ_j e^{s_j})
    score_mod:  out' = Σ_j e^{s_j} m_j v_j / Σ_j e^{s_j} m_j

so out = out' · exp(lse' - lse) / (1 - p), where lse' is the logsumexp over the kept keys (returned by
the pass that computes out') and lse the one over every key (a second pass with a 16-wide zero value:
it computes only the scores and their logsumexp, no probability-value product of head width).
FlexAttention differentiates through the logsumexp it returns, so the backward is exact too.

The mask is a hash of (seed, row, head, query, key pair): murmur3's 32-bit finalizer chained over them
gives 32 bits per query and pair of keys j and j ^ 8, 16 bits per key (`key_pair`, `key_level`); key j is
kept when its 16 bits are at or above round(p · 2^16) (dropout.py's resolution: 0.1 -> 0.100006; FlashAttention's
dropout has 8 bits). Why pairs, and why j with j ^ 8: in the Triton kernels' tiles (the MMA accumulator
layout of Hopper and Ampere, keys along either dimension) one thread holds both keys of such a pair, so one
hash serves two scores (triton_kernels.py). It runs on int32 lanes (wrapping products, masked logical
shifts): the same bits as on int64, at half the work on a CPU's vector lanes and without a GPU's
emulated 64-bit products, in the innermost loop of both passes and their backward. Nothing [s, s] is
stored; the backward pass recomputes the mask from the indices. The seed is drawn per call from the
tensor-parallel stream (`tensor_parallel_rng`, as SDPA's dropout), so each TP rank's heads get their own
masks and activation recomputation, which replays that stream, redraws the same one (compiled at TP=1:
the default generator, which torch.compile can trace and checkpointing replays; parallel.py). The masks
differ from SDPA's (its Philox stream) and from eager's: the runs agree in distribution, not bit for
bit.
"""

from __future__ import annotations

from collections.abc import Callable

import functools

import torch
from torch.nn.attention.flex_attention import FlexKernelOptions, flex_attention

from megamlm.config import ConfigError
from megamlm.model.dropout import dropped_levels, level_keep_scale
from megamlm.parallel import tensor_parallel_rng

_HASH_RANGE = 2**32
_LSE_WIDTH = 16  # the zero value's head width in the logsumexp pass: the kernels' smallest tile

ScoreMod = Callable[..., torch.Tensor]
"""FlexAttention's score_mod(score, b, h, q_idx, kv_idx) -> score."""
Attend = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""attend(q, k, v, score_mod) -> (out [b, np, s, hn], logsumexp [b, np, s] fp32): FlexAttention with
the layer's BlockMask and scale."""


def _int32(constant: int) -> int:
    """A 32-bit constant as the int32 with its bits (int32 tensors refuse larger Python ints)."""
    return constant - _HASH_RANGE if constant >= 2**31 else constant


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """The logical right shift of int32 bits (>> on int32 copies the sign bit)."""
    return (x >> n) & ((1 << (32 - n)) - 1)


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's finalizer on int32 bits (products wrap modulo 2^32): each input bit flips each
    output bit with probability about 1/2."""
    x = x ^ _shift_right(x, 16)
    x = x * _int32(0x85EBCA6B)
    x = x ^ _shift_right(x, 13)
    x = x * _int32(0xC2B2AE35)
    return x ^ _shift_right(x, 16)


def random_bits(seed: torch.Tensor, b, h, q_idx, kv_idx) -> torch.Tensor:
    """32 uniform bits (int32) per (seed < 2^31, row, head, query, key); broadcasts like the indices."""
    row_head = (b.to(torch.int32) << 16) | h.to(torch.int32)  # < 2^16 heads per rank, < 2^15 rows
    x = _fmix32(seed.to(torch.int32) ^ row_head)
    x = _fmix32(x ^ q_idx.to(torch.int32))
    return _fmix32(x ^ kv_idx.to(torch.int32))


def key_pair(kv_idx: torch.Tensor) -> torch.Tensor:
    """The index of key kv_idx's pair in the hash chain: keys j and j ^ 8 share one 32-bit hash
    ((j >> 4) << 3 | (j & 7): consecutive pairs for consecutive 16-key groups)."""
    return ((kv_idx >> 4) << 3) | (kv_idx & 7)


def key_level(bits: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    """Key kv_idx's 16 bits of its pair's hash `bits` (int32 or int64 lanes holding 32 bits): the low half
    where bit 3 of kv_idx is clear, the high half where it is set; in [0, 2^16)."""
    return (bits >> ((kv_idx & 8) << 1)) & 0xFFFF


def keep_mask(seed: torch.Tensor, p: float, b, h, q_idx, kv_idx) -> torch.Tensor:
    """True where attention dropout keeps key kv_idx of query q_idx (head h, row b)."""
    return kept_at_level(seed, dropped_levels(p), b, h, q_idx, kv_idx)


def kept_at_level(seed: torch.Tensor, dropped: int, b, h, q_idx, kv_idx) -> torch.Tensor:
    """keep_mask with the threshold `dropped_levels(p)` given as a Python int, as a score_mod captures
    it: a captured float reaches FlexAttention as a graph input that torch 2.11 refuses ("all unwrapped
    values must be FakeTensor, int, or SymInt", the attention benchmark on an H200)."""
    kv_idx = kv_idx.to(torch.int32)
    return key_level(random_bits(seed, b, h, q_idx, key_pair(kv_idx)), kv_idx) >= dropped


def keep_scale(p: float) -> float:
    """1 / the keep probability (exact for the 2^16-level threshold)."""
    return level_keep_scale(dropped_levels(p))


def draw_seed(device: torch.device) -> torch.Tensor:
    """A 31-bit seed from this TP rank's stream, on `device` (no host synchronization)."""
    with tensor_parallel_rng.fork(device):
        return torch.randint(2**31, (), device=device, dtype=torch.int64)


def attend_with_dropout(attend: Attend, q, k, v, score_mod: ScoreMod | None, p: float,
                        seed: torch.Tensor) -> torch.Tensor:
    """Attention with dropout p on the probabilities (module docstring); q, k, v [b, np, s, hn]."""

    dropped = dropped_levels(p)  # an int, captured by the score_mod (kept_at_level)

    def kept_score(score, b, h, q_idx, kv_idx):
        if score_mod is not None:
            score = score_mod(score, b, h, q_idx, kv_idx)
        return torch.where(kept_at_level(seed, dropped, b, h, q_idx, kv_idx), score, float("-inf"))

    out_kept, lse_kept = attend(q, k, v, kept_score)
    # [b, np, s, hn] -> [b, np, s, 16] zeros: this pass yields only the logsumexp over every key
    zeros, lse = attend(q, k, v.new_zeros(*v.shape[:-1], _LSE_WIDTH), score_mod)
    # a query that sees no key at all has lse = lse' = -inf: its factor is 0 (and its gradient too)
    lse = torch.where(torch.isfinite(lse), lse, 0.0)
    factor = torch.exp(lse_kept - lse) * keep_scale(p)
    # [b, np, s] -> [b, np, s, 1]. The second pass's output (exact zeros: P · 0) is added so that its
    # backward receives an output gradient: Inductor's flex_attention_backward lowering fails on a
    # missing one (torch 2.11 on an H200: "'NoneType' object has no attribute 'make_loader'").
    return (out_kept * factor.unsqueeze(-1) + zeros[..., :1]).to(q.dtype)


KERNEL_OPTIONS = frozenset(FlexKernelOptions.__annotations__)
"""torch's FlexAttention kernel options; each may also be given as fwd_NAME or bwd_NAME."""


def kernel_options(text: str, score_term_of: str | None = None) -> dict[str, int | bool | str]:
    """model.flex_kernel_options ('BLOCK_M=128,BLOCK_N=64,num_warps=8') -> FlexAttention's kernel_options;
    `score_term_of`: model.position where it adds a term to every score (ALiBi), which PRESCALE_QK breaks."""
    options: dict[str, int | bool | str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, equals, value = (part.strip() for part in item.partition("="))
        if not equals or not value or name.removeprefix("fwd_").removeprefix("bwd_") not in KERNEL_OPTIONS:
            raise ConfigError(f"model.flex_kernel_options: {item!r} is not NAME=VALUE with a FlexAttention "
                              f"kernel option (fwd_/bwd_ prefixes allowed): {', '.join(sorted(KERNEL_OPTIONS))}")
        lowered = value.lower()
        options[name] = (int(value) if value.lstrip("-").isdigit()
                         else lowered == "true" if lowered in ("true", "false") else value)
    prescaled = [name for name in options if name.endswith("PRESCALE_QK") and options[name] is True]
    if prescaled and score_term_of is not None:
        # the kernel then hands score_mod q·kᵀ·scale/ln 2 (log2 units) and never converts what score_mod
        # added: a score term counts ln 2 times its value (an H200 measured a max error of 0.86)
        raise ConfigError(f"model.flex_kernel_options: {prescaled[0]}=true is wrong with model.position="
                          f"{score_term_of}: FlexAttention then scales its score term by ln 2; leave it out")
    return options


def compiled_flex_attention(device_type: str):
    """Compiled FlexAttention on GPU; on CPU the eager reference (forward only), used by tests to
    check the score_mod against the materialized bias. Inside a compiled region (`train.compile`) the
    function itself: the region's compile compiles it, and Dynamo would otherwise trace through the
    cache below, warning that it ignores it."""
    return flex_attention if torch.compiler.is_compiling() else _flex_attention_for(device_type)


@functools.cache
def _flex_attention_for(device_type: str):
    # the training loader pads to one width under Flex, but evaluation, fine-tuning and inference
    # pass any width. The default (automatic dynamic shapes after the first recompile) avoids dynamo's
    # recompile limit, past which FlexAttention silently falls back to an eager path that
    # materializes the scores (seen on an H100: base at 8192 ran at 1% MFU with dynamic=False).
    return torch.compile(flex_attention) if device_type == "cuda" else flex_attention
