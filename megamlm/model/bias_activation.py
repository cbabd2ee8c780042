"""model.bias_activation=triton: the FFN's `activation(y + bias)` (y the first linear's output without its
bias) in Triton kernels (triton_bias_activation.py), forward and backward — the backward, dy =
grad · activation'(y + bias) and the bias's gradient Σ_rows dy, in one read of grad and y.

Two torch custom ops (`megamlm::bias_activation` and its backward), which a compiled layer keeps whole
(between two matmuls there is nothing for Inductor to fuse them with). The FFN's first linear applies
them (layer.py BiasActivationLinear), and megatron-core's MLP its identity activation
(`applied_by_the_linear`): megatron's own bias_activation_fusion is tanh-approximated GELU.
"""

from __future__ import annotations

import torch

from megamlm.config import ModelConfig

try:  # triton comes with CUDA builds of torch; a CPU-only install may lack it (unsupported_here says so)
    from megamlm.model import triton_bias_activation as kernels
    from megamlm.model.triton_interpreter import INTERPRET
except ImportError:
    kernels, INTERPRET = None, False


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., f] -> [n, f], row-major as the kernels read it (a layer's tensors are already: a view)."""
    return t.reshape(-1, t.size(-1)).contiguous()


@torch.library.custom_op("megamlm::bias_activation", mutates_args=())
def _forward_op(pre: torch.Tensor, bias: torch.Tensor, activation: str) -> torch.Tensor:
    """ACTIVATIONS[activation](pre + bias), pre [..., f], bias [f], in the dtype of pre + bias."""
    out = _forward_fake(pre, bias, activation)
    kernels.forward(_rows(pre), bias.contiguous(), activation, out.view(-1, pre.size(-1)))
    return out


@_forward_op.register_fake
def _forward_fake(pre, bias, activation):
    return pre.new_empty(pre.shape, dtype=torch.promote_types(pre.dtype, bias.dtype))


@torch.library.custom_op("megamlm::bias_activation_backward", mutates_args=())
def _backward_op(grad: torch.Tensor, pre: torch.Tensor, bias: torch.Tensor,
                 activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (d pre [..., f] in pre's dtype, d bias [f] in the dtype of pre + bias) for the gradient of
    activation.py ACTIVATIONS[activation](pre + bias)."""
    dpre, _ = _backward_fake(grad, pre, bias, activation)
    partial = kernels.backward(_rows(grad), _rows(pre), bias.contiguous(), activation, dpre.view(-1, pre.size(-1)))
    return dpre, partial.sum(0).to(torch.promote_types(pre.dtype, bias.dtype))  # [n / rows, f] fp32 -> [f]


@_backward_op.register_fake
def _backward_fake(grad, pre, bias, activation):
    return pre.new_empty(pre.shape), bias.new_empty(bias.shape, dtype=torch.promote_types(pre.dtype, bias.dtype))


def _setup_context(ctx, inputs, output):
    pre, bias, activation = inputs
    ctx.save_for_backward(pre, bias)
    ctx.activation = activation


def _backward(ctx, grad):
    pre, bias = ctx.saved_tensors
    dpre, dbias = _backward_op(grad, pre, bias, ctx.activation)
    return dpre, dbias.to(bias.dtype), None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def bias_activation(pre: torch.Tensor, bias: torch.Tensor, activation: str) -> torch.Tensor:
    """ACTIVATIONS[activation](pre + bias) for pre [..., f] and bias [f] (model.activation's names), forward
    and backward in Triton kernels."""
    return _forward_op(pre, bias, activation)


def unsupported_here(model: ModelConfig) -> str | None:
    """Why this machine cannot run model.bias_activation (the config checks the model's shape), or None."""
    if model.bias_activation == "triton" and (kernels is None or not (torch.cuda.is_available() or INTERPRET)):
        return "model.bias_activation=triton needs a CUDA GPU and the triton package; use torch"
    return None


def applied_by_the_linear(x: torch.Tensor) -> torch.Tensor:
    """megatron's MLP activation_func where its linear_fc1 (layer.py BiasActivationLinear) already applied
    the activation, with the bias, in `bias_activation`."""
    return x
