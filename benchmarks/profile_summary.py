#!/usr/bin/env python
"""Where a GPU loop's kernel time goes: the loop's profile table (`train.profile_updates`, written to
run_dir/profile.txt) summed by kind of kernel.

    python benchmarks/profile_summary.py runs/loop-2048-flat-compiled/profile.txt
    python benchmarks/profile_summary.py benchmarks/results/gpu-h200/lease3-*.profile.txt

The table lists operators and kernels by device time (train/profiling.py: the top 100). Only kernel
rows are summed: an aten operator's device time is its kernels', which have rows of their own, and
the loop's phases (`megamlm: forward`, ...) and `Optimizer.step#...` are ranges around them. What
the table's top rows leave out is "beyond the table": its footer's total minus the kernels listed.
Updates per profile: the `profile` event of the log.jsonl beside it (lease archives:
NAME.log.jsonl beside NAME.profile.txt), else --updates.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

KINDS = (
    # cuDNN, FlashAttention, Flex's Triton templates, ours (model.attention_backend=triton: `_attention_*`;
    # session 60's lease profiled them as `_forward_kernel`, `_backward_keys_kernel`, ...)
    ("attention", r"sdpa|fmha|flash|attention|triton_tem|^_(forward|backward_keys|backward_queries)_kernel$"),
    # ours (model.bias_activation=triton; session 60's lease: `_backward_kernel`, its forward merged with
    # the attention's `_forward_kernel`)
    ("bias + activation (ours)", r"^_bias_activation_|^_backward_kernel$"),
    ("matmul", r"nvjet|gemm|cutlass|xmma|cublas"),
    ("Inductor's fused kernels", r"^triton_"),
    ("optimizer", r"multi_tensor_apply|adam"),
    ("communication", r"nccl"),
    ("eager elementwise, reductions, copies", r"elementwise|reduce_kernel|Copy|fill|index|scatter|gather"),
)
"""Kernel kinds by a regular expression on the kernel's name (case-insensitive); the first match counts."""

_TIME = re.compile(r"^([0-9.]+)(us|ms|s)$")


def milliseconds(text: str) -> float:
    value, unit = _TIME.match(text).groups()
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def kernel_rows(table: str) -> tuple[list[tuple[str, float, int]], float]:
    """The first table of a profile.txt -> ([(kernel, device ms, calls)], the footer's device total ms)."""
    rows, total = [], None
    for line in table.splitlines()[3:]:
        if line.startswith("-"):
            continue
        if line.startswith("Self CUDA time total:"):
            total = milliseconds(line.split(":")[1].strip())
            break
        if line.startswith("Self CPU time total:"):
            continue
        name, cols = line[:70].strip(), line[70:].split()
        if len(cols) < 10:
            continue
        self_cpu, cpu_total, self_cuda, calls = cols[1], cols[3], cols[5], int(cols[-1])
        ranges = name.startswith(("megamlm:", "ProfilerStep")) or "#" in name
        if milliseconds(self_cpu) == 0 and milliseconds(cpu_total) == 0 and not ranges:
            rows.append((name, milliseconds(self_cuda), calls))
    if total is None:
        raise SystemExit("no 'Self CUDA time total' in the table: a profile recorded on a CPU has no kernels")
    return rows, total


def updates_of(profile: Path, default: int) -> int:
    for log in (profile.with_name("log.jsonl"), profile.with_name(profile.name.replace(".profile.txt", ".log.jsonl"))):
        if log.is_file():
            for line in log.read_text().splitlines():
                event = json.loads(line)
                if event.get("event") == "profile":
                    return int(event["updates"])
    return default


def summary(rows: list[tuple[str, float, int]], total: float) -> list[tuple[str, float, list[str]]]:
    """[(kind, device ms, its top kernels)] in KINDS' order, then "other" and "beyond the table"."""
    kinds: dict[str, list[tuple[str, float, int]]] = {kind: [] for kind, _ in KINDS} | {"other": []}
    for row in rows:
        kind = next((kind for kind, pattern in KINDS if re.search(pattern, row[0], re.I)), "other")
        kinds[kind].append(row)
    out = [(kind, sum(ms for _, ms, _ in found), [name for name, _, _ in sorted(found, key=lambda r: -r[1])[:2]])
           for kind, found in kinds.items()]
    return out + [("beyond the table", total - sum(ms for _, ms, _ in rows), [])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profiles", nargs="+", type=Path)
    parser.add_argument("--updates", type=int, default=3, help="updates per profile where no log.jsonl says")
    args = parser.parse_args()
    for profile in args.profiles:
        rows, total = kernel_rows(profile.read_text())
        updates = updates_of(profile, args.updates)
        print(f"{profile}: {total / updates:.1f} ms of kernels per update ({updates} updates)")
        print(f"  {'kind':<40}{'ms/update':>10}{'share':>8}  largest kernels")
        for kind, ms, top in summary(rows, total):
            print(f"  {kind:<40}{ms / updates:>10.1f}{100 * ms / total:>7.1f}%  {'; '.join(n[:40] for n in top)}")


if __name__ == "__main__":
    main()
