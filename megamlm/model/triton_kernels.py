"""The Triton kernels of model.attention_backend=triton (triton_attention.py: the op, its autograd and
the backend): bidirectional attention with ALiBi's score term (slopes for keys before and after the
query, and their gradient where they are learned), key padding, documents, packed samples, sliding
windows and attention dropout, forward and backward, FlashAttention's way (online softmax; the backward
recomputes the probabilities from the saved log-sum-exp, one kernel for dK/dV, one for dQ; or with
model.triton_dq=atomic the dK/dV kernel alone, adding dQ with atomics). dK/dV's score tiles come in two
orientations, keys or queries along rows; the autotuner times both.

The dropout mask (flex.py's), hashed per query and pair of keys: triton_dropout.py.

Which block pairs a program visits, in which of its loops (the masked one, or the two over whole blocks,
before and after the diagonal), and their scores with visibility and ALiBi: triton_blocks.py.

Scores run in log2 units (exp2, as FlashAttention's kernels do): scale · log2(e) is folded into the
product and the ALiBi slope; the saved log-sum-exp is in log2 units too. A query that sees no key gets
a zero output and a log-sum-exp of +inf (zero probabilities in the backward).

On a GPU each kernel's block sizes come from Triton's autotuner (keyed on length, head dim and the
features); under TRITON_INTERPRET=1 (the tests, on CPU tensors) one small configuration runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from megamlm.model.triton_autotune import COMPILE_OPTIONS, autotuned
from megamlm.model.triton_blocks import block_scores, block_start, groups_of, partition, stretches
from megamlm.model.triton_dropout import drop, kept, key_levels, query_bits_of, saved_query_bits
from megamlm.model.triton_interpreter import INTERPRET, computable, operand, stored

LOG2E = 1.4426950408889634
_LOG2E: tl.constexpr = tl.constexpr(LOG2E)  # the kernels' copy


@triton.jit
def _rows_at(b, h, offs, sb, sh, ss, HEAD_DIM: tl.constexpr):
    """Element offsets [len(offs), hn] of positions offs of head h of row b, with strides sb, sh, ss."""
    return b * sb + h * sh + offs[:, None] * ss + tl.arange(0, HEAD_DIM)[None, :]


@triton.jit
def _load_rows(PTR, b, h, offs, sb, sh, ss, S, HEAD_DIM: tl.constexpr):
    """[len(offs), hn] of [b, np, s, hn] PTR (zeros past S), in a type the kernel computes with (`computable`)."""
    return computable(tl.load(PTR + _rows_at(b, h, offs, sb, sh, ss, HEAD_DIM), mask=offs[:, None] < S, other=0.0))


@triton.jit
def _store_rows(PTR, value, b, h, offs, sb, sh, ss, S, HEAD_DIM: tl.constexpr):
    tl.store(PTR + _rows_at(b, h, offs, sb, sh, ss, HEAD_DIM), stored(value, PTR.dtype.element_ty),
             mask=offs[:, None] < S)


@triton.jit
def _slopes(SLOPES, H, h, HAS_ALIBI: tl.constexpr):
    """Head h's ALiBi slopes for keys before (and at) the query and after it, in log2 units (SLOPES [2, H])."""
    if HAS_ALIBI:
        return tl.load(SLOPES + h) * _LOG2E, tl.load(SLOPES + H + h) * _LOG2E
    return 0.0, 0.0


@triton.jit
def _row_terms(LSE, DELTA, bh, offs, S):
    """The backward's per-query terms: the forward's lse (+inf past S: zero probabilities) and Σ dO·O."""
    return (tl.load(LSE + bh * S + offs, mask=offs < S, other=float("inf")),
            tl.load(DELTA + bh * S + offs, mask=offs < S, other=0.0))


@triton.jit
def _attention_forward_kernel(Q, K, V, OUT, LSE, QBITS, SLOPES, GROUPS, SPANS, SEED,
                              sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos, sgb, span_stride,
                              H, S, qk_scale, offset, keep_scale, half_window,
                              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              HAS_ALIBI: tl.constexpr, HAS_GROUPS: tl.constexpr, HAS_WINDOW: tl.constexpr,
                              DROPPED: tl.constexpr):
    start_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _load_rows(Q, b, h, offs_m, sqb, sqh, sqs, S, HEAD_DIM)
    before, after = _slopes(SLOPES, H, h, HAS_ALIBI)
    q_group = groups_of(GROUPS, b, sgb, offs_m, S, HAS_GROUPS, True)
    query_bits = query_bits_of(SEED, b, h, offs_m, DROPPED)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    lo, hi, a1, a2, b1, z = partition(SPANS, span_stride, b, sgb, offs_m, start_m * BLOCK_M, S, half_window,
                                      BLOCK_N, HAS_ALIBI, HAS_GROUPS, HAS_WINDOW, False)
    for KIND in tl.static_range(3):  # the masked blocks' loop, then the whole blocks' two (`stretches`)
        s0, e0, s1, e1, s2, count = stretches(lo, hi, a1, a2, b1, z, KIND, BLOCK_N)
        for block in range(0, count):
            start_n = block_start(block, s0, e0, s1, e1, s2, BLOCK_N)
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = _load_rows(K, b, h, offs_n, skb, skh, sks, S, HEAD_DIM)
            qk = tl.dot(q, tl.trans(k))  # [BM, hn] x [hn, BN] -> [BM, BN]
            qk, query_term = block_scores(qk, GROUPS, b, sgb, q_group, offs_m, offs_n, start_m * BLOCK_M, start_n,
                                          before, after, S, qk_scale, offset, half_window, KIND, HAS_ALIBI,
                                          HAS_GROUPS, HAS_WINDOW, False, False, BLOCK_M, BLOCK_N)
            m_new = tl.maximum(m_i, tl.max(qk, 1) + query_term)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: nothing to rescale
            p = tl.math.exp2(qk - (m_safe - query_term)[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)  # the softmax's denominator counts every key, dropped or not
            if DROPPED > 0:
                p = drop(p, key_levels(query_bits, start_n, BLOCK_N, False), DROPPED)
            v = _load_rows(V, b, h, offs_n, svb, svh, svs, S, HEAD_DIM)
            acc = acc * alpha[:, None] + tl.dot(operand(p, V.dtype.element_ty), v)
            m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None] * keep_scale
    _store_rows(OUT, out, b, h, offs_m, sob, soh, sos, S, HEAD_DIM)
    lse = tl.where(empty, float("inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    tl.store(LSE + bh * S + offs_m, lse, mask=offs_m < S)
    if DROPPED > 0:  # for the backward (`saved_query_bits`)
        tl.store(QBITS + bh * S + offs_m, query_bits.to(tl.int32, bitcast=True), mask=offs_m < S)


@triton.jit
def _score_tile(queries, keys, TRANSPOSED: tl.constexpr):
    """queries · keysᵀ [BM, BN] ([BM, hn] x [hn, BN]), or its transpose keys · queriesᵀ [BN, BM] (TRANSPOSED)."""
    if TRANSPOSED:  # (one return: the two tiles' shapes differ)
        tile = tl.dot(keys, tl.trans(queries))
    else:
        tile = tl.dot(queries, tl.trans(keys))
    return tile


@triton.jit
def _per_query(x, TRANSPOSED: tl.constexpr):
    """A [BM] vector of the queries against a score tile: [BM, 1], or [1, BM] against the transpose."""
    if TRANSPOSED:
        column = x[None, :]
    else:
        column = x[:, None]
    return column


@triton.jit
def _per_key(x, TRANSPOSED: tl.constexpr):
    """A [BN] vector of the keys against a score tile: [1, BN], or [BN, 1] against the transpose."""
    return _per_query(x, not TRANSPOSED)


@triton.jit
def _keys_first(tile, TRANSPOSED: tl.constexpr):
    """A score tile as the left operand of a product over queries, [BN, BM]: the transpose of a [BM, BN] tile
    (Triton passes it to the tensor cores through shared memory, transposed there)."""
    if not TRANSPOSED:
        tile = tl.trans(tile)
    return tile


@triton.jit
def _queries_first(tile, TRANSPOSED: tl.constexpr):
    """A score tile as the left operand of a product over keys, [BM, BN] (`_keys_first`'s counterpart)."""
    if TRANSPOSED:
        tile = tl.trans(tile)
    return tile


@triton.jit
def _slope_shares(ds, offs_m, offs_n, offset, TRANSPOSED: tl.constexpr):
    """Each query's shares [BM] of the slopes' gradient (before, after) from a dS tile: d score / d slope is the
    distance before the query, -(distance - offset) after it (natural units)."""
    distance = (_per_key(offs_n, TRANSPOSED) - _per_query(offs_m, TRANSPOSED)).to(tl.float32)
    keys_axis: tl.constexpr = 0 if TRANSPOSED else 1
    return (tl.sum(tl.where(distance > 0, 0.0, ds * distance), keys_axis),
            tl.sum(tl.where(distance > 0, ds * (offset - distance), 0.0), keys_axis))


@triton.jit
def _add_query_shares(DQ_SUM, DSLOPES, ds, ds_operand, k, bh, offs_m, offs_n, S, offset, keep_scale,
                      HEAD_DIM: tl.constexpr, SLOPE_GRAD: tl.constexpr, TRANSPOSED: tl.constexpr):
    """model.triton_dq=atomic (FlashAttention-2's way): this block pair's dS · k [BM, hn] added into the fp32
    DQ_SUM [b, np, s, hn] (contiguous; the caller scales it), with SLOPE_GRAD the shares into DSLOPES [b, np, s, 2]."""
    rows = (bh * S + offs_m) * HEAD_DIM
    dq = tl.dot(_queries_first(ds_operand, TRANSPOSED), k)  # [BM, BN] x [BN, hn] -> [BM, hn]
    tl.atomic_add(DQ_SUM + rows[:, None] + tl.arange(0, HEAD_DIM)[None, :], dq, mask=offs_m[:, None] < S,
                  sem="relaxed")
    if SLOPE_GRAD:
        d_before, d_after = _slope_shares(ds, offs_m, offs_n, offset, TRANSPOSED)
        tl.atomic_add(DSLOPES + (bh * S + offs_m) * 2, d_before * keep_scale, mask=offs_m < S, sem="relaxed")
        tl.atomic_add(DSLOPES + (bh * S + offs_m) * 2 + 1, d_after * keep_scale, mask=offs_m < S, sem="relaxed")


@triton.jit
def _attention_backward_keys_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQ_SUM, DSLOPES, SLOPES, GROUPS, SPANS, QBITS,
                                    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds, sgb, span_stride,
                                    sxb, sxh, sxs, H, S, qk_scale, sm_scale, offset, keep_scale, half_window,
                                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                    HAS_ALIBI: tl.constexpr, HAS_GROUPS: tl.constexpr, HAS_WINDOW: tl.constexpr,
                                    DROPPED: tl.constexpr, TRANSPOSED: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                                    SLOPE_GRAD: tl.constexpr):
    """dK, dV of one block of keys, over every block of queries. DK and DV have the strides sx*. TRANSPOSED
    (the autotuner's choice): the score tiles are [BN, BM], keys along rows, as dK and dV accumulate them; else
    [BM, BN], queries along rows as in the forward: each thread then holds 2 rows' per-query terms (lse, delta,
    ALiBi's query term, the dropout hash's query bits), not 16 columns' (the MMA tile's layout), and Pᵀ and
    dSᵀ pass through shared memory. ATOMIC_DQ: also each block of queries' share of dQ (and with SLOPE_GRAD
    of the slopes' gradient), `_add_query_shares`; else DQ_SUM and DSLOPES are placeholders, never touched."""
    start_n, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = _load_rows(K, b, h, offs_n, skb, skh, sks, S, HEAD_DIM)
    v = _load_rows(V, b, h, offs_n, svb, svh, svs, S, HEAD_DIM)
    before, after = _slopes(SLOPES, H, h, HAS_ALIBI)
    k_group = groups_of(GROUPS, b, sgb, offs_n, S, HAS_GROUPS, False)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    # the queries that see these keys, and those that see all of them (the relation is symmetric)
    lo, hi, a1, a2, b1, z = partition(SPANS, span_stride, b, sgb, offs_n, start_n * BLOCK_N, S, half_window,
                                      BLOCK_M, HAS_ALIBI, HAS_GROUPS, HAS_WINDOW, True)
    if ATOMIC_DQ and (start_n + 1) * BLOCK_N > S:  # keys past S (S not a multiple of BLOCK_N): whole blocks would
        # leave them visible (their dK, dV are never stored; their dS would reach dQ): every block masked
        a1, a2, b1, z = lo, lo, lo, lo
    for KIND in tl.static_range(3):  # the masked blocks' loop, then the whole blocks' two (`stretches`)
        s0, e0, s1, e1, s2, count = stretches(lo, hi, a1, a2, b1, z, KIND, BLOCK_M)
        for block in range(0, count):
            start_m = block_start(block, s0, e0, s1, e1, s2, BLOCK_M)
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q = _load_rows(Q, b, h, offs_m, sqb, sqh, sqs, S, HEAD_DIM)
            do = _load_rows(DO, b, h, offs_m, sdb, sdh, sds, S, HEAD_DIM)
            lse, delta = _row_terms(LSE, DELTA, bh, offs_m, S)
            qk = _score_tile(q, k, TRANSPOSED)
            qk, query_term = block_scores(qk, GROUPS, b, sgb, k_group, offs_m, offs_n, start_m, start_n * BLOCK_N,
                                          before, after, S, qk_scale, offset, half_window, KIND, HAS_ALIBI,
                                          HAS_GROUPS, HAS_WINDOW, True, TRANSPOSED, BLOCK_M, BLOCK_N)
            p = tl.math.exp2(qk - _per_query(lse - query_term, TRANSPOSED))
            dp = _score_tile(do, v, TRANSPOSED)  # dO · vᵀ
            if DROPPED > 0:  # (the keep scale once, at the end: `backward_launches`)
                levels = key_levels(saved_query_bits(QBITS, bh, offs_m, S), start_n * BLOCK_N, BLOCK_N, TRANSPOSED)
                kept_p = drop(p, levels, DROPPED)
                dv += tl.dot(_keys_first(operand(kept_p, DO.dtype.element_ty), TRANSPOSED), do)
                if TRANSPOSED:  # p · (kept(dP) - delta) with one select: kept(p) · dP - p · delta (a product and
                    # an FMA, as the difference and product were); with queries along rows the 64 x 64 tiles then
                    # spill registers (benchmarks/triton_static.py), so they keep the second select
                    ds = kept_p * dp - p * _per_query(delta, TRANSPOSED)
                else:
                    ds = p * (drop(dp, levels, DROPPED) - _per_query(delta, TRANSPOSED))
            else:
                dv += tl.dot(_keys_first(operand(p, DO.dtype.element_ty), TRANSPOSED), do)
                ds = p * (dp - _per_query(delta, TRANSPOSED))
            ds_operand = operand(ds, Q.dtype.element_ty)
            dk += tl.dot(_keys_first(ds_operand, TRANSPOSED), q)
            if ATOMIC_DQ:
                _add_query_shares(DQ_SUM, DSLOPES, ds, ds_operand, k, bh, offs_m, offs_n, S, offset, keep_scale,
                                  HEAD_DIM, SLOPE_GRAD, TRANSPOSED)
    dk *= sm_scale * keep_scale
    dv *= keep_scale
    _store_rows(DK, dk, b, h, offs_n, sxb, sxh, sxs, S, HEAD_DIM)
    _store_rows(DV, dv, b, h, offs_n, sxb, sxh, sxs, S, HEAD_DIM)


@triton.jit
def _attention_backward_queries_kernel(Q, K, V, DO, LSE, DELTA, DQ, DSLOPES, SLOPES, GROUPS, SPANS, QBITS,
                                       sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds, sgb, span_stride,
                                       sxb, sxh, sxs, H, S, qk_scale, sm_scale, offset, keep_scale, half_window,
                                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                       HAS_ALIBI: tl.constexpr, HAS_GROUPS: tl.constexpr, HAS_WINDOW: tl.constexpr,
                                       DROPPED: tl.constexpr, SLOPE_GRAD: tl.constexpr):
    """dQ of one block of queries, over every block of keys. DQ has the strides sx*. SLOPE_GRAD: also each
    query's share of the slopes' gradient, DSLOPES [b, H, S, 2] (before, after; summed by the caller:
    deterministic, whatever the block size)."""
    start_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _load_rows(Q, b, h, offs_m, sqb, sqh, sqs, S, HEAD_DIM)
    do = _load_rows(DO, b, h, offs_m, sdb, sdh, sds, S, HEAD_DIM)
    lse, delta = _row_terms(LSE, DELTA, bh, offs_m, S)
    before, after = _slopes(SLOPES, H, h, HAS_ALIBI)
    q_group = groups_of(GROUPS, b, sgb, offs_m, S, HAS_GROUPS, True)
    query_bits = saved_query_bits(QBITS, bh, offs_m, S)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    d_before = tl.zeros([BLOCK_M], tl.float32)
    d_after = tl.zeros([BLOCK_M], tl.float32)
    lo, hi, a1, a2, b1, z = partition(SPANS, span_stride, b, sgb, offs_m, start_m * BLOCK_M, S, half_window,
                                      BLOCK_N, HAS_ALIBI, HAS_GROUPS, HAS_WINDOW, False)
    for KIND in tl.static_range(3):  # the masked blocks' loop, then the whole blocks' two (`stretches`)
        s0, e0, s1, e1, s2, count = stretches(lo, hi, a1, a2, b1, z, KIND, BLOCK_N)
        for block in range(0, count):
            start_n = block_start(block, s0, e0, s1, e1, s2, BLOCK_N)
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = _load_rows(K, b, h, offs_n, skb, skh, sks, S, HEAD_DIM)
            v = _load_rows(V, b, h, offs_n, svb, svh, svs, S, HEAD_DIM)
            qk = tl.dot(q, tl.trans(k))  # [BM, hn] x [hn, BN] -> [BM, BN]
            qk, query_term = block_scores(qk, GROUPS, b, sgb, q_group, offs_m, offs_n, start_m * BLOCK_M, start_n,
                                          before, after, S, qk_scale, offset, half_window, KIND, HAS_ALIBI,
                                          HAS_GROUPS, HAS_WINDOW, False, False, BLOCK_M, BLOCK_N)
            p = tl.math.exp2(qk - (lse - query_term)[:, None])
            dp = tl.dot(do, tl.trans(v))  # [BM, hn] x [hn, BN]
            if DROPPED > 0:
                dp = tl.where(kept(key_levels(query_bits, start_n, BLOCK_N, False), DROPPED), dp, 0.0)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(operand(ds, K.dtype.element_ty), k)
            if SLOPE_GRAD:
                shares_before, shares_after = _slope_shares(ds, offs_m, offs_n, offset, False)
                d_before += shares_before
                d_after += shares_after
    dq *= sm_scale * keep_scale
    _store_rows(DQ, dq, b, h, offs_m, sxb, sxh, sxs, S, HEAD_DIM)
    if SLOPE_GRAD:
        tl.store(DSLOPES + (bh * S + offs_m) * 2, d_before * keep_scale, mask=offs_m < S)
        tl.store(DSLOPES + (bh * S + offs_m) * 2 + 1, d_after * keep_scale, mask=offs_m < S)


def _configs(candidates: list[tuple]) -> list[triton.Config]:
    """(BLOCK_M, BLOCK_N, warps, stages[, {another constexpr: its value}]) candidates for the autotuner; the
    interpreter runs one small one, with the first candidate's other constexprs."""
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, **_constants(candidates[0])}, num_warps=1, num_stages=1)]
    return [triton.Config({"BLOCK_M": c[0], "BLOCK_N": c[1], **_constants(c)}, num_warps=c[2], num_stages=c[3])
            for c in candidates]


def _constants(candidate: tuple) -> dict:
    return candidate[4] if len(candidate) > 4 else {}


def _autotuned(kernel: triton.JITFunction, candidates: list[tuple], key: list[str],
               reset_to_zero: list[str] | None = None) -> triton.runtime.Autotuner:
    return autotuned(kernel, _configs(candidates), key, reset_to_zero)


_TUNING_KEY = ["S", "HEAD_DIM", "HAS_ALIBI", "HAS_GROUPS", "HAS_WINDOW", "DROPPED"]
_KEYS_ROWS, _QUERY_ROWS = {"TRANSPOSED": True}, {"TRANSPOSED": False}  # dK/dV's two orientations
# (BLOCK_M, BLOCK_N, warps, stages) for head dim 64 on Hopper (FlashAttention-2's and Triton's tutorial's
# shapes: the forward and dQ hold a block of queries and stream keys, dK/dV the reverse). Left out: those
# that spill registers with dropout on sm_90a (benchmarks/triton_static.py), e.g. the forward's 128 x 64
# and dK/dV's 64 x 64 at 4 warps with keys along rows (with queries along rows: at 128 keys), and dK/dV's
# 64 x 64 at 8 warps, whose two warpgroups each computed the whole tile (twice the matmuls and exp2 per score)
_forward = _autotuned(_attention_forward_kernel, [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4),
                                         (64, 32, 4, 3)], _TUNING_KEY)
_backward_keys = _autotuned(_attention_backward_keys_kernel, [
    (32, 128, 8, 3, _KEYS_ROWS), (64, 128, 8, 2, _KEYS_ROWS), (64, 128, 8, 3, _KEYS_ROWS), (16, 128, 8, 3, _KEYS_ROWS),
    (32, 64, 4, 4, _KEYS_ROWS), (64, 64, 4, 3, _QUERY_ROWS), (64, 64, 4, 2, _QUERY_ROWS), (128, 64, 8, 2, _QUERY_ROWS),
    (128, 64, 8, 3, _QUERY_ROWS)], [*_TUNING_KEY, "ATOMIC_DQ", "SLOPE_GRAD"], reset_to_zero=["DQ_SUM", "DSLOPES"])
_backward_queries = _autotuned(_attention_backward_queries_kernel, [(128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 8, 3),
                                                          (64, 64, 4, 3), (64, 32, 4, 4)], [*_TUNING_KEY, "SLOPE_GRAD"])


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    """[b, np, s, hn] strides of b, np and s (hn's is 1)."""
    return t.stride(0), t.stride(1), t.stride(2)


class Launch(NamedTuple):
    """One kernel call, built apart from running it so that benchmarks/triton_static.py can compile exactly
    what a training step launches (its arguments decide Triton's specializations) without a GPU."""

    kernel: triton.runtime.Autotuner
    grid: Callable[[dict], tuple[int, int]]
    args: tuple
    constants: dict
    """The constexpr keyword arguments (the autotuner adds BLOCK_M and BLOCK_N)."""

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.constants, **COMPILE_OPTIONS)


def forward_launch(q, k, v, out, lse, query_bits, slopes, groups, spans, seed, scale: float, offset: float,
                   keep_scale: float, half_window: int, flags: dict) -> Launch:
    """Filling out [b, np, s, hn], lse [b, np, s] (log2 units) and, with dropout, query_bits [b, np, s]
    (triton_dropout `query_bits_of`); flags: HAS_ALIBI, HAS_GROUPS, HAS_WINDOW, DROPPED; spans [4, b, s]
    (`kernel_spans`) with groups."""
    b, np_local, s, hn = q.shape
    return Launch(_forward, lambda meta: (triton.cdiv(s, meta["BLOCK_M"]), b * np_local),
                  (q, k, v, out, lse, query_bits, slopes, groups, spans, seed, *_strides(q), *_strides(k), *_strides(v),
                   *_strides(out), groups.stride(0), b * s, np_local, s, scale * LOG2E, offset, keep_scale,
                   half_window), {"HEAD_DIM": hn, **flags})


def backward_launches(do, q, k, v, lse, delta, dq, dk, dv, dslopes, slopes, groups, spans, query_bits, scale: float,
                      offset: float, keep_scale: float, half_window: int, flags: dict, slope_grad: bool,
                      dq_sum: torch.Tensor | None = None) -> tuple[Launch, ...]:
    """Filling dk, dv, then dq (one layout: the strides of dk, dv and dq) from dO, the forward's lse and query
    bits, and delta = Σ dO·O / keep_scale; with slope_grad also dslopes [b, np, s, 2], each query's share of the
    slopes' gradient. With dropout dS = P ∘ (keep_scale · kept(dP) - Σ dO·O) = keep_scale · P ∘ (kept(dP) - delta):
    the kernels apply keep_scale once per program (to dK, dV, dQ and the shares), not once per score.
    dq_sum (fp32 [b, np, s, hn], contiguous and zeroed; model.triton_dq=atomic): one launch, the dK/dV kernel,
    adds dQ / (scale · keep_scale) there and the shares into dslopes (zeroed); dq is not written."""
    b, np_local, s, hn = q.shape
    common = (slopes, groups, spans, query_bits, *_strides(q), *_strides(k), *_strides(v), *_strides(do),
              groups.stride(0), b * s, *_strides(dq), np_local, s, scale * LOG2E, scale, offset, keep_scale,
              half_window)
    atomic = dq_sum is not None
    keys = Launch(_backward_keys, lambda meta: (triton.cdiv(s, meta["BLOCK_N"]), b * np_local),
                  # without dq_sum, dslopes stands in for it (no null pointer for the launcher): the kernel leaves
                  # both alone, the autotuner's zeroing of them precedes the dQ kernel, which writes dslopes
                  (q, k, v, do, lse, delta, dk, dv, dq_sum if atomic else dslopes, dslopes, *common),
                  {"HEAD_DIM": hn, "ATOMIC_DQ": atomic, "SLOPE_GRAD": slope_grad and atomic, **flags})
    if atomic:
        return (keys,)
    return keys, Launch(_backward_queries, lambda meta: (triton.cdiv(s, meta["BLOCK_M"]), b * np_local),
                        (q, k, v, do, lse, delta, dq, dslopes, *common),
                        {"HEAD_DIM": hn, "SLOPE_GRAD": slope_grad, **flags})
