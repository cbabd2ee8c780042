#!/usr/bin/env python
"""model.attention_backend=triton's kernels (megamlm/model/triton_kernels.py) compiled for a GPU
architecture on this machine — Triton's compiler and its bundled cuobjdump, no GPU needed — as a training
step launches them, each autotuner candidate: registers, stack (registers spilled to local memory), and
the instructions of the hot loop (the loop over the other side's blocks) per score.

    python benchmarks/triton_static.py                   # sm_90 (H100/H200), roberta.base's heads at 2048, bf16
    python benchmarks/triton_static.py --first-only      # one candidate per kernel (the quick look)

The launch is the training step's (`triton_attention.forward_launch` / `backward_launches` on meta
tensors laid out as the layer's q, k, v views): its arguments decide Triton's specializations (16-divisible
strides and lengths, 16-byte aligned pointers), and with them vectorized loads and the registers they need.

Reading the loop columns (each kernel has three loops: two over its whole blocks — no visibility test,
ALiBi as a key and a query term; keys before and after the queries, the table shows the longer — and one
over the masked rest, `partition` in megamlm/model/triton_blocks.py). Each loop instruction is issued
once per warp per block pair, so per score it costs instructions × warps × 32 / (BLOCK_M × BLOCK_N)
thread-slots: the total, then by class (tensor: HGMMA/HMMA · MUFU: exp2 · FP32 · integer · the rest:
conversions, loads, shuffles, uniform datapath). An H100 SM issues 4 warp-instructions per cycle, its
tensor cores do 4,096 dense bf16 FLOPs per cycle (989 TFLOP/s at 1.83 GHz over 132 SMs) and its MUFU
16 exp2 per cycle: in bold the loop's issue cycles over its matmuls' cycles per block pair, then its
exp2 cycles over the matmuls'. Above 1 the loop cannot keep the tensor cores busy whatever the overlap:
the kernel's ceiling is about the tensor rate ÷ the larger ratio. A static count: the GPU rows
(gpu.sh triton-attention) measure time.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter

import torch
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource

try:  # the C++ routine that Triton's launcher specializes arguments with
    from triton._C.libtriton import native_specialize_impl
except ImportError:  # pragma: no cover - older Triton
    native_specialize_impl = None

from megamlm.model import triton_bias_activation, triton_kernels
from megamlm.model.flex import dropped_levels
from megamlm.model.triton_autotune import COMPILE_OPTIONS
from megamlm.model.triton_attention import backward_launches, forward_launch

ISSUE_PER_CYCLE = 4  # warp-instructions per SM per cycle (4 schedulers)
MEMORY_BYTES_PER_CYCLE = 4.8e12 / (132 * 1.98e9)  # the H200's HBM per SM-cycle (18.4 B)
TENSOR_FLOPS_PER_CYCLE = 4096  # dense bf16 per SM per cycle, H100 SXM
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
# m, n, k of a tensor instruction: HGMMA (a warpgroup's: 4 warps) spells them, HMMA.16816 is m16 n8 k16 (a warp's)
MMA_SHAPE = {"HGMMA": (re.compile(r"HGMMA\.(\d+)x(\d+)x(\d+)"), 4), "HMMA": (re.compile(r"HMMA\.(16)(8)(\d+)"), 1)}
CLASSES = ("tensor", "MUFU", "FP32", "integer", "other")
ATOMIC = "dK/dV+dQ"  # model.triton_dq=atomic's one backward kernel
INTEGER = ("IMAD", "IADD", "VIADD", "LOP", "SHF", "SEL", "ISETP", "PRMT", "LEA", "IMNMX", "IABS", "SGXT", "PLOP",
           "P2R", "R2P", "BMSK", "FLO", "POPC")


def instruction_class(opcode: str) -> str:
    if opcode.startswith(("HGMMA", "HMMA")):
        return "tensor"
    if opcode.startswith("MUFU"):
        return "MUFU"
    if opcode.startswith(("FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "FCHK", "FSWZADD")):
        return "FP32"
    if opcode.startswith(INTEGER):
        return "integer"
    return "other"


def specialize(launch: triton_kernels.Launch, config: triton.Config) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) as Triton's launcher derives them from the launch's arguments."""
    fn = launch.kernel.fn
    values = dict(zip(fn.arg_names, launch.args)) | launch.constants | config.kwargs
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(fn.arg_names):
        value = values[name]
        if name in launch.constants or name in config.kwargs:
            kind, attr = "constexpr", None
        else:  # (is_const, specialize, align) as the launcher passes them
            kind, attr = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = value
        elif attr:
            attrs[(index,)] = BaseBackend.parse_attr(attr)
    return signature, constexprs, attrs


def compile_sass(launch: triton_kernels.Launch, config: triton.Config, arch: int) -> tuple[int, int, str]:
    """(registers, stack bytes, SASS) of the launch's kernel with `config`, for sm_`arch`."""
    signature, constexprs, attrs = specialize(launch, config)
    kernel = triton.compile(ASTSource(fn=launch.kernel.fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": config.num_warps, "num_stages": config.num_stages,
                                     **COMPILE_OPTIONS})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage, sass = (subprocess.run([cuobjdump, flag, cubin.name], capture_output=True, text=True,
                                      check=True).stdout for flag in ("-res-usage", "-sass"))
    match = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return int(match.group(1)), int(match.group(2)), sass


def describe(config: triton.Config) -> str:
    """An attention kernel's candidate as the tables name it: "BLOCK_M × BLOCK_N, warps, stages", and dK/dV's
    orientation (triton_kernels `_attention_backward_keys_kernel`: keys or queries along the score tiles' rows)."""
    text = f"{config.kwargs['BLOCK_M']} × {config.kwargs['BLOCK_N']}, {config.num_warps}, {config.num_stages}"
    if "TRANSPOSED" in config.kwargs:
        text += ", " + ("keys" if config.kwargs["TRANSPOSED"] else "queries") + " along rows"
    return text


def loops(sass: str) -> list[list[str]]:
    """The opcodes of each loop (a backward branch's target up to the branch), in address order: the
    kernels' masked blocks' loop, then their whole blocks' two (keys before, keys after the queries:
    triton_blocks `stretches`)."""
    instructions = [(int(m.group(1), 16), m.group(2)) for m in INSTRUCTION.finditer(sass)]
    bodies = []
    for address, text in instructions:
        branch = BRANCH.search(text)
        if branch and int(branch.group(1), 16) < address:
            start = int(branch.group(1), 16)
            # a predicate guard (@P0, @!UP1) is not the opcode
            bodies.append([re.sub(r"^@!?U?P[T\d]+\s+", "", t).split()[0] for a, t in instructions
                           if start <= a <= address])
    return bodies


def loop_costs(opcodes: list[str], config: triton.Config) -> tuple[dict, float, float]:
    """({class: thread-instructions per score}, issue ÷ tensor cycles, MUFU ÷ tensor cycles) of one loop."""
    scores = config.kwargs["BLOCK_M"] * config.kwargs["BLOCK_N"]
    counts = Counter(instruction_class(op) for op in opcodes)
    per_score = {c: counts[c] * config.num_warps * 32 / scores for c in CLASSES}
    flops = 0  # per block pair
    for op in opcodes:
        for name, (shape, warps_per_issue) in MMA_SHAPE.items():
            if op.startswith(name):
                m, n, k = (int(x) for x in shape.match(op).groups())
                flops += 2 * m * n * k * config.num_warps / warps_per_issue
    tensor_cycles = flops / TENSOR_FLOPS_PER_CYCLE
    issue_cycles = len(opcodes) * config.num_warps / ISSUE_PER_CYCLE
    mufu_cycles = counts["MUFU"] * config.num_warps * 32 / 16  # 16 MUFU lanes per SM
    return per_score, issue_cycles / tensor_cycles, mufu_cycles / tensor_cycles


def launches(batch: int, length: int, heads: int, head_dim: int, dtype: torch.dtype, dropout: float, groups: bool):
    """{kernel name: its launch} for one training step's forward and backward, on meta tensors."""
    meta = {"device": "meta", "dtype": dtype}
    # [s, b, np, 3 hn] -> [b, np, s, 3 hn]: the layer's QKV projection, as its core attention hands it over
    # unsplit (q, k and v views of it; their gradients written into one tensor of its layout)
    qkv = torch.empty(length, batch, heads, 3 * head_dim, **meta).permute(1, 2, 0, 3)
    slopes = torch.empty(heads, device="meta")
    layout = torch.empty(batch, length, device="meta", dtype=torch.int32) if groups else None
    spans = torch.empty(4, batch, length, device="meta", dtype=torch.int32) if groups else None
    seed = torch.empty((), device="meta", dtype=torch.int64)
    dropped = dropped_levels(dropout)
    pattern = (slopes.expand(2, -1), layout, spans)
    constants = (head_dim ** -0.5, 0.0, dropped, -1)
    forward, (out, lse, query_bits) = forward_launch(qkv, None, None, *pattern, seed, *constants)
    delta = torch.empty_like(lse)
    (keys, queries), _ = backward_launches(torch.empty_like(out), qkv, None, None, delta, lse, query_bits, *pattern,
                                           *constants, False)
    (keys_and_queries, _scaling), _ = backward_launches(torch.empty_like(out), qkv, None, None, delta, lse,
                                                        query_bits, *pattern, *constants, False, atomic_dq=True)
    return {"forward": forward, "dK/dV": keys, "dQ": queries, ATOMIC: keys_and_queries}


def bias_activation_launches(rows: int, ffn: int, dtype: torch.dtype, activation: str,
                             half: bool) -> dict[str, triton_kernels.Launch]:
    """{"forward" | "backward": its launch} of model.bias_activation=triton over [rows, ffn], on meta tensors;
    half=False compiles the fp32 results' GELU (libdevice's erf, as Inductor's GELU kernels call it)."""
    meta = {"device": "meta", "dtype": dtype}
    y, out, grad, dy = (torch.empty(rows, ffn, **meta) for _ in range(4))
    bias = torch.empty(ffn, **meta)
    partial = torch.empty(rows // triton_bias_activation.ROWS_PER_PROGRAM, ffn, device="meta")
    constants = {"ROWS": triton_bias_activation.ROWS_PER_PROGRAM,
                 "ACTIVATION": triton_bias_activation.ACTIVATION_CODES[activation], "HALF": half}
    launch = triton_kernels.Launch
    return {"forward": launch(triton_bias_activation._forward, None, (y, bias, out, rows, ffn), constants),
            "backward": launch(triton_bias_activation._backward, None, (grad, y, bias, dy, partial, rows, ffn),
                               constants)}


def print_bias_activation(rows: int, ffn: int, dtype_name: str, arch: int, first_only: bool) -> None:
    """The bias-activation kernels' loop: thread-instructions per element, and its issue cycles over the
    cycles the H200's memory takes for the element's bytes (forward: y in, out; backward: g, y in, dy out)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    print(f"\nmodel.bias_activation=triton's kernels on sm_{arch}: [{rows}, {ffn}], {dtype_name}; issue ÷ memory: the "
          f"loop's issue cycles over the H200's memory cycles ({MEMORY_BYTES_PER_CYCLE:.1f} B per SM-cycle)")
    print("| kernel | BLOCK_N × BLOCK_F, warps | activation | registers, stack | per element (" +
          " · ".join(CLASSES) + ") | issue ÷ memory |")
    print("|---|---|---|---:|---|---:|")
    size = torch.empty((), dtype=dtype).element_size()
    for kernel, streams in (("forward", 2), ("backward", 3)):
        for activation, half in (("gelu", True), ("gelu", False), ("gelu_tanh", True), ("silu", True)):
            launch = bias_activation_launches(rows, ffn, dtype, activation, half)[kernel]
            for config in launch.kernel.configs[:1] if first_only else launch.kernel.configs:
                registers, stack, sass = compile_sass(launch, config, arch)
                body = max(loops(sass), key=len)
                elements = config.kwargs["BLOCK_N"] * config.kwargs["BLOCK_F"]
                counts = Counter(instruction_class(op) for op in body)
                per_element = {c: counts[c] * config.num_warps * 32 / elements for c in CLASSES}
                total = sum(per_element.values())
                ratio = (total / 32 / ISSUE_PER_CYCLE) / (streams * size / MEMORY_BYTES_PER_CYCLE)
                name = activation + ("" if activation != "gelu" else ", A&S Φ" if half else ", libdevice erf")
                mix = " · ".join(f"{per_element[c]:.1f}" for c in CLASSES)
                print(f"| {kernel} | {config.kwargs['BLOCK_N']} × {config.kwargs['BLOCK_F']}, {config.num_warps} | "
                      f"{name} | {registers}, {stack} B | {total:.1f} ({mix}) | **{ratio:.2f}** |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability × 10 (90: Hopper)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--first-only", action="store_true", help="only each kernel's first candidate")
    parser.add_argument("--kernels", nargs="+", default=["forward", "dK/dV", "dQ", ATOMIC, "bias-activation"],
                        choices=["forward", "dK/dV", "dQ", ATOMIC, "bias-activation"],
                        help=f"attention's kernels ({ATOMIC!r}: the dK/dV kernel of model.triton_dq=atomic, "
                             "which adds dQ too); bias-activation: model.bias_activation=triton's two")
    parser.add_argument("--ffn", type=int, default=3072, help="the FFN's width (bias-activation's columns)")
    args = parser.parse_args()
    if triton_kernels.INTERPRET:
        parser.error("unset TRITON_INTERPRET: the interpreter's kernels have one configuration and no compiler")
    if native_specialize_impl is None:
        parser.error(f"triton {triton.__version__} has no native_specialize_impl (Triton >= 3.3 has)")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    variants = {"ALiBi": (0.0, False), "+ dropout 0.1": (0.1, False), "+ groups (padding, packing)": (0.1, True)}
    steps = {name: launches(args.batch, args.length, args.heads, args.head_dim, dtype, *variant)
             for name, variant in variants.items()}
    attention = [kernel for kernel in args.kernels if kernel != "bias-activation"]
    if "bias-activation" in args.kernels:
        print_bias_activation(args.batch * args.length, args.ffn, args.dtype, args.arch, args.first_only)
    if not attention:
        return
    print(f"\nmodel.attention_backend=triton's kernels on sm_{args.arch}: batch {args.batch}, length {args.length}, "
          f"{args.heads} heads of {args.head_dim}, {args.dtype}; triton {triton.__version__}")
    print("| kernel | BLOCK_M × BLOCK_N, warps, stages | variant | registers, stack | whole blocks' loop | masked "
          "blocks' loop |")
    print("|---|---|---|---:|---|---|")
    for kernel in attention:
        configs = steps["ALiBi"][kernel].kernel.configs
        for config in configs[:1] if args.first_only else configs:
            shape = describe(config)
            for variant, step in steps.items():
                registers, stack, sass = compile_sass(step[kernel], config, args.arch)
                bodies = loops(sass)
                if len(bodies) != 3:
                    raise SystemExit(f"{kernel}: {len(bodies)} loops in the SASS, not the masked blocks' and the "
                                     "whole blocks' two: update benchmarks/triton_static.py's reading of them")
                cells = []
                for body in (max(bodies[1:], key=len), bodies[0]):  # whole (the longer of the two), masked
                    per_score, issue, mufu = loop_costs(body, config)
                    mix = " · ".join(f"{per_score[c]:.1f}" for c in CLASSES)
                    cells.append(f"{sum(per_score.values()):.1f} ({mix}), **{issue:.2f}**, {mufu:.2f}")
                spill = f"{registers}, {stack} B" + (" (spills)" if stack else "")
                print(f"| {kernel} | {shape} | {variant} | {spill} | {' | '.join(cells)} |", flush=True)

if __name__ == "__main__":
    main()
