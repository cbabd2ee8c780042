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
"""

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's interpreter (numpy on the CPU) runs the kernels: the tests' mode."""
INTERPRET_CONSTEXPR: tl.constexpr = tl.constexpr(INTERPRET)  # the kernels' copy


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
