"""ALiBi attention on causal flash kernels, without a bias tensor (model.attention_backend=alibi-flash).

ALiBi's score term is linear in the key's position on each side of the query (c: any fixed position;
the sequence's middle keeps the numbers small):
    keys at or before the query (j <= i):  -m (i - j)           =  m (j - c) - m (i - c)
    keys after it (j > i):                 -m (j - i - offset)  = -m (j - c) + m (i - c) + m offset
The key part ±m (j - c) is a product of a query column (±1) and a key column (m (j - c) / scale), so it
rides in extra head dimensions of q and k. The query part is the same for every key of one side, so
within a side softmax does not see it. Attention is then two causal flash passes with no bias and no
[s, s] tensor:
    "before": every query, keys j <= i (is_causal);
    "after":  queries 0..s-2 and keys 1..s-1, both reversed, so that j > i becomes causal.
Their outputs merge by their log-sum-exps, each corrected by its query part (as ring attention merges
blocks). The backward runs each pass's flash backward with the merged output and log-sum-exp, which is
the full softmax's gradient restricted to that pass's keys; with dropout, each pass replays its own
masks (a kernel's dropout is per score, so the merge keeps it exact).

The extra head dimensions (64 -> 72, a multiple of 8 as the kernels want):
- the key column in three parts of the input dtype (hi + mid + lo: 24 bits; in bf16 one column
  alone would round m (j - c) * 8 at 2048 positions to +-16, far coarser than the scores),
- a padding column, -MASKED / scale on padded keys (0 elsewhere) against a query column of ones: a
  padded key's probability is exp(-5000) = 0, whichever side it is on.

`KERNELS` holds the flash passes: torch's private FlashAttention-2 and cuDNN ops on CUDA, and
`ReferenceKernel`, the same contract in plain fp32 matmuls (the CPU, the tests; no dropout).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from megamlm.errors import error_line

EXTRA = 4
"""Extra head dimensions: the key column's three parts and the padding column."""

MASKED = 5e3
"""What a padded key's score is lowered by (at most): its probability underflows to exactly 0 in fp32.
Its column, -MASKED / scale, must stay finite in the input dtype (an inf would turn the backward's zero
products into NaN): in fp16 it is -40,000 at head dim 64, and capped at half fp16's largest value."""


class ReferenceKernel:
    """A causal flash pass's contract in plain matmuls (fp32 inside): `forward(q, k, v, dropout_p,
    scale) -> (out, lse [b, np, s] fp32, state)` and `backward(grad_out, q, k, v, out, lse, dropout_p,
    scale, state) -> (dq, dk, dv)`, where the backward takes any output and log-sum-exp (the merged
    ones), as flash kernels do. [b, np, s, hn] in and out."""

    name = "reference"

    @staticmethod
    def _scores(q, k, scale):
        # [b, np, s, hn] x [b, np, hn, s] -> [b, np, s, s]; keys after the query masked
        scores = scale * q.float() @ k.float().transpose(-1, -2)
        s = q.size(2)
        after = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        return scores.masked_fill(after, float("-inf"))

    def forward(self, q, k, v, dropout_p: float, scale: float):
        if dropout_p > 0:
            raise ValueError("model.attention_backend=alibi-flash has attention dropout on a GPU in bf16 / fp16 "
                             "only (here its plain-matmul reference pass runs); set model.attention_dropout=0")
        scores = self._scores(q, k, scale)
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.exp(scores - lse[..., None]) @ v.float()
        return out.to(q.dtype), lse, ()

    def backward(self, grad_out, q, k, v, out, lse, dropout_p: float, scale: float, state):
        probs = torch.exp(self._scores(q, k, scale) - lse[..., None])
        g, v32 = grad_out.float(), v.float()
        dv = probs.transpose(-1, -2) @ g
        # softmax's backward: dS = P (dP - rowsum(dO * O))
        ds = probs * (g @ v32.transpose(-1, -2) - (g * out.float()).sum(-1, keepdim=True))
        dq, dk = scale * ds @ k.float(), scale * ds.transpose(-1, -2) @ q.float()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlashKernel:
    """torch's FlashAttention-2 (CUDA), causal: `aten._scaled_dot_product_flash_attention` and its
    backward, which takes the output and log-sum-exp to use."""

    name = "flash"

    def forward(self, q, k, v, dropout_p: float, scale: float):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, dropout_p, True, False, scale=scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(self, grad_out, q, k, v, out, lse, dropout_p: float, scale: float, state):
        cum_q, cum_k, max_q, max_k, seed, offset = state
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, True, seed, offset, scale=scale)


class CudnnKernel:
    """cuDNN's fused attention (CUDA), causal: `aten._scaled_dot_product_cudnn_attention` and its
    backward (its log-sum-exp is [b, np, s, 1])."""

    name = "cudnn"

    def forward(self, q, k, v, dropout_p: float, scale: float):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, dropout_p, True, False, scale=scale)
        return out, lse.view(q.shape[:3]), (cum_q, cum_k, max_q, max_k, seed, offset, lse.shape)

    def backward(self, grad_out, q, k, v, out, lse, dropout_p: float, scale: float, state):
        cum_q, cum_k, max_q, max_k, seed, offset, lse_shape = state
        # attn_bias None, an undefined tensor as autograd passes it: torch 2.11 checks an empty tensor as a
        # bias ("expects either a 2D, 3D, or 4D attn_bias but got 1D", the H200, session 24)
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse.reshape(lse_shape).contiguous(), seed, offset, None, cum_q, cum_k,
            max_q, max_k, dropout_p, True, scale=scale)


KERNELS = {cls.name: cls for cls in (CudnnKernel, FlashKernel, ReferenceKernel)}
"""The flash passes by name; on CUDA tried in this order (`alibi-flash`'s first use checks each)."""


_CHOSEN: dict[torch.device, object] = {}


def flash_kernel(device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """The flash pass for `device` and `dtype`: on CUDA in 16 bits the first of `KERNELS` whose fused
    ALiBi attention (forward and backward) matches the reference pass's on a small problem, checked
    once per device (the private ops' signatures and layouts move between torch versions); elsewhere
    (the CPU, fp32, which the flash kernels do not take) the reference."""
    device = torch.device(device)
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return ReferenceKernel()
    if device not in _CHOSEN:
        failures = []
        for cls in KERNELS.values():
            if cls is ReferenceKernel:
                continue
            problem = check_kernel(cls(), device)
            if problem is None:
                _CHOSEN[device] = cls()
                if failures:  # which op runs, and why not the preferred one (the GPU lease reads it)
                    warnings.warn(f"alibi-flash runs {cls.name} passes; not taken: {'; '.join(failures)}")
                break
            failures.append(f"{cls.name}: {problem}")
        else:
            raise RuntimeError("model.attention_backend=alibi-flash: no flash kernel of this torch passed its check ("
                               + "; ".join(failures) + "); use model.attention_backend=sdpa")
    return _CHOSEN[device]


def check_kernel(kernel, device: torch.device) -> str | None:
    """None if `kernel` gives the reference pass's ALiBi attention and gradients (bf16, 2 x 4 heads
    x 200 positions with padding); else what went wrong."""
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad = (torch.randn(2, 4, 200, 64, device=device, generator=generator).to(torch.bfloat16)
                     for _ in range(4))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=device)
    padding = torch.zeros(2, 200, dtype=torch.bool, device=device)
    padding[1, 150:] = True
    results = []
    for candidate in (kernel, ReferenceKernel()):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        try:
            out = alibi_flash_attention(*inputs, alibi_terms(slopes, 0.5, padding, 200, 64, torch.bfloat16),
                                        0.0, candidate)
            results.append([out, *torch.autograd.grad(out, inputs, grad)])
        except Exception as err:  # noqa: BLE001 - a private op this torch lacks or calls otherwise
            return f"{type(err).__name__}: {error_line(err)[:120]}"
    # relative to each tensor's largest value; bf16 rounding gives ~1e-2
    worst = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(*results))
    return None if worst < 0.05 else f"differs from the reference pass by {worst:.3g} (relative)"


def _split3(column: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[...] float64 -> [..., 3] in `dtype` whose sum is `column` to 24 bits (hi, mid, lo)."""
    parts, rest = [], column
    for _ in range(3):
        part = rest.to(dtype)
        parts.append(part)
        rest = rest - part.double()
    return torch.stack(parts, dim=-1)


@dataclass
class AlibiTerms:
    """What every layer's alibi-flash attention shares in one forward (`alibi_terms`): the extra head
    dimensions, and the query parts each pass's log-sum-exp is corrected by."""

    key_extra: torch.Tensor
    """[b|1, np, s, w]: the key column m (j - c) / scale in three parts, the padding column, zeros to a
    multiple of 8 (w = 8 at head dim 64)."""
    query_before: torch.Tensor
    """[1, 1, 1, w]: the queries' extra dimensions in the before pass (ones), `query_after` (the key
    column's sign turned: -m (j - c))."""
    query_after: torch.Tensor
    query_part: torch.Tensor
    """[np, s] fp32: m (i - c), which the before pass's scores lack; `after_constant` = m (i - c) + m
    offset, which the after pass's have too much of."""
    after_constant: torch.Tensor
    head_dim: int
    scale: float


def alibi_terms(slopes: torch.Tensor, offset: float, key_padding: torch.Tensor | None, length: int, head_dim: int,
                dtype: torch.dtype, scale: float | None = None) -> AlibiTerms:
    """slopes [np] (this rank's heads); offset: ALiBi's for keys after the query (0 symmetric, 0.5
    "offset"); key_padding [b, s] bool (True: padded) or None; scale: the softmax's (None: 1/sqrt(head_dim))."""
    scale = scale if scale is not None else head_dim ** -0.5
    np_local, device = slopes.numel(), slopes.device
    width = -(-(head_dim + EXTRA) // 8) * 8 - head_dim
    # [np, 1] * [s] -> [np, s]: the key column m (j - c) / scale, in three parts [np, s, 3]
    centered = torch.arange(length, device=device, dtype=torch.float64) - length // 2
    column = _split3(slopes.double()[:, None] * centered / scale, dtype)
    batch = 1 if key_padding is None else key_padding.size(0)
    key_extra = torch.zeros(batch, np_local, length, width, dtype=dtype, device=device)
    key_extra[..., :3] = column
    if key_padding is not None:  # [b, s] -> [b, 1, s]: padded keys lowered on both sides
        masked = min(MASKED / scale, torch.finfo(dtype).max / 2)
        key_extra[..., 3] = (key_padding.to(dtype) * -masked)[:, None, :]
    query_before = torch.zeros(1, 1, 1, width, dtype=dtype, device=device)
    query_before[..., :4] = 1
    query_after = query_before.clone()
    query_after[..., :3] = -1
    query_part = slopes.float()[:, None] * centered.float()
    return AlibiTerms(key_extra, query_before, query_after, query_part,
                      query_part + slopes.float()[:, None] * offset, head_dim, scale)


def _with(t: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """[b, np, s, hn] and extra [b|1, np|1, s|1, w] -> [b, np, s, hn + w]."""
    return torch.cat([t, extra.expand(*t.shape[:3], extra.size(-1))], dim=-1)


def _after_pass(t: torch.Tensor, first: int) -> torch.Tensor:
    """The after pass's input from [b, np, s, ...]: rows first..first+s-2, reversed (queries: first=0,
    keys: first=1). Its outputs [b, np, s-1, ...] come back in order with `.flip(2)`."""
    s = t.size(2)
    return t[:, :, first:first + s - 1].flip(2)


_SAVED = object()
"""In `_AlibiFlash`'s ctx.states: this state is a tensor, in ctx.saved_tensors."""


class _AlibiFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, terms: AlibiTerms, dropout_p, kernel):
        hn, scale = q.size(-1), terms.scale
        q_before, k_aug = _with(q, terms.query_before), _with(k, terms.key_extra)
        v_aug = torch.nn.functional.pad(v, (0, terms.key_extra.size(-1)))
        out_before, lse_before, state_before = kernel.forward(q_before, k_aug, v_aug, dropout_p, scale)
        out_after, lse_after, state_after = kernel.forward(
            _after_pass(_with(q, terms.query_after), 0), _after_pass(k_aug, 1), _after_pass(v_aug, 1), dropout_p, scale)
        true_before = lse_before - terms.query_part
        # the last query has no key after it: its after pass is empty (-inf)
        true_after = torch.nn.functional.pad(lse_after.flip(2) + terms.after_constant[:, :-1], (0, 1),
                                             value=float("-inf"))
        lse = torch.logaddexp(true_before, true_after)
        # [b, np, s] -> [b, np, s, 1] weights of each pass's normalized output
        after_out = torch.nn.functional.pad(out_after.flip(2), (0, 0, 0, 1))
        out = (torch.exp(true_before - lse)[..., None] * out_before
               + torch.exp(true_after - lse)[..., None] * after_out).to(q.dtype)
        # the passes' states (dropout seeds, kernel layouts): tensors saved as tensors, the rest (sizes,
        # the None of an undefined tensor) on ctx
        states = (*state_before, *state_after)
        ctx.save_for_backward(q, k_aug, v_aug, out, lse, *(t for t in states if isinstance(t, torch.Tensor)))
        ctx.states = [_SAVED if isinstance(t, torch.Tensor) else t for t in states]
        ctx.state_split, ctx.terms, ctx.dropout_p, ctx.kernel = len(state_before), terms, dropout_p, kernel
        return out[..., :hn]

    @staticmethod
    def backward(ctx, grad):
        q, k_aug, v_aug, out, lse, *saved = ctx.saved_tensors
        saved = iter(saved)
        states = [next(saved) if value is _SAVED else value for value in ctx.states]
        state_before, state_after = states[:ctx.state_split], states[ctx.state_split:]
        terms, kernel, p, hn = ctx.terms, ctx.kernel, ctx.dropout_p, q.size(-1)
        g = torch.nn.functional.pad(grad, (0, out.size(-1) - hn)).to(out.dtype)
        # each pass's flash backward, given the merged output and log-sum-exp in that pass's units
        dq, dk, dv = kernel.backward(g, _with(q, terms.query_before), k_aug, v_aug, out,
                                     (lse + terms.query_part).contiguous(), p, terms.scale, state_before)
        dq_after, dk_after, dv_after = kernel.backward(
            _after_pass(g, 0), _after_pass(_with(q, terms.query_after), 0), _after_pass(k_aug, 1),
            _after_pass(v_aug, 1), _after_pass(out, 0), (lse - terms.after_constant)[:, :, :-1].flip(2).contiguous(),
            p, terms.scale, state_after)
        dq, dk, dv = dq[..., :hn].float(), dk[..., :hn].float(), dv[..., :hn].float()
        dq[:, :, :-1] += dq_after.flip(2)[..., :hn]
        dk[:, :, 1:] += dk_after.flip(2)[..., :hn]
        dv[:, :, 1:] += dv_after.flip(2)[..., :hn]
        return dq.to(grad.dtype), dk.to(grad.dtype), dv.to(grad.dtype), None, None, None


def alibi_flash_attention(q, k, v, terms: AlibiTerms, dropout_p: float = 0.0, kernel=None) -> torch.Tensor:
    """softmax(q·kᵀ·scale + ALiBi, padded keys masked) (dropout) @ v without a bias tensor.

    q, k, v [b, np, s, hn]; terms: `alibi_terms` for this length, head dim and dtype; kernel: a `KERNELS`
    instance (default: the reference). -> [b, np, s, hn]."""
    if q.size(2) < 2:
        raise ValueError("alibi-flash attention needs at least 2 positions")
    if q.size(-1) != terms.head_dim:
        raise ValueError(f"alibi-flash terms prepared for head dim {terms.head_dim}, attention has {q.size(-1)}")
    return _AlibiFlash.apply(q, k, v, terms, dropout_p, kernel if kernel is not None else ReferenceKernel())
