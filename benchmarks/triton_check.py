#!/usr/bin/env python
"""model.attention_backend=triton on the device: the compiled kernels' output and gradients against the
fp64 materialized reference (`materialized_attention`), beside SDPA + bias in the same dtype as the
yardstick of that dtype's rounding. The tests run the kernels in Triton's interpreter; this is the check
that the GPU's compiled kernels (integer hash lanes, exp2, block sizes the autotuner picks) agree.

    python benchmarks/triton_check.py                     # GPU: bf16, 2 x 12 heads x 64, lengths 1000, 2048
    python benchmarks/triton_check.py --dq atomic         # the backward of model.triton_dq=atomic

The kernels get q, k and v as a layer hands them over: one tensor laid out as the QKV projection's output,
their gradients written into one tensor of that layout. Cases: whole rows; padded rows with two documents
in one; packed rows (three samples and a free tail) through a 256-token window (a ModernBERT local
layer's) — the last two skip the blocks no query sees; each without and with attention dropout 0.1
(SDPA cannot take the mask: its yardstick is the same case without dropout). Exits 1 when an error
exceeds 4x SDPA's (+ 1e-3), naming the case.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import torch
import torch.nn.functional as F

from megamlm.model.attention import split_qkv
from megamlm.model.positions import alibi_slopes
from megamlm.model.triton_attention import materialized_attention, materialized_bias, triton_attention

DROPOUT = 0.1
WINDOW = 256  # the packed case's window (a ModernBERT local layer's is 128)


def _groups(b: int, s: int, device) -> torch.Tensor:
    """Row 0: two documents; row 1: padded after 3/4 of its length."""
    groups = torch.zeros(b, s, dtype=torch.int32, device=device)
    groups[0, s // 3:] = 1
    groups[1:, 3 * s // 4:] = -1
    return groups


def _packed(b: int, s: int, device) -> torch.Tensor:
    """Every row: three samples of s/4, s/3 and s/4 positions, then free."""
    groups = torch.full((b, s), -1, dtype=torch.int32, device=device)
    groups[:, : s // 4], groups[:, s // 4: s // 4 + s // 3], groups[:, s // 4 + s // 3: s // 2 + s // 3] = 0, 1, 2
    return groups


def _sdpa(q, k, v, slopes, groups, window):
    """SDPA with the kernels' bias; the kernels' padding queries see no key (zeros): SDPA's see every key
    and are zeroed after, so that no softmax row is empty."""
    bias = materialized_bias(slopes, 0.5, groups, q.size(2), q.dtype, q.device, window)
    if groups is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    real = (groups >= 0)[:, None, :, None]  # [b, 1, s, 1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(~real, 0.0)) * real


def _errors(fn, inputs, grad, reference) -> list[float]:
    """max |error| of the output and of dq, dk, dv against the fp64 reference's."""
    q, k, v = (t.detach().clone().requires_grad_() for t in inputs)
    out = fn(q, k, v)
    got = [out, *torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))]
    return [(a.double() - b).abs().max().item() for a, b in zip(got, reference)]


def _unsplit_errors(fn, inputs, grad, reference) -> list[float]:
    """`_errors` with q, k and v handed over as a layer does: one tensor, the QKV projection's output
    [s, b, np, 3 · hn], whose gradient the backward kernels write whole (k and v None)."""
    # 3 x [b, np, s, hn] -> [b, np, s, 3 hn] -> [s, b, np, 3 hn]
    mixed = torch.cat(inputs, -1).permute(2, 0, 1, 3).contiguous().requires_grad_()
    out = fn(mixed.permute(1, 2, 0, 3), None, None)
    (whole,) = torch.autograd.grad(out, mixed, grad.to(out.dtype))
    # [s, b, np, 3 hn] -> [b, np, s, 3 hn] -> 3 x [b, np, s, hn]
    got = [out, *split_qkv(whole.permute(1, 2, 0, 3))]
    return [(a.double() - b).abs().max().item() for a, b in zip(got, reference)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1000,2048")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dq", default="recompute", choices=("recompute", "atomic"),
                        help="model.triton_dq: dQ from a kernel of its own, or added by the dK/dV kernel")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    slopes = torch.tensor(alibi_slopes(args.heads), device=device)
    print(f"triton attention (dQ: {args.dq}) vs fp64 reference, {args.dtype}, batch {args.batch}, {args.heads} heads "
          f"x {args.head_dim}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}")
    print(f"{'length':>7}  {'case':<30}{'kernel':<8}{'out':>10}{'dq':>10}{'dk':>10}{'dv':>10}")
    failed = []
    started = time.time()
    for length in (int(n) for n in args.lengths.split(",")):
        g = torch.Generator(device=device).manual_seed(0)
        shape = (args.batch, args.heads, length, args.head_dim)
        inputs64 = [torch.randn(shape, generator=g, device=device, dtype=torch.float64) for _ in range(3)]
        inputs = [t.to(dtype) for t in inputs64]  # the reference sees the rounded inputs too
        inputs64 = [t.double() for t in inputs]
        grad = torch.randn(shape, generator=g, device=device, dtype=torch.float64)
        for case, groups, window in (("whole rows", None, None),
                                     ("documents + padding", _groups(args.batch, length, device), None),
                                     (f"packed, window {WINDOW}", _packed(args.batch, length, device), WINDOW)):
            sdpa = None
            for p in (0.0, DROPOUT):
                seed = torch.tensor(20261127 + length, device=device) if p else None
                q, k, v = (t.detach().clone().requires_grad_() for t in inputs64)
                out = materialized_attention(q, k, v, slopes.double(), 0.5, groups, p, seed, window=window)
                reference = [out, *torch.autograd.grad(out, (q, k, v), grad)]
                ours = _unsplit_errors(functools.partial(triton_attention, slopes=slopes, offset=0.5, groups=groups,
                                                         dropout_p=p, seed=seed, window=window,
                                                         atomic_dq=args.dq == "atomic"), inputs, grad, reference)
                if sdpa is None:
                    sdpa = _errors(functools.partial(_sdpa, slopes=slopes, groups=groups, window=window), inputs,
                                   grad, reference)
                    print(f"{length:>7}  {case:<30}{'sdpa':<8}" + "".join(f"{e:>10.2e}" for e in sdpa))
                label = case + (", dropout" if p else "")
                print(f"{length:>7}  {label:<30}{'triton':<8}" + "".join(f"{e:>10.2e}" for e in ours)
                      + f"  ({time.time() - started:.0f} s, autotuning included)", flush=True)
                if any(ours_e > 4 * sdpa_e + 1e-3 for ours_e, sdpa_e in zip(ours, sdpa)):
                    failed.append(f"{length} {label}")
    if failed:
        print(f"triton_check: errors above 4x SDPA's: {'; '.join(failed)}")
        sys.exit(1)
    print("triton_check: every case within 4x SDPA's error")


if __name__ == "__main__":
    main()
