"""The block pairs of model.attention_backend=triton's kernels (triton_kernels.py): which blocks a
program's loop visits and in which loop, and the scores of a pair.

Visibility is `attention_groups`': a real query sees the real keys of its group (its document, else its
packed sample, else its row); HAS_GROUPS false: every key of the row; HAS_WINDOW: only keys within
half_window positions (a local layer's `LayerAttention.window`). A padding query sees no key: its output
is zeros, never read (sdpa's padding queries see every real key, only so that no softmax row is empty).
A query never sees another sample, so distances in a packed row are distances within its sample.

Each program visits only the blocks that its groups' extent and the window reach (`span`): a packed row
of n samples costs about n samples' attention, not one row's, and a local layer about its window's.
Most of those block pairs are whole: they lie in one run of equal groups (`group_runs`), within the
window and off the diagonal. Their loops (`partition`, `stretches`) skip the visibility test and split
ALiBi's slope · distance into a key term and a query term that the softmax applies per query: one
operation per score instead of about eight (benchmarks/triton_static.py counts the loops' instructions).
The other blocks — the diagonal's, the groups' edges, the window's reach — run the masked loop.

Positions are block-relative where they meet floats, so that ALiBi's terms stay small where the
probabilities are not; scores are in log2 units (the slopes and the scale pre-multiplied by log2 e).
"""

import triton
import triton.language as tl


@triton.jit
def scores(qk, offs_m, offs_n, before, after, q_group, k_group, S, qk_scale, offset, half_window,
           HAS_ALIBI: tl.constexpr, HAS_GROUPS: tl.constexpr, HAS_WINDOW: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Scores in log2 units with ALiBi and -inf where not visible, from qk = q·kᵀ [BLOCK_M, BLOCK_N] for
    queries offs_m and keys offs_n, or its transpose [BLOCK_N, BLOCK_M] (TRANSPOSED): any block pair."""
    qk = qk * qk_scale
    # a real query sees the keys of its own group; padding (query group -2, key group -1) and keys past S
    # (-1) none; without groups every key before S
    if TRANSPOSED:
        distance = offs_n[:, None] - offs_m[None, :]  # key - query
        visible = (k_group[:, None] == q_group[None, :]) if HAS_GROUPS else (offs_n[:, None] < S)
    else:
        distance = offs_n[None, :] - offs_m[:, None]
        visible = (k_group[None, :] == q_group[:, None]) if HAS_GROUPS else (offs_n[None, :] < S)
    if HAS_WINDOW:  # patterns.pattern_sees' window: distances within a group are distances in its sample
        visible &= tl.abs(distance) <= half_window
    if HAS_ALIBI:  # positions.alibi_score, in log2 units (the slopes are pre-multiplied by log2 e)
        distance = distance.to(tl.float32)
        qk += tl.where(distance > 0, -after * (distance - offset), before * distance)
    return tl.where(visible, qk, float("-inf"))


@triton.jit
def whole_block_scores(qk, start_m, start_n, before, after, qk_scale, offset, KEYS_AFTER: tl.constexpr,
                       HAS_ALIBI: tl.constexpr, TRANSPOSED: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """`scores` of a whole block pair (`partition`: every query sees every key, every key on one side
    of every query) as (scores less a query term, the query term [BLOCK_M]): no visibility test, and
    ALiBi's slope · distance split into a key term, added here, and a query term, which the softmax adds
    per query (its max) or subtracts from its per-query constant (exp2's argument): one operation per score.
    KEYS_AFTER: every key after every query, else every key at or before every query (a constexpr, so that
    the key term is the loop's invariant)."""
    query_term = tl.zeros([BLOCK_M], tl.float32)
    if HAS_ALIBI:
        # distance = (start_n + jj) - (start_m + ii) = (start_n - start_m + ref - ii) + (jj - ref), ref the
        # block's key nearest the queries (0 after them, BLOCK_N - 1 before): two integer distances of one
        # sign, so that the terms never cancel (the score keeps the precision of slope · distance). After
        # the query the term is -after · (distance - offset) = slope · distance + after · offset
        if KEYS_AFTER:
            slope = -after
            ref: tl.constexpr = 0
            query_term += after * offset
        else:
            slope = before
            ref: tl.constexpr = BLOCK_N - 1
        query_term += slope * (start_n - start_m + ref - tl.arange(0, BLOCK_M)).to(tl.float32)
        key_term = slope * (tl.arange(0, BLOCK_N) - ref).to(tl.float32)
        if TRANSPOSED:
            qk = qk * qk_scale + key_term[:, None]
        else:
            qk = qk * qk_scale + key_term[None, :]
    else:
        qk = qk * qk_scale
    return qk, query_term


@triton.jit
def block_scores(qk, GROUPS, b, sgb, own_group, offs_m, offs_n, start_m, start_n, before, after, S, qk_scale,
                 offset, half_window, KIND: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_GROUPS: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, OWN_KEYS: tl.constexpr, TRANSPOSED: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """(scores less a query term, the query term [BLOCK_M]) of a block pair from qk = q·kᵀ (its transpose
    when TRANSPOSED): `whole_block_scores` for whole blocks (KIND, `stretches`), else `scores` (term 0).
    own_group: the groups of the program's block (queries, or keys when OWN_KEYS: the loop is over queries);
    the loop's block's are loaded here."""
    if KIND != MASKED:
        qk, query_term = whole_block_scores(qk, start_m, start_n, before, after, qk_scale, offset,
                                            (KIND == LATER) != OWN_KEYS, HAS_ALIBI, TRANSPOSED, BLOCK_M,
                                            BLOCK_N)
    else:
        if OWN_KEYS:
            q_group = groups_of(GROUPS, b, sgb, offs_m, S, HAS_GROUPS, True)
            k_group = own_group
        else:
            q_group = own_group
            k_group = groups_of(GROUPS, b, sgb, offs_n, S, HAS_GROUPS, False)
        qk = scores(qk, offs_m, offs_n, before, after, q_group, k_group, S, qk_scale, offset, half_window,
                    HAS_ALIBI, HAS_GROUPS, HAS_WINDOW, TRANSPOSED)
        query_term = tl.zeros([BLOCK_M], tl.float32)
    return qk, query_term


@triton.jit
def partition(SPANS, span_stride, b, sgb, offs, first, S, half_window, BLOCK: tl.constexpr,
              HAS_ALIBI: tl.constexpr, HAS_GROUPS: tl.constexpr, HAS_WINDOW: tl.constexpr, TRANSPOSED: tl.constexpr):
    """(lo, hi, a1, a2, b1, z): the loop's blocks for the program's block at offs (starting at first) —
    starts lo, lo + BLOCK, ... below hi (`span`) — split into whole blocks, inside `whole_range`'s range
    and, with ALiBi, off the diagonal, in [a1, a2) and [b1, z); the rest (masked) in [lo, a1), [a2, b1)
    and [z, hi)."""
    lo, hi = span(SPANS, span_stride, b, sgb, offs, first, S, half_window, BLOCK, HAS_GROUPS, HAS_WINDOW)
    whole_lo, whole_hi = whole_range(SPANS, span_stride, b, sgb, offs, first, S, half_window, HAS_GROUPS, HAS_WINDOW)
    z = tl.maximum(lo, whole_hi // BLOCK * BLOCK)
    a1 = tl.minimum(tl.maximum(tl.cdiv(whole_lo, BLOCK) * BLOCK, lo), z)
    if HAS_ALIBI:  # the diagonal's blocks [d1, d2): some key before (or at) a query, another after one
        if TRANSPOSED:  # a fixed block of keys, the loop over queries
            d1 = tl.cdiv(tl.maximum(first + 1 - BLOCK, 0), BLOCK) * BLOCK
            d2 = tl.cdiv(first + offs.shape[0] - 1, BLOCK) * BLOCK
        else:
            d1 = tl.cdiv(tl.maximum(first + 2 - BLOCK, 0), BLOCK) * BLOCK
            d2 = tl.cdiv(first + offs.shape[0], BLOCK) * BLOCK
        a2 = tl.maximum(a1, tl.minimum(d1, z))
        b1 = tl.maximum(a2, tl.minimum(d2, z))
    else:
        a2 = z
        b1 = z
    return lo, hi, a1, a2, b1, z


@triton.jit
def block_start(t, s0, e0, s1, e1, s2, BLOCK: tl.constexpr):
    """The t-th block of the stretches [s0, e0), [s1, e1), [s2, ...) (`stretches`)."""
    n0 = (e0 - s0) // BLOCK
    n1 = n0 + (e1 - s1) // BLOCK
    return tl.where(t < n0, s0 + t * BLOCK, tl.where(t < n1, s1 + (t - n0) * BLOCK, s2 + (t - n1) * BLOCK))


MASKED: tl.constexpr = tl.constexpr(0)
EARLIER: tl.constexpr = tl.constexpr(1)
LATER: tl.constexpr = tl.constexpr(2)
"""The kinds of the loop's blocks (`partition`), one loop each: masked; whole, before the program's block
(below the diagonal); whole, after it (without ALiBi every whole block is EARLIER's)."""


@triton.jit
def stretches(lo, hi, a1, a2, b1, z, KIND: tl.constexpr, BLOCK: tl.constexpr):
    """(s0, e0, s1, e1, s2, count): the stretches of the blocks of one kind (`partition`), and their
    number of blocks."""
    if KIND == EARLIER:
        return a1, a2, a2, a2, a2, (a2 - a1) // BLOCK
    if KIND == LATER:
        return b1, z, z, z, z, (z - b1) // BLOCK
    return lo, a1, a2, b1, z, (a1 - lo) // BLOCK + (b1 - a2) // BLOCK + tl.cdiv(tl.maximum(hi - z, 0), BLOCK)


@triton.jit
def groups_of(GROUPS, b, sgb, offs, S, HAS_GROUPS: tl.constexpr, QUERIES: tl.constexpr):
    """The group of each position (`attention_groups`; -1 past S); unused without HAS_GROUPS. QUERIES:
    padding's -1 becomes -2, a group no key has, so that one comparison per score says what is visible."""
    if HAS_GROUPS:
        group = tl.load(GROUPS + b * sgb + offs, mask=offs < S, other=-1)
        return tl.where(group < 0, -2, group) if QUERIES else group
    return offs


@triton.jit
def span(SPANS, span_stride, b, sgb, offs, first, S, half_window, BLOCK: tl.constexpr,
         HAS_GROUPS: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """[lo, hi): the positions on the other side (keys of a block of queries, or queries of a block of
    keys) that may see the block at offs (starting at first): its groups' extent (`group_spans`)
    narrowed by the window. lo is aligned down to BLOCK, the other side's block; the loop skips the rest."""
    lo = S * 0  # an int32 zero, as S
    hi = S
    if HAS_GROUPS:
        lo = tl.min(tl.load(SPANS + b * sgb + offs, mask=offs < S, other=S))
        hi = tl.max(tl.load(SPANS + span_stride + b * sgb + offs, mask=offs < S, other=0))
    if HAS_WINDOW:
        lo = tl.maximum(lo, first - half_window)
        hi = tl.minimum(hi, first + offs.shape[0] + half_window)
    return tl.maximum(lo, 0) // BLOCK * BLOCK, hi


@triton.jit
def whole_range(SPANS, span_stride, b, sgb, offs, first, S, half_window, HAS_GROUPS: tl.constexpr,
                HAS_WINDOW: tl.constexpr):
    """[whole_lo, whole_hi): the positions on the other side that see every position of the block at offs
    (starting at first) and that every one of them sees: the block's common run of equal groups
    (`group_runs`; empty where the block holds two runs or padding), narrowed by the window."""
    lo = S * 0
    hi = S
    if HAS_GROUPS:  # positions past S are never stored: they do not narrow the range
        lo = tl.max(tl.load(SPANS + 2 * span_stride + b * sgb + offs, mask=offs < S, other=0))
        hi = tl.min(tl.load(SPANS + 3 * span_stride + b * sgb + offs, mask=offs < S, other=S))
    if HAS_WINDOW:  # every pair within the window: from the block's last position back, its first on
        lo = tl.maximum(lo, first + offs.shape[0] - 1 - half_window)
        hi = tl.minimum(hi, first + half_window + 1)
    return lo, hi
