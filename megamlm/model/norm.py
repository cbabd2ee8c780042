"""The model's norms, one factory for all of them (model.normalization, model.bias).

megatron's layer slots build a norm as `build_module(spec, config=, hidden_size=, eps=)`; `norm_spec`
is that slot for our configuration, and `norm` builds the norms outside the layers (embedding norm,
MLM head). LayerNorm with a bias keeps megatron's choice on a GPU (apex's fused LayerNorm when apex
is installed, torch's otherwise); elsewhere a LayerNorm is `LayerNorm` (torch's, with fp32 statistics
in fp16 on a CPU) and an RMSNorm is torch's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import nn

from megamlm.config import ModelConfig

NORM_TYPES = (nn.LayerNorm, nn.RMSNorm)
"""The norm modules this package builds (initialization sets them to 1 / 0)."""


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm, whose statistics are fp32 for fp16 input on a CPU too, as a GPU's kernel keeps
    them. torch's CPU kernel saves 1/σ in the input's dtype: with BERT's and ALBERT's eps, 1e-12, a zero
    row's 1/σ is 1e6 = inf in fp16, and its backward NaN even where no gradient arrives (the zero rows
    of a packed batch's padding, after the layers' zero-initialized biases). fp32 weights select the
    kernel's fp32 statistics; the output stays fp16. Other dtypes and devices run torch's unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float16 or x.device.type != "cpu":
            return super().forward(x)
        return F.layer_norm(x, self.normalized_shape, self.weight.float(),
                            None if self.bias is None else self.bias.float(), self.eps)


def norm(model: ModelConfig, size: int) -> nn.Module:
    """A norm over the last `size` features: LayerNorm (bias = model.bias) or RMSNorm."""
    if model.normalization == "rmsnorm":
        return nn.RMSNorm(size, eps=model.layernorm_epsilon)
    return LayerNorm(size, eps=model.layernorm_epsilon, bias=model.bias)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / ‖x‖ over the last dim (CLAP's input embeddings and head table). F.normalize's eps, 1e-12, is 0
    in fp16, where a zero row (the vocab-parallel padding rows of the head's table) would become 0 / 0
    = NaN in every logit column and so in the loss: the eps is fp16's smallest normal there, and stays
    1e-12 in fp32 and bf16. The forward is F.normalize's, bit for bit; the backward is `_RowNormalize`'s."""
    return _RowNormalize.apply(x, max(1e-12, torch.finfo(x.dtype).tiny))


class _RowNormalize(torch.autograd.Function):
    """F.normalize with its backward in closed form: dx = (g - y (g · y)) / n, n = max(‖x‖, eps) (g / n
    where the norm is clamped). Autograd's chain through F.normalize (norm, clamp, expand, division)
    runs ~11 passes over the [V, h] head table per micro-batch, several of them broadcasting; this is
    4 (2.5x faster fwd + bwd at 50,304 x 768 on a CPU, the same error against float64:
    BENCHMARKS.md)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:
        # [..., h] -> [..., 1]: as F.normalize computes it
        n = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(eps)
        y = x / n
        ctx.save_for_backward(y, n)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        y, n = ctx.saved_tensors
        # [..., h] -> [..., 1]; a clamped norm is a constant, so its rows keep g / eps
        dot = (g * y).sum(-1, keepdim=True) * (n > ctx.eps)
        return torch.addcmul(g, y, dot, value=-1).div_(n), None


def norm_parameter_count(model: ModelConfig, size: int) -> int:
    """Parameters of one `norm(model, size)`: a scale, and a bias for LayerNorm with biases."""
    return size * (2 if model.normalization == "layernorm" and model.bias else 1)


class _SlotNorm:
    """megatron's norm-slot signature -> `norm` (a class: build_module calls it with keyword arguments)."""

    def __new__(cls, config, hidden_size: int, eps: float, *, model: ModelConfig, **_):
        return norm(model, hidden_size)


def norm_spec(model: ModelConfig) -> ModuleSpec | type:
    """The norm slots of megatron's layers and block for `model`."""
    if model.normalization == "layernorm" and model.bias and torch.cuda.is_available():
        return LocalSpecProvider().layer_norm()  # apex's fused LayerNorm when apex is present, else torch's
    return ModuleSpec(module=_SlotNorm, params={"model": model})
