"""The dropout mask of model.attention_backend=triton's kernels (triton_kernels.py), flex.py's mask:
murmur3's finalizer chained over (seed ^ (b << 16 | h), i, pair) gives 32 bits per query i (row b, head h)
and pair of keys j, j ^ 8, 16 per key; key j is kept when its 16 are at or above round(p · 2^16); kept
probabilities are scaled by 2^16 / (2^16 - round(p · 2^16)). The first two links of the chain (and the
last one's first step) are computed once per query, in the forward, which saves them for the backward
(`query_bits_of`, `saved_query_bits`); the rest once per pair: in an MMA accumulator tile (Hopper's wgmma,
as Ampere's mma.sync) a thread holds columns c and c + 8 and rows r and r + 8, so both keys of a pair are
in one thread in either orientation and the two halves need no data moved (`key_levels`). Nothing [s, s]
is stored; the backward recomputes the mask.
"""

import triton
import triton.language as tl

from megamlm.model.triton_interpreter import INTERPRET_CONSTEXPR


@triton.jit
def _fmix32(x):
    """murmur3's finalizer on uint32 (flex.py's `_fmix32` on int32 bits: the same bits)."""
    x = _fmix32_middle(x ^ (x >> 16))
    return x ^ (x >> 16)


@triton.jit
def _fmix32_middle(x):
    """`_fmix32` without its first step (x ^= x >> 16) and its last (the same): the two products."""
    x *= 0x85EBCA6B
    x ^= x >> 13
    x *= 0xC2B2AE35
    return x


@triton.jit
def key_levels(query_bits, start_n, BLOCK_N: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Each score's 16 dropout bits (flex.py `key_level`) in the high half of a uint32, [BM, BN] ([BN, BM]
    transposed) for keys start_n + [0, BN): one hash per pair of keys j, j ^ 8, without the finalizer's last
    step x ^= x >> 16, which leaves the high half as it is (key j ^ 8's 16 bits) and makes the low half
    (key j's) the xor of both, moved up here. Pairs 8g + l of the [BN/2] hashes cover keys 16g + l and
    16g + 8 + l, so the reshapes below keep each value in the thread that computed it."""
    pairs = (start_n // 2 + tl.arange(0, BLOCK_N // 2)).to(tl.uint32)
    if TRANSPOSED:
        x = _fmix32_middle(query_bits[None, :] ^ pairs[:, None])  # [BN/2, BM]
        x = x.reshape(BLOCK_N // 16, 8, x.shape[1])
        # [BN/16, 8, BM, 2] -> [BN/16, 2, 8, BM] -> [BN, BM]
        levels = tl.join((x << 16) ^ (x & 0xFFFF0000), x).permute(0, 3, 1, 2).reshape(BLOCK_N, x.shape[2])
    else:
        x = _fmix32_middle(query_bits[:, None] ^ pairs[None, :])  # [BM, BN/2]
        x = x.reshape(x.shape[0], BLOCK_N // 16, 8)
        # [BM, BN/16, 8, 2] -> [BM, BN/16, 2, 8] -> [BM, BN]
        levels = tl.join((x << 16) ^ (x & 0xFFFF0000), x).permute(0, 1, 3, 2).reshape(x.shape[0], BLOCK_N)
    return levels


@triton.jit
def kept(levels, DROPPED: tl.constexpr):
    """Where dropout keeps a score: its `key_levels` at or above DROPPED (= round(p · 2^16)) in the high half."""
    return levels >= DROPPED << 16


@triton.jit
def drop(x, levels, DROPPED: tl.constexpr):
    """tl.where(kept(levels, DROPPED), x, 0.0) as one compare and one fp32 select per score on a GPU.
    Written as tl.where, LLVM moves the select past a bf16 conversion that follows (the forward's P, dK/dV's
    Pᵀ) and selects 16-bit halves: two more instructions per score (benchmarks/triton_static.py); in the
    transposed dK/dV tile tl.where costs more still. dQ's select stays fp32 and uses tl.where."""
    if INTERPRET_CONSTEXPR:
        return tl.where(kept(levels, DROPPED), x, 0.0)
    return tl.inline_asm_elementwise(
        "{ .reg .pred kept; setp.hs.u32 kept, $2, $3; selp.f32 $0, $1, 0f00000000, kept; }", "=r,r,r,r",
        [x, levels, tl.full(levels.shape, DROPPED << 16, tl.uint32)], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def query_bits_of(SEED, b, h, offs_m, DROPPED: tl.constexpr):
    """The dropout hash per query: the chain's first two links (per (seed, row, head), then per query) x,
    and the last link's first step, x ^ (x >> 16): for keys j below 2^16 (the launcher's limit) x ^ j
    shifted right by 16 is x >> 16, so that step is one per query, not one per score."""
    if DROPPED > 0:
        seed = tl.load(SEED).to(tl.uint32)
        head_bits = _fmix32(seed ^ ((b.to(tl.uint32) << 16) | h.to(tl.uint32)))
        x = _fmix32(head_bits ^ offs_m.to(tl.uint32))
        return x ^ (x >> 16)
    return offs_m.to(tl.uint32)


@triton.jit
def saved_query_bits(QBITS, bh, offs, S):
    """`query_bits_of` of queries offs as the forward saved them ([b, H, S] int32 bits)."""
    return tl.load(QBITS + bh * S + offs, mask=offs < S, other=0).to(tl.uint32, bitcast=True)
