"""model.attention_backend=triton: attention in our own Triton kernels (triton_kernels.py), with what the
encoder adds to it — ALiBi's score term (fixed or learned slopes), key padding, documents, packed
samples, sliding windows, attention dropout — in one FlashAttention-style pass, forward and backward.

Why a kernel of our own: cuDNN takes ALiBi only as an additive [b, np, s, s] bias and its attention
dropout costs half again (H200, base at 2048, batch 8: 1.55 -> 2.30 ms per layer, fwd+bwd);
FlexAttention has ALiBi as a score_mod but no post-softmax dropout, which flex.py therefore computes in
two passes (1.42 -> 3.97 ms). Here dropout is one more hash per score inside the same pass, with
flex.py's mask (the same bits for the same seed).

The kernels are a torch custom op (`megamlm::triton_attention`, and its backward), so torch.compile
keeps them whole inside a compiled layer. The output is laid out [s, b, np, hn] in memory, the
layer's layout: BidirectionalAttention's (layer.py) permute back to [s, b, np · hn] is a view.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from megamlm.config import GLOBAL_ATTENTION, LayerAttention, ModelConfig
from megamlm.model.attention import AttentionBackend, split_qkv
from megamlm.model.dropout import dropped_levels, level_keep_scale
from megamlm.model.flex import draw_seed, keep_mask, keep_scale
from megamlm.model.patterns import group_sees, pattern_sees
from megamlm.model.positions import alibi_bias
from megamlm.model.sequences import LayoutReads, attention_groups

try:  # triton comes with CUDA builds of torch; a CPU-only install may lack it (the backend says so)
    from megamlm.model.triton_kernels import INTERPRET, Launch
    from megamlm.model.triton_kernels import backward_launches as kernel_backward
    from megamlm.model.triton_kernels import forward_launch as kernel_forward
except ImportError:
    INTERPRET, Launch, kernel_forward, kernel_backward = False, None, None, None


_DROPOUT_POSITIONS = 2**16  # triton_dropout's query_bits_of: key indices below 2^16


def _like_sbh(t: torch.Tensor) -> torch.Tensor:
    """An empty [b, np, s, hn] like t, its memory laid out [s, b, np, hn]."""
    b, np_local, s, hn = t.shape
    return t.new_empty(s, b, np_local, hn).permute(1, 2, 0, 3)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """The kernels read rows of head-dim contiguous elements (any strides above them)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _extents(slot: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """[2, b, s] int32: per real position the first and one past the last position with its slot (slot
    [b, s] in [0, s]), and (s, 0) — nothing — for the rest."""
    b, s = slot.shape
    position = torch.arange(s, device=slot.device).expand(b, s)
    slot = torch.where(real, slot, s).long()  # the rest: slot s
    first = position.new_full((b, s + 1), s).scatter_reduce(1, slot, position, "amin")
    end = position.new_zeros(b, s + 1).scatter_reduce(1, slot, position + 1, "amax")
    return torch.stack([torch.where(real, first.gather(1, slot), s),
                        torch.where(real, end.gather(1, slot), 0)]).to(torch.int32)


def group_spans(groups: torch.Tensor) -> torch.Tensor:
    """[b, s] `attention_groups` -> [2, b, s] int32: for each real position the first and one past the
    last position of its group — the keys a query may see, and the queries that may see a key (the
    kernels' rule is symmetric) — and (s, 0), nothing, for padding. The kernels visit only the blocks
    between. Ids at or above s share one extent: still every visible pair."""
    return _extents(groups.clamp(max=groups.size(1) - 1), groups >= 0)


def group_runs(groups: torch.Tensor) -> torch.Tensor:
    """[b, s] `attention_groups` -> [2, b, s] int32: for each real position the first and one past the
    last position of the run of equal groups it sits in, (s, 0) for padding. Every query of a run sees
    every key of it (and the reverse): where a block of queries and a block of keys lie in one run, the
    kernels skip the visibility test."""
    start = torch.ones_like(groups, dtype=torch.bool)
    start[:, 1:] = groups[:, 1:] != groups[:, :-1]
    return _extents(start.cumsum(1) - 1, groups >= 0)  # a run's index: below s


def kernel_spans(groups: torch.Tensor) -> torch.Tensor:
    """[4, b, s] int32, what the kernels read: `group_spans`, then `group_runs`."""
    return torch.cat([group_spans(groups), group_runs(groups)])


def _kernel_inputs(q, slopes, groups, spans, bits, dropped: int, half_window: int) -> tuple:
    """(slopes, groups, spans, bits, flags) as the kernels take them: placeholders where a feature is off
    (its loads are compiled out); bits are dropout's, the seed (forward) or the query bits (backward);
    flags are the kernels' HAS_ALIBI, HAS_GROUPS, HAS_WINDOW and DROPPED."""
    placeholder = q.new_empty(1, dtype=torch.int32)  # never read: no fill kernel per call
    flags = {"HAS_ALIBI": slopes is not None, "HAS_GROUPS": groups is not None, "HAS_WINDOW": half_window >= 0,
             "DROPPED": dropped}
    return (placeholder if slopes is None else slopes.float().contiguous(),
            placeholder if groups is None else groups.to(torch.int32).contiguous(),
            placeholder if groups is None else spans.contiguous(),
            placeholder if bits is None else bits, flags)


def _heads(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """(q, k, v) [b, np, s, hn] as the op's arguments give them: three tensors, or one, q, holding each head's
    query, key and value side by side ([b, np, s, 3 · hn], the QKV projection's layout; k and v None), split
    into views of it."""
    return (q, k, v) if k is not None else split_qkv(q)  # [b, np, s, 3 hn] -> 3 x [b, np, s, hn]


def forward_launch(q, k, v, slopes, groups, spans, seed, scale: float, offset: float, dropped: int,
                   half_window: int) -> tuple[Launch, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(the forward kernel's launch, (out, lse, query_bits)) for `_attention_op`'s arguments."""
    if dropped and q.size(2) > _DROPOUT_POSITIONS:  # the kernels fold a step of the hash into each query's bits
        raise ValueError(f"model.attention_backend=triton's attention dropout takes sequences of at most "
                         f"{_DROPOUT_POSITIONS} positions, not {q.size(2)}; use flex or sdpa")
    q, k, v = (_rows(t) for t in _heads(q, k, v))
    outputs = _attention_fake(q, k, v, slopes, groups, spans, seed, scale, offset, dropped, half_window, False)
    *inputs, flags = _kernel_inputs(q, slopes, groups, spans, seed, dropped, half_window)
    launch = kernel_forward(q, k, v, *outputs, *inputs, scale, offset, level_keep_scale(dropped), half_window, flags)
    return launch, outputs


def softmax_row_terms(do: torch.Tensor, out: torch.Tensor, dropped: int) -> torch.Tensor:
    """[b, np, s, hn] -> [b, np, s] fp32: Σ_d dO·O per query, the softmax backward's row term (O includes
    dropout), divided by the keep scale, which the kernels apply once per program (`kernel_backward`).
    Computed outside the backward op, in the autograd formula, so that in a compiled layer Inductor fuses
    the cast, the product and the sum into one pass (eager: three kernels and an fp32 copy of dO)."""
    # an fp32 copy of dO times O, promoted in the product: one fp32 copy where .float() twice made three
    delta = do.to(torch.float32, copy=True).mul_(out).sum(-1)
    return delta / level_keep_scale(dropped) if dropped else delta


def backward_launches(do, q, k, v, delta, lse, query_bits, slopes, groups, spans, scale: float, offset: float,
                      dropped: int, half_window: int, slope_grad: bool,
                      atomic_dq: bool = False) -> tuple[tuple[Callable[[], None], ...], tuple[torch.Tensor, ...]]:
    """(the backward's calls in order, (dq, dk, dv, shares)) for `_attention_backward_op`'s arguments; delta:
    `softmax_row_terms`. For one q holding q, k and v (`_heads`), dq is their gradient in that layout, whose
    thirds the kernels fill (nothing to concatenate after them), and dk, dv are empty. The calls: the dK/dV
    kernel, then the dQ kernel; with atomic_dq (model.triton_dq=atomic) the dK/dV kernel, which adds dQ into an
    fp32 sum, then its scaling into dq."""
    grads = _attention_backward_fake(do, q, k, v, delta, lse, query_bits, slopes, groups, spans, scale, offset,
                                     dropped, half_window, atomic_dq, slope_grad)[:3]
    # [b, np, s, hn] each, with the one set of strides the kernels write them in
    dq, dk, dv = _heads(grads[0], None, None) if k is None else grads
    do, q, k, v = (_rows(t) for t in (do, *_heads(q, k, v)))
    delta = delta.contiguous()  # the kernels read [b, np, s]; Inductor may lay a fused reduction out otherwise
    b, np_local, s, _ = q.shape
    # [b, np, s, 2]: each query's share (the kernel writes every query's, whatever its block size); without
    # slope_grad a placeholder, never written (as _kernel_inputs': no null pointer for the launcher)
    shares = (q.new_zeros if atomic_dq else q.new_empty)((b, np_local, s, 2) if slope_grad else (1,),
                                                         dtype=torch.float32)
    # dQ / (scale · keep_scale), summed over the blocks of keys by the dK/dV kernel's atomic adds
    dq_sum = q.new_zeros(q.shape, dtype=torch.float32) if atomic_dq else None
    *inputs, flags = _kernel_inputs(q, slopes, groups, spans, query_bits, dropped, half_window)
    keep = level_keep_scale(dropped)
    launches = kernel_backward(do, q, k, v, lse, delta, dq, dk, dv, shares, *inputs, scale, offset, keep, half_window,
                               flags, slope_grad, dq_sum)
    if atomic_dq:
        # dq = dq_sum · scale · keep_scale in dq's dtype and layout: one pass (a read of 4 bytes, a write of 2)
        launches = (*launches, functools.partial(torch.mul, dq_sum, scale * keep, out=dq))
    return launches, (*grads, shares)


@torch.library.custom_op("megamlm::triton_attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, slopes: torch.Tensor | None,
                  groups: torch.Tensor | None, spans: torch.Tensor | None, seed: torch.Tensor | None, scale: float,
                  offset: float, dropped: int, half_window: int,
                  atomic_dq: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (out [b, np, s, hn], lse [b, np, s] fp32 in log2 units, query_bits); q, k, v: `_heads`. half_window
    -1: no window. atomic_dq: the backward's (`backward_launches`), kept for it.
    query_bits [b, np, s] int32: the dropout hash per query (triton_dropout's `query_bits_of`), for the
    backward (in the dK/dV kernel every thread would compute them for each of its queries, each block:
    half again the hash's work); without dropout a placeholder, never read."""
    launch, outputs = forward_launch(q, k, v, slopes, groups, spans, seed, scale, offset, dropped, half_window)
    launch()
    return outputs


@_attention_op.register_fake
def _attention_fake(q, k, v, slopes, groups, spans, seed, scale, offset, dropped, half_window, _atomic_dq):
    q = _heads(q, k, v)[0]
    b, np_local, s, hn = q.shape
    return (_like_sbh(q), q.new_empty(b, np_local, s, dtype=torch.float32),
            q.new_empty((b, np_local, s) if dropped else (1,), dtype=torch.int32))


@torch.library.custom_op("megamlm::triton_attention_backward", mutates_args=())
def _attention_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                           delta: torch.Tensor, lse: torch.Tensor, query_bits: torch.Tensor,
                           slopes: torch.Tensor | None, groups: torch.Tensor | None, spans: torch.Tensor | None,
                           scale: float, offset: float, dropped: int, half_window: int, atomic_dq: bool,
                           slope_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> dq, dk, dv (`backward_launches`: for one q holding all three, its gradient and two empty tensors) and,
    with slope_grad, the slopes' [2, np] (else an empty tensor)."""
    launches, (dq, dk, dv, shares) = backward_launches(do, q, k, v, delta, lse, query_bits, slopes, groups, spans,
                                                       scale, offset, dropped, half_window, slope_grad, atomic_dq)
    for launch in launches:
        launch()
    # [b, np, s, 2] -> [2, np], in the slopes' dtype
    dslopes = shares.sum((0, 2)).t().contiguous().to(slopes.dtype) if slope_grad else shares.new_empty(0)
    return dq, dk, dv, dslopes


@_attention_backward_op.register_fake
def _attention_backward_fake(do, q, k, v, delta, lse, query_bits, slopes, groups, spans, scale, offset, dropped,
                             half_window, atomic_dq, slope_grad):
    # one q holding q, k and v: its gradient in that layout, [s, b, np, 3 hn] in memory, and no dk, dv
    grads = (_like_sbh(q), q.new_empty(0), q.new_empty(0)) if k is None else (_like_sbh(q), _like_sbh(q), _like_sbh(q))
    return (*grads, slopes.new_empty(slopes.shape) if slope_grad else q.new_empty(0, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    q, k, v, slopes, groups, spans, _seed, scale, offset, dropped, half_window, atomic_dq = inputs
    ctx.save_for_backward(q, k, v, *output, slopes, groups, spans)  # out, lse, query_bits: the seed's work done
    ctx.constants = scale, offset, dropped, half_window, atomic_dq


def _backward(ctx, do, _lse_grad, _bits_grad):
    q, k, v, out, lse, query_bits, slopes, groups, spans = ctx.saved_tensors
    slope_grad = ctx.needs_input_grad[3]  # learned ALiBi slopes
    dropped = ctx.constants[2]
    dq, dk, dv, dslopes = _attention_backward_op(do, q, k, v, softmax_row_terms(do, out, dropped), lse, query_bits,
                                                 slopes, groups, spans, *ctx.constants, slope_grad)
    dk, dv = (None, None) if k is None else (dk, dv)  # one q holding q, k and v: dq is its gradient
    return dq, dk, dv, dslopes if slope_grad else None, None, None, None, None, None, None, None, None


_attention_op.register_autograd(_backward, setup_context=_setup_context)


def triton_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, slopes: torch.Tensor | None,
                     offset: float, groups: torch.Tensor | None, dropout_p: float, seed: torch.Tensor | None,
                     scale: float | None = None, window: int | None = None, spans: torch.Tensor | None = None,
                     atomic_dq: bool = False) -> torch.Tensor:
    """q, k, v [b, np, s, hn] -> [b, np, s, hn] (memory laid out [s, b, np, hn]): softmax(q·kᵀ·scale +
    ALiBi(slopes [np], or [2, np] for keys before and after the query; offset)) over the keys each query
    sees (groups [b, s], `attention_groups`, None: all; a padding query sees none and gets zeros;
    `window`: within window // 2 positions), dropout p on the probabilities with flex.py's mask of `seed`
    (int64 on the device), @ v. spans: `kernel_spans(groups)` where the caller has them (one forward's
    layers share them). q may hold all three, k and v None (`_heads`, the QKV projection's layout): the
    backward then writes q's gradient whole, where three of them would be concatenated after it. atomic_dq:
    the backward's dQ by atomic adds in the dK/dV kernel (model.triton_dq, `backward_launches`)."""
    scale = _heads(q, k, v)[0].size(-1) ** -0.5 if scale is None else scale
    dropped = dropped_levels(dropout_p)
    spans = kernel_spans(groups) if groups is not None and spans is None else spans
    slopes = slopes if slopes is None or slopes.dim() == 2 else slopes.expand(2, -1)  # before, after
    out, _, _ = _attention_op(q, k, v, slopes, groups, spans, seed if dropped else None, scale, offset, dropped,
                              -1 if window is None else window // 2, atomic_dq)
    return out


def materialized_bias(slopes, offset: float, groups, s: int, dtype: torch.dtype, device,
                      window: int | None = None) -> torch.Tensor:
    """The additive bias [b|1, np|1, s, s] the kernels apply without building it: ALiBi (slopes [np], [2, np]
    before / after, or None) and -inf where a query does not see a key: `group_sees` (groups [b, s] or
    None), but a padding query sees no key (the kernels' rule: a row of -inf), and `pattern_sees` the window."""
    bias = torch.zeros(1, 1, s, s, dtype=dtype, device=device)
    if slopes is not None:
        before, after = slopes.expand(2, -1)
        bias = bias + alibi_bias(before, after, s, s, offset).to(dtype)[None]
    if groups is not None:  # [b, 1, s, 1] vs [b, 1, 1, s] -> [b, 1, s, s]
        query, key = groups[:, None, :, None], groups[:, None, None, :]
        bias = bias.masked_fill(~(group_sees(query, key) & (query >= 0)), float("-inf"))
    if window is not None:  # positions in the row: a visible pair is in one sample, where distances agree
        index = torch.arange(s, device=device)
        near = pattern_sees(LayerAttention(window=window), index[:, None], index[None, :], None)
        bias = bias.masked_fill(~near, float("-inf"))
    return bias


def materialized_attention(q, k, v, slopes, offset: float, groups, dropout_p: float, seed, scale: float | None = None,
                           window: int | None = None):
    """What `triton_attention` computes, every [b, np, s, s] tensor materialized (the tests' and
    benchmarks/triton_check.py's reference; run it in fp64 for one)."""
    b, np_local, s, hn = q.shape
    scores = q @ k.transpose(-1, -2) * (hn ** -0.5 if scale is None else scale)  # [b, np, s, s]
    scores = scores + materialized_bias(slopes, offset, groups, s, scores.dtype, q.device, window)
    seen = scores.isfinite().any(-1, keepdim=True)  # [b, np, s, 1]: a query that sees no key gets zeros
    probs = torch.softmax(scores.masked_fill(~seen, 0.0), -1) * seen  # (and no NaN in the gradient)
    if dropout_p > 0:  # the [b, np, s, s] grid of (row, head, query, key) indices
        index = [torch.arange(n, device=q.device).view([-1 if d == i else 1 for d in range(4)])
                 for i, n in enumerate((b, np_local, s, s))]
        probs = probs * keep_mask(seed, dropout_p, *index) * keep_scale(dropout_p)
    return probs @ v


class TritonInputs(NamedTuple):
    """What TritonAttention prepares once per forward and attention pattern."""

    groups: torch.Tensor | None
    """[b, s] int32 `attention_groups`; None where every query sees its whole row."""
    slopes: torch.Tensor | None
    """ALiBi's slopes: [np] fixed, [2, np] learned (before, after; their gradient flows); None: no score term."""
    offset: float
    """ALiBi's offset (0 without ALiBi)."""
    spans: torch.Tensor | None = None
    """`kernel_spans(groups)`: the blocks the kernels visit, and those they need not mask."""
    window: int | None = None
    """The pattern's window (None: a global layer)."""


class TritonAttention(AttentionBackend):
    """The layout as `attention_groups` and their spans, ALiBi as slopes, a local layer's window."""

    name = "triton"
    additive_bias = False

    def __init__(self, position, atomic_dq: bool = False):
        super().__init__(position)
        self.atomic_dq = atomic_dq
        """The backward's dQ by atomic adds in the dK/dV kernel (model.triton_dq=atomic)."""

    @classmethod
    def with_settings(cls, model: ModelConfig, position) -> TritonAttention:
        return cls(position, model.triton_dq == "atomic")

    @staticmethod
    def unsupported_here(model: ModelConfig) -> str | None:
        if model.local_window is not None and model.local_attention != "window":
            return (f"model.attention_backend=triton has no model.local_attention={model.local_attention} (only "
                    "sliding windows); use model.attention_backend=flex (or sdpa)")
        if model.head_dim < 16 or model.head_dim & (model.head_dim - 1):
            return f"model.attention_backend=triton needs a head dim that is a power of 2 >= 16, not {model.head_dim}"
        if kernel_forward is None or not (torch.cuda.is_available() or INTERPRET):
            return "model.attention_backend=triton needs a CUDA GPU and the triton package; use sdpa"
        if model.triton_dq == "atomic" and torch.are_deterministic_algorithms_enabled():
            return ("model.triton_dq=atomic sums dQ in an order that varies from run to run, and "
                    "torch.use_deterministic_algorithms(True) is set; use model.triton_dq=recompute")
        return None

    def prepare(self, padding, documents, segments, dtype, pattern=GLOBAL_ATTENTION, reads=None):
        """-> TritonInputs."""
        reads = reads or LayoutReads(padding, documents, segments)
        whole_rows = documents is None and segments is None and reads.any_padding(free_only=True) is False
        groups = None if whole_rows else attention_groups(padding, documents, segments).to(torch.int32)
        alibi = self.position if self.position.score_term else None
        slopes = None if alibi is None else alibi.score_params() if alibi.mode == "learned" else alibi.slopes
        return TritonInputs(groups, slopes, 0.0 if alibi is None else alibi.offset,
                            None if groups is None else kernel_spans(groups), pattern.window)

    def attend(self, q, k, v, prepared: TritonInputs, dropout_p: float, scale: float | None) -> torch.Tensor:
        # heads are sharded: the seed comes from this TP rank's stream (flex.py)
        seed = draw_seed(q.device) if dropout_p > 0 else None
        return triton_attention(q, k, v, prepared.slopes, prepared.offset, prepared.groups, dropout_p, seed, scale,
                                prepared.window, prepared.spans, self.atomic_dq)

    def attend_unsplit(self, qkv, prepared: TritonInputs, dropout_p: float, scale: float | None) -> torch.Tensor:
        # the kernels read q, k and v as views and write their gradients into one tensor in qkv's layout
        return self.attend(qkv, None, None, prepared, dropout_p, scale)
