"""The Triton kernels of model.bias_activation=triton (bias_activation.py: the op, its autograd and the FFN
that uses it): the FFN's `activation(y + bias)` over [n, f], forward, and backward in one pass.

What they replace, in a compiled layer on the H200 (base at 2048, micro-batch 16: [32,768, 3,072] bf16,
BENCHMARKS.md lease 5's profile), 24 times per update: Inductor's forward (0.16 ms, where reading y and
writing the output takes ~0.09 at the memory's speed) and its backward, two kernels, a column reduction
for the bias's gradient that recomputes GELU's derivative from the gradient and y (reading both: 0.24
ms) and a pointwise kernel that computes it again for dy (reading both, writing dy: 0.21 ms). Here the
backward reads a [rows, BLOCK_F] strip of the gradient and of y once and writes dy and the strip's column
sums: 3 tensors' traffic where Inductor's two kernels move 5.

Both kernels compute GELU's Φ without libdevice's erf where their result is rounded to 16 bits: erf picks
one of two polynomials per value (predicated moves of each coefficient), ~35 instructions per element,
which kept Inductor's kernels issue-bound below the memory's speed (benchmarks/triton_static.py counts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megamlm.model.triton_autotune import COMPILE_OPTIONS, autotuned
from megamlm.model.triton_interpreter import INTERPRET, INTERPRET_CONSTEXPR, rounded

ACTIVATION_CODES = {"gelu": 0, "gelu_tanh": 1, "silu": 2}
"""model.activation -> the kernels' ACTIVATION (the names are activation.py's ACTIVATIONS)."""

ROWS_PER_PROGRAM = 256
"""Rows of [n, f] one program walks down (BLOCK_N at a time): the backward's n / 256 programs per column
strip write partial column sums, which torch adds up ([n / 256, f] fp32: 1.5 MiB at n = 32,768, f = 3,072)."""

_SQRT_HALF: tl.constexpr = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI: tl.constexpr = tl.constexpr(0.3989422804014327)
_SQRT_2_OVER_PI: tl.constexpr = tl.constexpr(0.7978845608028654)
_TANH_CUBIC: tl.constexpr = tl.constexpr(0.044715)


# Abramowitz & Stegun 7.1.26: erf(z) = 1 - t (a1 + t (a2 + ... a5)) e^(-z²), t = 1 / (1 + p z), z >= 0, error
# below 1.5e-7; here halved (Φ's 0.5) and with p / √2, for z = |x| / √2
_AS_P: tl.constexpr = tl.constexpr(0.3275911 * 0.7071067811865476)
_AS_A1: tl.constexpr = tl.constexpr(0.5 * 0.254829592)
_AS_A2: tl.constexpr = tl.constexpr(0.5 * -0.284496736)
_AS_A3: tl.constexpr = tl.constexpr(0.5 * 1.421413741)
_AS_A4: tl.constexpr = tl.constexpr(0.5 * -1.453152027)
_AS_A5: tl.constexpr = tl.constexpr(0.5 * 1.061405429)
_HALF_LOG2E: tl.constexpr = tl.constexpr(0.5 * 1.4426950408889634)


@triton.jit
def _reciprocal(d):
    """1 / d (d >= 1): one MUFU.RCP (PTX rcp.approx, within 1 ulp) on a GPU, where `1.0 / d` compiles to
    div.full's range checks and scaling around it (7 instructions)."""
    if INTERPRET_CONSTEXPR:
        return 1.0 / d
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [d], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _gelu_16bit(x):
    """(Φ(x), e^(-x²/2) = √(2π) φ(x)) to ~1e-7 (A&S 7.1.26), for results rounded to 16 bits."""
    e = tl.exp2(-(x * x) * _HALF_LOG2E)
    t = _reciprocal(tl.abs(x) * _AS_P + 1.0)
    tail = t * (t * (t * (t * (t * _AS_A5 + _AS_A4) + _AS_A3) + _AS_A2) + _AS_A1) * e  # Φ(-|x|)
    return tl.where(x >= 0, 1.0 - tail, tail), e


@triton.jit
def _tanh(u):
    """tanh(u) from exp, saturating to ±1 where exp over/underflows."""
    return 2.0 / (1.0 + tl.exp(-2.0 * u)) - 1.0


# Products below put the tensor first (x * C, not C * x): in Triton's interpreter a module constexpr times a
# tensor, passed on to another jit function, is not a tensor there.
@triton.jit
def _activation(x, ACTIVATION: tl.constexpr, HALF: tl.constexpr):
    """activation(x), fp32: 0 erf GELU x Φ(x), 1 its tanh approximation, 2 SiLU x σ(x). HALF: the result is
    rounded to 16 bits (GELU's Φ from `_gelu_16bit`)."""
    if ACTIVATION == 0:
        if HALF:
            cdf, _ = _gelu_16bit(x)
            value = x * cdf
        else:
            value = 0.5 * x * (1.0 + tl.math.erf(x * _SQRT_HALF))
    elif ACTIVATION == 1:
        value = x * 0.5 * (1.0 + _tanh((x * x * x * _TANH_CUBIC + x) * _SQRT_2_OVER_PI))
    else:
        value = x / (1.0 + tl.exp(-x))
    return value


@triton.jit
def _derivative(x, ACTIVATION: tl.constexpr, HALF: tl.constexpr):
    """activation'(x), fp32 (torch's backward formulas; `_activation`'s codes and HALF)."""
    if ACTIVATION == 0:  # Φ(x) + x φ(x)
        if HALF:
            cdf, e = _gelu_16bit(x)
            slope = cdf + x * e * _INV_SQRT_2PI
        else:
            slope = 0.5 * (1.0 + tl.math.erf(x * _SQRT_HALF)) + x * tl.exp(-0.5 * x * x) * _INV_SQRT_2PI
    elif ACTIVATION == 1:  # 0.5 (1 + t) + 0.5 x (1 - t²) u'(x), t = tanh(u(x)), u = √(2/π) (x + 0.044715 x³)
        t = _tanh((x * x * x * _TANH_CUBIC + x) * _SQRT_2_OVER_PI)
        slope = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_CUBIC * x * x)
    else:  # σ(x) (1 + x (1 - σ(x)))
        sigmoid = 1.0 / (1.0 + tl.exp(-x))
        slope = sigmoid * (1.0 + x * (1.0 - sigmoid))
    return slope


@triton.jit
def _strip(Y, B, start, cols, N, F, HALF: tl.constexpr, BLOCK_N: tl.constexpr):
    """(offsets, inside, x) of rows [start, +BLOCK_N) and columns cols of [N, F] Y: x = y + b in fp32, rounded
    to y's dtype where HALF (the sum's dtype is y's 16-bit one, as the forward's add rounds it)."""
    rows = start + tl.arange(0, BLOCK_N)
    offsets = rows.to(tl.int64)[:, None] * F + cols[None, :]  # [BLOCK_N, BLOCK_F]
    inside = (rows < N)[:, None] & (cols < F)[None, :]
    bias = tl.load(B + cols, mask=cols < F, other=0.0).to(tl.float32)
    x = tl.load(Y + offsets, mask=inside, other=0.0).to(tl.float32) + bias[None, :]
    if HALF:
        x = rounded(x, Y.dtype.element_ty)
    return offsets, inside, x


@triton.jit
def _bias_activation_forward_kernel(Y, B, OUT, N, F, ROWS: tl.constexpr, ACTIVATION: tl.constexpr,
                                    HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    """OUT = activation(y + b) over rows [pid1 · ROWS, +ROWS) of columns [pid0 · BLOCK_F, +BLOCK_F) of Y, OUT
    [N, F] (row-major); B [F]. HALF: y, b and OUT in one 16-bit dtype (else OUT is fp32)."""
    cols = tl.program_id(0) * BLOCK_F + tl.arange(0, BLOCK_F)
    for start in range(tl.program_id(1) * ROWS, (tl.program_id(1) + 1) * ROWS, BLOCK_N):
        offsets, inside, x = _strip(Y, B, start, cols, N, F, HALF, BLOCK_N)
        tl.store(OUT + offsets, _activation(x, ACTIVATION, HALF).to(OUT.dtype.element_ty), mask=inside)


@triton.jit
def _bias_activation_backward_kernel(G, Y, B, DY, PARTIAL, N, F, ROWS: tl.constexpr, ACTIVATION: tl.constexpr,
                                     HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
    """DY = g · activation'(y + b) over the forward kernel's strip of G, Y, DY [N, F]; PARTIAL[pid1, cols] =
    the strip's Σ_rows dy. HALF: dy is rounded to the 16-bit dtype before the sum too, as autograd's
    activation backward rounds it (else, an fp32 bias under autocast, the sum is of fp32 values)."""
    cols = tl.program_id(0) * BLOCK_F + tl.arange(0, BLOCK_F)
    # summed over rows once, after the loop: a sum per iteration would cross warps (shared memory, barriers)
    sums = tl.zeros([BLOCK_N, BLOCK_F], dtype=tl.float32)
    for start in range(tl.program_id(1) * ROWS, (tl.program_id(1) + 1) * ROWS, BLOCK_N):
        offsets, inside, x = _strip(Y, B, start, cols, N, F, HALF, BLOCK_N)
        g = tl.load(G + offsets, mask=inside, other=0.0).to(tl.float32)
        dy = g * _derivative(x, ACTIVATION, HALF)
        if HALF:
            dy = rounded(dy, DY.dtype.element_ty)
        tl.store(DY + offsets, dy.to(DY.dtype.element_ty), mask=inside)
        sums += dy
    tl.store(PARTIAL + tl.program_id(1) * F + cols, tl.sum(sums, 0), mask=cols < F)


def _tuned(kernel: triton.JITFunction) -> triton.runtime.Autotuner:
    """(BLOCK_N, BLOCK_F, warps) candidates: strips of 64-256 columns (128-512 contiguous bytes of bf16 per
    row), 8-32 elements per thread (none spills on sm_90a). The interpreter runs one whose strips are larger:
    its time goes to dispatching each tile operation, not to the elements (numpy), and 16 x 32 tiles made a toy
    training row of gpu.sh's smoke run 42 s, three quarters of it here; 64 rows still walk a program's 256 in
    several strips."""
    if INTERPRET:
        configs = [triton.Config({"BLOCK_N": 64, "BLOCK_F": 128}, num_warps=1)]
    else:
        configs = [triton.Config({"BLOCK_N": n, "BLOCK_F": f}, num_warps=w)
                   for n, f, w in [(32, 128, 4), (16, 128, 4), (8, 256, 4), (16, 256, 8), (8, 128, 4), (16, 64, 4)]]
    return autotuned(kernel, configs, key=["F", "ACTIVATION", "HALF"])


_forward = _tuned(_bias_activation_forward_kernel)
_backward = _tuned(_bias_activation_backward_kernel)


def _grid(n: int, f: int):
    return lambda meta: (triton.cdiv(f, meta["BLOCK_F"]), triton.cdiv(n, ROWS_PER_PROGRAM))


def _half(pre: torch.Tensor, bias: torch.Tensor) -> bool:
    """Whether pre + bias is 16-bit (both in one 16-bit dtype); else torch promotes it to fp32."""
    return torch.promote_types(pre.dtype, bias.dtype).itemsize == 2


def forward(pre: torch.Tensor, bias: torch.Tensor, activation: str, out: torch.Tensor) -> None:
    """Fills out [n, f] (in the dtype of pre + bias) with activation(pre + bias); pre [n, f] row-major, bias [f]."""
    n, f = pre.shape
    _forward[_grid(n, f)](pre, bias, out, n, f, ROWS=ROWS_PER_PROGRAM, ACTIVATION=ACTIVATION_CODES[activation],
                          HALF=_half(pre, bias), **COMPILE_OPTIONS)


def backward(grad: torch.Tensor, pre: torch.Tensor, bias: torch.Tensor, activation: str,
             dpre: torch.Tensor) -> torch.Tensor:
    """Fills dpre [n, f] with grad · activation'(pre + bias) (grad, pre [n, f] row-major, bias [f]) and
    returns the partial column sums [n / ROWS_PER_PROGRAM, f] fp32, whose sum over rows is the bias's
    gradient."""
    n, f = pre.shape
    partial = pre.new_empty(triton.cdiv(n, ROWS_PER_PROGRAM), f, dtype=torch.float32)
    _backward[_grid(n, f)](grad, pre, bias, dpre, partial, n, f, ROWS=ROWS_PER_PROGRAM,
                           ACTIVATION=ACTIVATION_CODES[activation], HALF=_half(pre, bias), **COMPILE_OPTIONS)
    return partial
