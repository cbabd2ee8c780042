"""Dropout whose random mask is cheap on CPU; torch's dropout on every other device.

On CPU torch draws one Mersenne-Twister number per element (`bernoulli_`, one thread): measured on
the development machine, 26 ms for a [4, 4, 512, 512] attention-probability tensor, 17% of a tiny
training step. Here one 64-bit draw gives four 16-bit lanes and an element is kept when its lane is
at or above a threshold: 3 ms for the same tensor. The drop probability becomes round(p · 65536) /
65536 (0.1 -> 0.100006) and the kept values are scaled by the exact inverse of the keep probability,
so the expectation is unchanged. GPUs keep torch's fused Philox dropout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_LANES = 4  # int16 lanes per int64 draw
LEVELS = 2**16
"""The masks' resolution (this module's and attention dropout's, flex.py): 16 random bits per element,
dropped below round(p · LEVELS)."""


def dropped_levels(p: float) -> int:
    """Elements whose 16 random bits are below this are dropped: round(p · 2^16)."""
    return round(p * LEVELS)


def level_keep_scale(dropped: int) -> float:
    """1 / the keep probability of the threshold `dropped` (= dropped_levels(p)): the expectation stays."""
    if dropped >= LEVELS:  # p within 2^-17 of 1 (the config allows p < 1): nothing is kept, nothing to scale
        raise ValueError(f"a drop probability of {dropped / LEVELS} at 16-bit resolution (round(p · 2^16) = "
                         f"{dropped}) keeps nothing; use p <= {(LEVELS - 1) / LEVELS}")
    return LEVELS / (LEVELS - dropped)


class _KeepAndScale(torch.autograd.Function):
    """x * keep * scale; backward the same on the gradient, saving only the bool mask."""

    @staticmethod
    def forward(ctx, x, keep, scale):
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return apply_mask(x, keep, scale)

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return apply_mask(grad, keep, ctx.scale), None, None


def apply_mask(x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    """x where `keep` (bool, x's shape), scaled by `scale`; 0.0 elsewhere."""
    # One pass, 0 + scale · x · keep with the bool mask read as bytes: on CPU 0.58-0.68x the time of
    # torch.where(keep, x, 0.0).mul_(scale) (a slow bool select, then a second pass; benchmarks/cpu_dropout.py)
    # and bit for bit the same for finite x: a dropped -x gives 0 + -0.0 = +0.0 where x * keep gives -0.0.
    # A dropped inf or NaN gives NaN, as in F.dropout.
    return torch.addcmul(x.new_zeros(()), x, keep.view(torch.uint8), value=scale)


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """F.dropout(x, p, training), with a 16-bit-resolution mask on CPU (see the module docstring)."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p, training=True)
    dropped = dropped_levels(p)
    if dropped >= LEVELS:
        return x * 0.0  # stays in the graph (zero gradient), as F.dropout with p=1
    words = torch.empty(-(-x.numel() // _LANES), dtype=torch.int64)
    # from=int64 min with no upper bound: every draw is 64 uniform bits
    lanes = words.random_(-(2**63), None).view(torch.int16)[: x.numel()].view(x.shape)
    keep = lanes >= dropped - LEVELS // 2  # int16 lanes are uniform over [-2^15, 2^15)
    return _KeepAndScale.apply(x, keep, level_keep_scale(dropped))
