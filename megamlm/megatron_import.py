"""megatron.core imported with its `jit_fuser` decorators compiling on first call, not at import.

megatron.core wraps ~30 functions in `torch.compile` as its modules load (megatron/core/jit.py:
`jit_fuser = torch.compile`). Making those wrappers imports torch._dynamo and Inductor: ~2 s of every
process's start on a 2-core CPU (1.7 s instead of 3.4-4.1 s to import megatron.core; a training run, whose
optimizer imports Dynamo anyway, starts and exits ~1.8 s sooner: BENCHMARKS.md, "Session 68"), paid by each
`megamlm` command and each rank of a launch, for fusions megamlm turns off (model/encoder.py:
`*_fusion=False`). `install()` (run by `import megamlm`) adds a finder that loads megatron.core with
`torch.compile` replaced, for the length of that import only, by `compile_on_first_call`, which makes the
same call the first time the function runs. torch.compile itself compiles on the first call, so where one
of those functions is used nothing changes but when Inductor is imported. A megatron.core imported before
megamlm keeps its eager decorators.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys

_MODULE = "megatron.core"


def compile_on_first_call(eager_compile):
    """A torch.compile whose `compile(model, **options)` (also a decorator with options:
    `@compile(mode=...)`) returns a function that makes `eager_compile(model, **options)` when first called
    and calls that. Inside a region being compiled it calls `model` itself, as Dynamo inlines a
    torch.compile'd function it meets there."""
    import torch  # imported by megatron.core's import, which alone calls this

    def compile(model=None, **options):
        if model is None:
            return functools.partial(compile, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if torch.compiler.is_compiling():
                return model(*args, **kwargs)
            if compiled is None:
                compiled = eager_compile(model, **options)
            return compiled(*args, **kwargs)

        return call

    return compile


@contextlib.contextmanager
def _compiling_on_first_call():
    """torch.compile is `compile_on_first_call(torch.compile)` inside the block."""
    import torch

    eager_compile = torch.compile
    torch.compile = compile_on_first_call(eager_compile)
    try:
        yield
    finally:
        torch.compile = eager_compile


class _Loader(importlib.abc.Loader):
    """megatron.core's own loader, running the package's code with `_compiling_on_first_call`; the
    module keeps its own loader (its source, its resources) once loaded."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader
        with _compiling_on_first_call():
            self.loader.exec_module(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds megatron.core as the import system would (sys.path), loading it with `_Loader`; any other
    module, or a megatron.core found otherwise (an editable install's own finder), it leaves alone."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Put the finder first on sys.meta_path (once), unless megatron.core is already imported."""
    if _MODULE not in sys.modules and not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
