#!/usr/bin/env python
"""Registers and stack (registers spilled to local memory) of each autotuner candidate of
model.attention_backend=triton's kernels (megamlm/model/triton_kernels.py), compiled for a GPU
architecture on this machine: Triton's compiler and its bundled cuobjdump, no GPU needed.

    python benchmarks/triton_registers.py                  # sm_90 (H100/H200), head dim 64, bf16, ALiBi

A candidate with stack > 0 spills: its loads and stores of spilled registers usually lose the autotuner's
race, so the candidate lists leave those out (BENCHMARKS.md, session 30). Each row: without dropout, and
with the recipe's attention dropout 0.1 (the hash's integer lanes are the extra registers).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megamlm.model import triton_kernels
from megamlm.model.flex import dropped_levels

POINTER_TYPES = {"LSE": "*fp32", "DELTA": "*fp32", "DSLOPES": "*fp32", "SLOPES": "*fp32", "GROUPS": "*i32",
                 "SPANS": "*i32", "SEED": "*i64"}
FLOAT_ARGUMENTS = {"qk_scale", "sm_scale", "offset", "keep_scale"}
INT_ARGUMENTS = {"H", "S"}  # heads and length; strides are the lowercase rest


def resources(fn, constants: dict, warps: int, stages: int, arch: int, dtype: str) -> tuple[int, int]:
    """(registers, stack bytes) of `fn` compiled with `constants` for sm_`arch`."""
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.isupper() and name not in INT_ARGUMENTS:  # tensors: q, k, v, out, gradients in the model's dtype
            signature[name] = POINTER_TYPES.get(name, f"*{dtype}")
        else:
            signature[name] = "fp32" if name in FLOAT_ARGUMENTS else "i32"
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                            target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return int(match.group(1)), int(match.group(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability × 10 (90: Hopper)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    args = parser.parse_args()
    if triton_kernels.INTERPRET:
        parser.error("unset TRITON_INTERPRET: the interpreter's kernels have one configuration and no compiler")
    print(f"model.attention_backend=triton's autotuner candidates on sm_{args.arch}, head dim {args.head_dim}, "
          f"{args.dtype}, ALiBi; triton {triton.__version__}")
    print("| kernel | BLOCK_M × BLOCK_N, warps, stages | no dropout: registers, stack | dropout 0.1 | dropout 0.1, "
          "groups (padding, documents, packed rows) |")
    print("|---|---|---:|---:|---:|")
    for name, tuner in triton_kernels.AUTOTUNED.items():
        for config in tuner.configs:
            rows = []
            for dropped, groups in ((0, False), (dropped_levels(0.1), False), (dropped_levels(0.1), True)):
                constants = {"HEAD_DIM": args.head_dim, **config.kwargs, "HAS_ALIBI": True, "HAS_GROUPS": groups,
                             "HAS_WINDOW": False, "DROPPED": dropped}
                if "SLOPE_GRAD" in tuner.fn.arg_names:  # dQ: fixed slopes, no gradient of theirs
                    constants["SLOPE_GRAD"] = False
                registers, stack = resources(tuner.fn, constants, config.num_warps, config.num_stages, args.arch,
                                             args.dtype)
                rows.append(f"{registers}, {stack} B" + (" (spills)" if stack else ""))
            shape = f"{config.kwargs['BLOCK_M']} × {config.kwargs['BLOCK_N']}, {config.num_warps}, {config.num_stages}"
            print(f"| {name} | {shape} | {' | '.join(rows)} |", flush=True)


if __name__ == "__main__":
    main()
