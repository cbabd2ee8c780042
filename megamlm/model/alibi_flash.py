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

import torch

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
        no_bias = torch.empty(0, device=q.device, dtype=q.dtype)
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse.reshape(lse_shape).contiguous(), seed, offset, no_bias, cum_q, cum_k,
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
            out = alibi_flash_attention(*inputs, slopes, 0.5, padding, 0.0, None, candidate)
            results.append([out, *torch.autograd.grad(out, inputs, grad)])
        except Exception as err:  # noqa: BLE001 - a private op this torch lacks or calls otherwise
            return f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
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


def _augment(q, k, v, slopes, key_padding, scale):
    """q, k, v [b, np, s, hn] -> (q for the before pass, q for the after pass, k, v) [b, np, s, hn + pad]."""
    b, np_local, s, hn = q.shape
    width = -(-(hn + EXTRA) // 8) * 8
    # [np, 1] * [s] -> [np, s]: the key column m (j - c) / scale, in three parts [np, s, 3]
    positions = torch.arange(s, device=q.device, dtype=torch.float64) - s // 2
    column = _split3(slopes.double()[:, None] * positions / scale, q.dtype)
    k_aug = q.new_zeros(b, np_local, s, width)
    k_aug[..., :hn] = k
    k_aug[..., hn:hn + 3] = column
    if key_padding is not None:  # [b, s] -> [b, 1, s]: padded keys lowered on both sides
        masked = min(MASKED / scale, torch.finfo(q.dtype).max / 2)
        k_aug[..., hn + 3] = (key_padding.to(q.dtype) * -masked)[:, None, :]
    q_before = q.new_zeros(b, np_local, s, width)
    q_before[..., :hn] = q
    q_before[..., hn:hn + 4] = 1
    v_aug = torch.nn.functional.pad(v, (0, width - hn))
    return q_before, _query_after(q_before, hn), k_aug, v_aug


def _query_after(q_before: torch.Tensor, hn: int) -> torch.Tensor:
    """The after pass's queries: the before pass's with the key column's sign turned (-m (j - c))."""
    q_after = q_before.clone()
    q_after[..., hn:hn + 3] = -1
    return q_after


def _after_pass(t: torch.Tensor, first: int) -> torch.Tensor:
    """The after pass's input from [b, np, s, ...]: rows first..first+s-2, reversed (queries: first=0,
    keys: first=1). Its outputs [b, np, s-1, ...] come back in order with `.flip(2)`."""
    s = t.size(2)
    return t[:, :, first:first + s - 1].flip(2)


class _AlibiFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, slopes, offset, key_padding, dropout_p, scale, kernel):
        s = q.size(2)
        q_before, q_after, k_aug, v_aug = _augment(q, k, v, slopes, key_padding, scale)
        out_before, lse_before, state_before = kernel.forward(q_before, k_aug, v_aug, dropout_p, scale)
        out_after, lse_after, state_after = kernel.forward(
            _after_pass(q_after, 0), _after_pass(k_aug, 1), _after_pass(v_aug, 1), dropout_p, scale)
        # [np, s]: the query parts m (i - c), added back to each pass's log-sum-exp
        query_part = slopes.float()[:, None] * (torch.arange(s, device=q.device) - s // 2)
        after_constant = query_part + slopes.float()[:, None] * offset
        true_before = lse_before - query_part
        # the last query has no key after it: its after pass is empty (-inf)
        true_after = torch.nn.functional.pad(lse_after.flip(2) + after_constant[:, :-1], (0, 1), value=float("-inf"))
        lse = torch.logaddexp(true_before, true_after)
        # [b, np, s] -> [b, np, s, 1] weights of each pass's normalized output
        after_out = torch.nn.functional.pad(out_after.flip(2).float(), (0, 0, 0, 1))
        out = (torch.exp(true_before - lse)[..., None] * out_before.float()
               + torch.exp(true_after - lse)[..., None] * after_out).to(q.dtype)
        # the passes' states (dropout seeds, kernel layouts): tensors saved as tensors, the rest on ctx
        states = (*state_before, *state_after)
        ctx.save_for_backward(q_before, k_aug, v_aug, out, lse, query_part, after_constant,
                              *(t for t in states if isinstance(t, torch.Tensor)))
        ctx.states = [None if isinstance(t, torch.Tensor) else t for t in states]
        ctx.state_split, ctx.dropout_p, ctx.scale, ctx.kernel, ctx.hn = len(state_before), dropout_p, scale, \
            kernel, q.size(-1)
        return out[..., :ctx.hn]

    @staticmethod
    def backward(ctx, grad):
        q_before, k_aug, v_aug, out, lse, query_part, after_constant, *saved = ctx.saved_tensors
        saved = iter(saved)
        states = [next(saved) if value is None else value for value in ctx.states]
        state_before, state_after = states[:ctx.state_split], states[ctx.state_split:]
        kernel, p, scale, hn = ctx.kernel, ctx.dropout_p, ctx.scale, ctx.hn
        g = torch.nn.functional.pad(grad, (0, out.size(-1) - hn)).to(out.dtype).contiguous()
        # each pass's flash backward, given the merged output and log-sum-exp in that pass's units
        dq, dk, dv = kernel.backward(g, q_before, k_aug, v_aug, out, (lse + query_part).contiguous(), p, scale,
                                     state_before)
        lse_after = (lse - after_constant)[:, :, :-1].flip(2).contiguous()
        dq_after, dk_after, dv_after = kernel.backward(
            _after_pass(g, 0).contiguous(), _after_pass(_query_after(q_before, hn), 0), _after_pass(k_aug, 1),
            _after_pass(v_aug, 1),
            _after_pass(out, 0).contiguous(), lse_after, p, scale, state_after)
        dq, dk, dv = dq.float(), dk.float(), dv.float()
        dq[:, :, :-1] += dq_after.flip(2).float()
        dk[:, :, 1:] += dk_after.flip(2).float()
        dv[:, :, 1:] += dv_after.flip(2).float()
        dtype = grad.dtype
        return dq[..., :hn].to(dtype), dk[..., :hn].to(dtype), dv[..., :hn].to(dtype), None, None, None, None, \
            None, None


def alibi_flash_attention(q, k, v, slopes: torch.Tensor, offset: float, key_padding: torch.Tensor | None,
                          dropout_p: float = 0.0, scale: float | None = None, kernel=None) -> torch.Tensor:
    """softmax(q·kᵀ·scale + ALiBi, padded keys masked) (dropout) @ v without a bias tensor.

    q, k, v [b, np, s, hn]; slopes [np] (this rank's heads); offset: ALiBi's for keys after the query
    (0 symmetric, 0.5 "offset"); key_padding [b, s] bool (True: padded) or None; kernel: a `KERNELS`
    instance (default: the reference on CPU). -> [b, np, s, hn]."""
    scale = scale if scale is not None else q.size(-1) ** -0.5
    if q.size(2) < 2:
        raise ValueError("alibi-flash attention needs at least 2 positions")
    kernel = kernel if kernel is not None else ReferenceKernel()
    return _AlibiFlash.apply(q, k, v, slopes, offset, key_padding, dropout_p, scale, kernel)
