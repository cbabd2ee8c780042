"""model.bias_activation=triton (model/bias_activation.py): the FFN's bias and activation with the backward
in one Triton kernel, run here in Triton's interpreter (tests/conftest.py) — against autograd, in a model
against model.bias_activation=torch, and in the training loop at TP=1, TP=2 and compiled (without a graph
break in the compiled layer: tests/test_model.py)."""

import typing

import pytest
import torch

from megamlm.config import ConfigError, ModelConfig
from megamlm.model import bias_activation as module
from megamlm.model.activation import ACTIVATIONS
from megamlm.model.bias_activation import bias_activation
from megamlm.model.triton_bias_activation import ACTIVATION_CODES, ROWS_PER_PROGRAM
from tests.backend_parity import (assert_loop_trains_the_references_losses,
                                  assert_model_gives_the_references_loss_and_gradients)
from tests.test_train import tiny_shards
from tests.variants import variant_config



def _gradients(fn, pre, bias, grad):
    pre, bias = pre.detach().requires_grad_(), bias.detach().requires_grad_()
    out = fn(pre, bias)
    return [out, *torch.autograd.grad(out, (pre, bias), grad)]


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # tanh, sigmoid saturating
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float16, torch.float16), (torch.bfloat16, torch.float32)],
                         ids=["fp32", "bf16", "fp16", "bf16-fp32-bias"])
def test_the_kernel_gives_autograds_gradients(activation, dtypes):
    """[s, b, f] with f not a multiple of the column strip and s · b rows over two programs' partial sums,
    values out to the activations' saturated tails; the bias in y's dtype, or fp32 under autocast."""
    pre_dtype, bias_dtype = dtypes
    generator = torch.Generator().manual_seed(5)
    s, b, f = 2 * ROWS_PER_PROGRAM // 3 + 7, 3, 300  # 531 rows: 3 programs down each strip
    pre = (torch.randn(s, b, f, generator=generator) * 4).to(pre_dtype)
    bias = torch.randn(f, generator=generator).to(bias_dtype)
    grad = torch.randn(s, b, f, generator=generator).to(torch.promote_types(pre_dtype, bias_dtype))
    got = _gradients(lambda p, c: bias_activation(p, c, activation), pre, bias, grad)
    expected = _gradients(lambda p, c: ACTIVATIONS[activation](p + c), pre, bias, grad)
    exact = _gradients(lambda p, c: ACTIVATIONS[activation](p + c), pre.double(), bias.double(), grad.double())
    for name, ours, theirs, truth in zip(("out", "d pre", "d bias"), got, expected, exact):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, name
        # fp32: within a few times torch's own error, both against fp64 (tanh from exp loses digits near 0)
        if ours.dtype == torch.float32:
            ours_error, theirs_error = (ours.double() - truth).abs().max(), (theirs.double() - truth).abs().max()
            assert ours_error <= 4 * theirs_error + 1e-6, (name, ours_error.item(), theirs_error.item())
        else:  # rounded alike: one unit in the last place where fp32's formulas differ near a rounding point,
            # 1e-5 where they cancel (tanh near ±1); the bias's gradient: a sum of 1,593 such terms
            ulp = torch.finfo(ours.dtype).eps
            tolerance = dict(rtol=4 * ulp, atol=1e-2) if name == "d bias" else dict(rtol=ulp, atol=1e-5)
            torch.testing.assert_close(ours.float(), theirs.float(), **tolerance, msg=lambda m, n=name: f"{n}: {m}")


def test_the_kernels_activations_are_the_configs():
    """One list: ModelConfig.activation's names, activation.py's functions, the kernel's codes."""
    names = set(typing.get_args(typing.get_type_hints(ModelConfig)["activation"]))
    assert names == set(ACTIVATIONS) == set(ACTIVATION_CODES)
    assert sorted(ACTIVATION_CODES.values()) == list(range(len(names)))


@pytest.mark.parametrize("variant", ["zero-clap", "pre-ln", "albert"])
def test_a_model_on_the_kernel_gives_torchs_loss_and_gradients(world, variant):
    """Post-LN GELU (zero-clap), pre-LN (megatron's own layer), ALBERT's shared layer with tanh GELU:
    padded and packed batches. The kernels' erf and torch's differ in the last place, which every later
    value carries: each gradient within 1e-4 of its scale (~2e-6 seen; up to 3e-5 in some runs)."""
    assert_model_gives_the_references_loss_and_gradients(world, "model.bias_activation=triton",
                                                         "model.bias_activation=torch", variant, of_scale=1e-4)


@pytest.mark.parametrize("overrides, words", [(["model.gated_ffn=true"], "gated_ffn=True"),
                                              (["model.bias=false"], "bias=False")])
def test_the_config_refuses_the_kernel_without_an_ffn_bias_or_with_a_gated_ffn(overrides, words):
    with pytest.raises(ConfigError, match=f"model.bias_activation=triton .*{words}"):
        variant_config("zero-clap", ["model.bias_activation=triton", *overrides])


def test_a_machine_without_a_gpu_is_told_to_use_torch(monkeypatch):
    model = variant_config("zero-clap", ["model.bias_activation=triton"]).model
    assert module.unsupported_here(model) is None  # the interpreter runs it
    monkeypatch.setattr(module, "INTERPRET", False)
    expected = None if torch.cuda.is_available() else ("model.bias_activation=triton needs a CUDA GPU and the "
                                                       "triton package; use torch")
    assert module.unsupported_here(model) == expected
    assert module.unsupported_here(variant_config("zero-clap").model) is None  # torch: nothing to refuse


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return tiny_shards(tmp_path_factory, "bias-activation")


@pytest.mark.slow
def test_the_loop_trains_torchs_losses_at_tp1_and_tp2_and_compiled(shards, tmp_path):
    """The backward is one custom op inside train.compile's compiled layers."""
    assert_loop_trains_the_references_losses(shards, tmp_path, "model.bias_activation=triton",
                                             "model.bias_activation=torch")


def test_the_16_bit_gelu_kernels_are_memory_bound_on_an_h200_where_libdevices_erf_is_not():
    """benchmarks/triton_static.py compiles both kernels as a training step launches them (sm_90, bf16, on
    this CPU): with GELU's Φ from A&S 7.1.26 their loops issue fewer cycles per element than the H200's
    memory needs for its bytes (issue ÷ memory < 1), and under 0.8x the same loops with libdevice's erf
    (what Inductor's GELU kernels call), which issue more than the memory needs (~1.2-1.35)."""
    import os
    import re
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "benchmarks/triton_static.py", "--first-only", "--kernels", "bias-activation"]
    run = subprocess.run(command, capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert run.returncode == 0, run.stderr[-2000:]
    ratios = {}
    for row in run.stdout.splitlines():
        pattern = r"\| (forward|backward) \| [^|]+ \| gelu, (A&S Φ|libdevice erf) \| \d+, (\d+) B .*\*\*([\d.]+)\*\*"
        if match := re.match(pattern, row):
            kernel, erf, stack, ratio = match.groups()
            assert stack == "0", row
            ratios[kernel, erf] = float(ratio)
    assert len(ratios) == 4, run.stdout
    for kernel in ("forward", "backward"):
        ours, libdevice = ratios[kernel, "A&S Φ"], ratios[kernel, "libdevice erf"]
        assert ours < 1 and ours < 0.8 * libdevice, (kernel, ours, libdevice)
