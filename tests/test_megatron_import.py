"""megatron.core through megamlm: no Inductor at import, its jit_fuser functions compiled on first call."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megamlm.megatron_import import compile_on_first_call

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str) -> list[str]:
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout.split()


@pytest.mark.slow
def test_the_training_modules_import_megatron_core_without_inductor_and_its_fusions_compile_when_called():
    """Before: megatron.core's ~30 torch.compile wrappers imported Dynamo and Inductor at import (3.4-4.1 s
    to import it on 2 cores, 1.7 s without). A jit_fuser function still gives megatron's values, compiled
    by Inductor on its first call."""
    code = """
import sys, torch
import megamlm.train.loop, megamlm.evaluate
from megatron.core.fusions.fused_bias_gelu import bias_gelu
from megatron.core.jit import jit_fuser
print(int("torch._inductor.compile_fx" in sys.modules), int(jit_fuser is torch.compile))
bias, y = torch.randn(8), torch.randn(4, 8)
out = bias_gelu(bias, y)
x = bias + y
expected = x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))  # megatron's formula
print(int("torch._inductor.compile_fx" in sys.modules), int(torch.allclose(out, expected, atol=1e-6)))
"""
    assert _python(code) == ["0", "0", "1", "1"]


def test_megatron_core_imported_before_megamlm_keeps_its_decorators():
    code = """
import torch, megatron.core, megamlm.model.encoder
from megatron.core.jit import jit_fuser
print(int(jit_fuser is torch.compile))
"""
    assert _python(code) == ["1"]


def _recording_compile(calls: list):
    def eager_compile(model, **options):
        calls.append((model.__name__, options))
        return lambda *args: ("compiled", model(*args))

    return compile_on_first_call(eager_compile)


def test_compile_on_first_call_compiles_once_with_the_decorators_options():
    calls = []
    compile = _recording_compile(calls)

    @compile
    def double(x):
        return 2 * x

    @compile(mode="max-autotune", dynamic=True)
    def triple(x):
        return 3 * x

    assert calls == [] and double.__name__ == "double" and triple.__wrapped__(2) == 6
    assert [double(1), double(2), triple(1)] == [("compiled", 2), ("compiled", 4), ("compiled", 3)]
    assert calls == [("double", {}), ("triple", {"mode": "max-autotune", "dynamic": True})]


def test_a_region_being_compiled_inlines_the_function_instead_of_compiling_it():
    """As Dynamo does with a torch.compile'd function called in the region it compiles."""
    calls = []
    square = _recording_compile(calls)(lambda x: x * x)
    outer = torch.compile(lambda x: square(x) + 1, backend="eager", fullgraph=True)
    x = torch.arange(4.0)
    assert torch.equal(outer(x), x * x + 1) and calls == []
