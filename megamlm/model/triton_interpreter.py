"""Our Triton kernels under Triton's interpreter (TRITON_INTERPRET=1: numpy on the CPU, the tests' mode and
a CPU run's), where bf16 is not a number type: the interpreter keeps a bf16 tensor as its uint16 bits and
runs arithmetic and `tl.dot` on those bits (Triton's debugging guide: "It does not support operations on
bfloat16 numeric types"; triton-lang/triton#11584), and its fp32 -> bf16 conversion truncates where the
GPU's rounds to nearest even. A bf16 model on the interpreter got dot products of ~1e9 and gradient norms
of ~1e13 without an error (gpu.sh's toy rows, session 37).

The helpers below give the kernels the GPU's bf16 numbers there: a loaded bf16 tile is widened to fp32
(exact), a matmul operand is rounded to bf16 and kept in fp32, a stored value is rounded before the
conversion. On a GPU, and for fp16 and fp32 anywhere, each is the plain conversion (the same code as
without them).

`patch_the_language_once_per_launch` takes a cost of the interpreter's own away: it re-patches
triton.language at every call of a jit helper (`rounded`, `_load_rows`, ...), which our kernels make ~20,000
times in a toy training run of 4 updates.
"""

import inspect
import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's interpreter (numpy on the CPU) runs the kernels: the tests' mode."""
INTERPRET_CONSTEXPR: tl.constexpr = tl.constexpr(INTERPRET)  # the kernels' copy


def patch_the_language_once_per_launch() -> bool:
    """Triton's interpreter replaces triton.language's builtins by its numpy ones for a kernel's launch, and
    again at each call of a jit helper inside it (`_patch_lang`: `inspect.getmembers` over 4-5 modules, ~0.5
    ms), though a helper's modules (tl, tl.core) are patched already after the first such call: a toy training run
    on the Triton attention kernels took ~40% less time without the repeats. Here a launch patches each set of
    modules once; the first call still patches (as before: a helper's own modules, e.g. tl.core for
    `tl.zeros`, may not be the kernel's). Applied where the interpreter runs and its internals are the ones
    this was written against (Triton 3.9); returns whether it was."""
    if not INTERPRET:
        return False
    from triton.runtime import interpreter

    executor = getattr(interpreter, "GridExecutor", None)
    patch = getattr(interpreter, "_patch_lang", None)
    if not (executor and patch and hasattr(interpreter, "_LangPatchScope")):
        return False
    if getattr(patch, "once_per_launch", False):
        return True
    launch_call = executor.__call__
    patched: list[set] = []  # the module sets patched by the launch in progress (none: outside a launch)

    def modules_of(fn) -> frozenset:
        return frozenset(id(value) for value in fn.__globals__.values()
                         if inspect.ismodule(value) and value in (tl, tl.core))

    def patch_lang(fn):
        if patched:
            key = modules_of(fn)
            if key in patched[-1]:
                return interpreter._LangPatchScope()  # nothing to restore: the launch's own scope does
            patched[-1].add(key)
        return patch(fn)

    def launch(self, *args, **kwargs):
        patched.append(set())
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            patched.pop()

    patch_lang.once_per_launch, patch_lang.triton_patch, launch.triton_launch = True, patch, launch_call
    interpreter._patch_lang, executor.__call__ = patch_lang, launch
    return True


patch_the_language_once_per_launch()


@triton.jit
def rounded(x, DTYPE: tl.constexpr):
    """fp32 x rounded to DTYPE (to nearest, ties to even: the GPU's conversion), in fp32. Triton's
    interpreter truncates to bf16, so there the rounding is done on the bits."""
    if INTERPRET_CONSTEXPR and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        value = bits.to(tl.float32, bitcast=True)
    else:
        value = x.to(DTYPE).to(tl.float32)
    return value


@triton.jit
def computable(x):
    """A loaded tile in a type the kernel can compute with: bf16 widened to fp32 on the interpreter."""
    if INTERPRET_CONSTEXPR and x.dtype == tl.bfloat16:
        value = x.to(tl.float32)
    else:
        value = x
    return value


@triton.jit
def operand(x, DTYPE: tl.constexpr):
    """fp32 x as a `tl.dot` operand of DTYPE: `x.to(DTYPE)`; on the interpreter a bf16 one is rounded and
    kept in fp32 (`computable`'s type)."""
    if INTERPRET_CONSTEXPR and DTYPE == tl.bfloat16:
        value = rounded(x, DTYPE)
    else:
        value = x.to(DTYPE)
    return value


@triton.jit
def stored(x, DTYPE: tl.constexpr):
    """fp32 x converted to DTYPE for a store, rounded to nearest even on the interpreter too."""
    if INTERPRET_CONSTEXPR and DTYPE == tl.bfloat16:
        value = rounded(x, DTYPE).to(DTYPE)
    else:
        value = x.to(DTYPE)
    return value
