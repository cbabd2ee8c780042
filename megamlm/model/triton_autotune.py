"""What our Triton kernels (attention: triton_kernels.py; the FFN's bias and activation:
triton_bias_activation.py) share in how the autotuner picks their block sizes: its candidates compile at
once, on a thread pool, instead of one after another."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import triton

COMPILE_OPTIONS = {"enable_fp_fusion": True}
"""The compiler options every launch of our kernels passes: floating-point contraction on (a · b + c as one FMA),
whatever Triton's default. Triton 3.9 warns that 3.10 turns it off by default; the kernels' arithmetic is
written for it (the online softmax's rescale, dropout's one-select dS: benchmarks/triton_static.py's counts),
and the leases' timings and error checks had it (Triton 3.6's default)."""


def compile_at_once(kernel: triton.JITFunction) -> Callable[..., list[triton.Config]]:
    """The autotuner's `early_config_prune` hook for `kernel`, which it calls once per new tuning key before
    it compiles and times the candidates one after another: compile them all first, at once (Triton's
    AsyncCompileMode on a thread pool: LLVM's passes and ptxas run outside the GIL), so that the timing finds
    them compiled. 19 candidates per training step's attention kernels, 228 in benchmarks/triton_check.py, at
    ~1.5 s each. Prunes nothing; on any failure the candidates compile one by one, as without the hook."""

    def compile_all(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        threads = min(len(configs), os.cpu_count() or 1, 16)
        if threads < 2 or not hasattr(triton, "AsyncCompileMode"):
            return configs
        constants = {name: value for name, value in kwargs.items() if name not in ("grid", "warmup")}
        try:
            with ThreadPoolExecutor(threads) as pool, triton.AsyncCompileMode(pool, ignore_errors=True):
                for config in configs:
                    kernel.warmup(*named_args.values(), grid=kwargs.get("grid"), **constants, **config.all_kwargs())
        except Exception as error:  # noqa: BLE001 - an optimization: the autotuner compiles them itself
            warnings.warn(f"triton: compiling the autotuner's candidates for {kernel.__name__} at once failed "
                          f"({error!r}); they compile one by one", stacklevel=2)
        return configs

    return compile_all


def autotuned(kernel: triton.JITFunction, configs: list[triton.Config], key: list[str],
              reset_to_zero: list[str] | None = None) -> triton.runtime.Autotuner:
    """`kernel` under Triton's autotuner over `configs`, retuned per value of the `key` arguments, its
    candidates compiled at once (`compile_at_once`); reset_to_zero: the arguments it adds into, zeroed before
    each timed run and after the timing."""
    return triton.autotune(configs, key=key, prune_configs_by={"early_config_prune": compile_at_once(kernel)},
                           reset_to_zero=reset_to_zero)(kernel)
