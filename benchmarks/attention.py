#!/usr/bin/env python
"""ALiBi-offset (the blog's "nonsymmetric with offset") attention, forward + backward, by kernel.

    python benchmarks/attention.py                                    # CPU: lengths 256..1024, fp32
    python benchmarks/attention.py --lengths 512,1024,2048,4096,8192 --dtype bf16 --heads 12   # GPU

Rows per length: eager (matmul + bias + softmax, the fork's way), SDPA with the cached bias
(megamlm's default: one [1, np, s, s] the rows share when no key is padded) and with the bias per row (a
padded batch's [b, np, s, s]), FlexAttention with the ALiBi score_mod (GPU; no bias tensor), both also with
the reference recipe's attention dropout 0.1 (Flex: megamlm's two passes, flex.py), and as speed
references SDPA without any bias and, where the flash_attn package is installed, FlashAttention-2
with its built-in symmetric ALiBi; and megamlm's alibi-flash (ALiBi as extra head dimensions of two
causal flash passes: on a GPU once per private flash op, cuDNN's and FlashAttention-2's, with and
without dropout; on a CPU its plain-matmul reference passes); and megamlm's Triton kernels
(model.attention_backend=triton, GPU: ALiBi and the dropout mask inside one pass). Columns: time, achieved TFLOP/s
(4·b·np·s²·hn fwd, ×3.5 fwd+bwd with the recomputation flash kernels do), peak memory (GPU:
inputs, the bias where the kernel takes one, activations and gradients of one forward + backward)
and max |error| of the output against an fp64 eager reference.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, flex_attention

from megamlm.errors import error_line
from megamlm.model.alibi_flash import CudnnKernel, FlashKernel, ReferenceKernel, alibi_flash_attention, alibi_terms
from megamlm.model.flex import attend_with_dropout, kernel_options
from megamlm.model.positions import alibi_bias, alibi_slopes
from megamlm.model.triton_attention import triton_attention
from timing import timed, warm_clocks

DROPOUT = 0.1  # the reference recipe's attention dropout


def eager(q, k, v, bias):
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 + bias
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def sdpa(q, k, v, bias):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def sdpa_no_bias(q, k, v, bias):
    return F.scaled_dot_product_attention(q, k, v)


def _alibi_offset(slopes):
    def score_mod(score, b, h, q_idx, kv_idx):
        distance = (q_idx - kv_idx).abs().to(score.dtype)
        distance = torch.where(kv_idx > q_idx, distance - 0.5, distance)
        return score - slopes[h] * distance

    return score_mod


def sdpa_dropout(q, k, v, bias):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=DROPOUT)


def make_flex(slopes, options: str = "", mode: str | None = None):
    """FlexAttention with the ALiBi-offset score_mod, compiled in torch.compile's `mode`
    (max-autotune-no-cudagraphs: Inductor times its own kernel configurations and keeps the fastest)."""
    compiled, score_mod = torch.compile(flex_attention, mode=mode), _alibi_offset(slopes)
    chosen = kernel_options(options) or None
    return lambda q, k, v, bias: compiled(q, k, v, score_mod=score_mod, kernel_options=chosen)


# --flex-sweep: model.flex_kernel_options candidates for head dim 64 (the first is torch's choice);
# a candidate the GPU cannot run (shared memory, registers) prints as failed
FLEX_CANDIDATES = (
    "",
    "BLOCK_M=128,BLOCK_N=64,num_warps=4,num_stages=3",
    "BLOCK_M=128,BLOCK_N=128,num_warps=8,num_stages=2",
    "BLOCK_M=128,BLOCK_N=64,num_warps=8,num_stages=3",
    "BLOCK_M=64,BLOCK_N=64,num_warps=4,num_stages=3",
    "BLOCK_M=64,BLOCK_N=128,num_warps=4,num_stages=2",
    "bwd_BLOCK_M1=64,bwd_BLOCK_N1=128,bwd_BLOCK_M2=128,bwd_BLOCK_N2=64,bwd_num_warps=8,bwd_num_stages=2",
    "bwd_BLOCK_M1=32,bwd_BLOCK_N1=64,bwd_BLOCK_M2=64,bwd_BLOCK_N2=32,bwd_num_warps=4,bwd_num_stages=3",
    # lease 5's best forward and best backward together (PRESCALE_QK=true left the list there: with a score_mod
    # it is wrong, max error 0.86; model/flex.py: kernel_options refuses it)
    "BLOCK_M=128,BLOCK_N=64,num_warps=8,num_stages=3,"
    "bwd_BLOCK_M1=32,bwd_BLOCK_N1=64,bwd_BLOCK_M2=64,bwd_BLOCK_N2=32,bwd_num_warps=4,bwd_num_stages=3",
)


def make_flex_dropout(slopes):
    """megamlm's two-pass Flex attention dropout (flex.py) with the ALiBi-offset score_mod."""
    compiled, score_mod = torch.compile(flex_attention), _alibi_offset(slopes)
    seed = torch.tensor(1234, device=slopes.device)

    def attend(q, k, v, score_mod):
        out, aux = compiled(q, k, v, score_mod=score_mod, return_aux=AuxRequest(lse=True))
        return out, aux.lse

    return lambda q, k, v, bias: attend_with_dropout(attend, q, k, v, score_mod, DROPOUT, seed)


def make_alibi_flash(slopes, kernel, dropout_p: float = 0.0):
    """megamlm's alibi-flash backend: ALiBi-offset as extra head dimensions of two causal flash
    passes of `kernel` (model/alibi_flash.py), no bias tensor."""
    def run(q, k, v, bias):
        terms = alibi_terms(slopes, 0.5, None, q.size(2), q.size(3), q.dtype)  # once per forward in the model
        return alibi_flash_attention(q, k, v, terms, dropout_p, kernel)

    return run


def make_triton(slopes, dropout_p: float = 0.0):
    """megamlm's triton backend: ALiBi-offset (and the dropout mask) inside its own kernels."""
    seed = torch.tensor(1234, device=slopes.device)  # as the Flex dropout row's (one mask: speed only)

    def run(q, k, v, bias):
        return triton_attention(q, k, v, slopes, 0.5, None, dropout_p, seed)

    return run


def make_flash_symmetric(slopes):
    from flash_attn import flash_attn_func  # optional; FlashAttention-2 has symmetric ALiBi only

    def run(q, k, v, bias):
        # [b, np, s, hn] -> [b, s, np, hn]
        out = flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), alibi_slopes=slopes.float(), causal=False)
        return out.transpose(1, 2)

    return run


# kernels that take the materialized [1, np, s, s] bias; the others get None and never allocate it
PER_ROW = "sdpa + bias per row [b, np, s, s]"
"""The bias as a padded batch has it (and as megamlm built it for every batch before session 28): one copy per
row; "sdpa + cached bias" is the one [1, np, s, s] an unpadded batch shares."""
TAKES_BIAS = {"eager", "sdpa + cached bias", "sdpa + cached bias, dropout 0.1", PER_ROW}


def bench(fn, q, k, v, bias, repeats: int, device) -> tuple[float, float]:
    """(median seconds of forward + backward, peak memory GiB or nan). On a GPU: the device time between
    two events around `repeats` calls queued back to back (as a GPU-bound training loop queues them; a
    host clock around each call also counted its launches), the median of 3 such windows, after 3
    warm-up calls (compilation, cuDNN's plan). On a CPU: the host clock per call, after one."""
    def call():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v, bias).sum().backward()

    for _ in range(3 if device.type == "cuda" else 1):
        call()
    if device.type == "cuda":
        windows = [timed(lambda: [call() for _ in range(repeats)], device) / repeats for _ in range(3)]
        return statistics.median(windows), torch.cuda.max_memory_allocated() / 2**30
    times = [timed(call, device) for _ in range(repeats)]
    return statistics.median(times), float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="256,512,1024")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--repeats", type=int, default=10, help="calls per timed window (a GPU: 3 windows)")
    parser.add_argument("--flex-sweep", action="store_true",
                        help="GPU: also time FlexAttention under each FLEX_CANDIDATES kernel_options, and as "
                             "max-autotune-no-cudagraphs compiles it (Inductor picks its fastest configuration)")
    parser.add_argument("--kernels", default="", help="comma-separated beginnings of the kernel names to time "
                        "(e.g. sdpa,flex for the sweep); default: every kernel")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    slopes = torch.tensor(alibi_slopes(args.heads), device=device)
    kernels = {"eager": eager, "sdpa + cached bias": sdpa, PER_ROW: sdpa,
               "sdpa + cached bias, dropout 0.1": sdpa_dropout, "sdpa, no bias (reference)": sdpa_no_bias}
    if device.type != "cuda":
        kernels["alibi-flash, matmul passes (CPU)"] = make_alibi_flash(slopes, ReferenceKernel())
    else:
        # each private flash op alibi-flash may choose (flash_kernel takes the first that passes its check)
        for kernel in (CudnnKernel(), FlashKernel()):
            kernels[f"alibi-flash, {kernel.name} passes"] = make_alibi_flash(slopes, kernel)
            kernels[f"alibi-flash, {kernel.name} passes, dropout 0.1"] = make_alibi_flash(slopes, kernel, DROPOUT)
        # one compilation per length, pass (two with dropout), grad mode (the error check runs without)
        # and sweep candidate: past the default limit of 8, FlexAttention silently runs its eager path,
        # which materializes the scores (2048 and 8192 on an H200: the 8192 dropout row took 574 ms)
        torch._dynamo.config.recompile_limit = 64
        kernels["flex score_mod"] = make_flex(slopes)
        kernels["flex score_mod, dropout 0.1"] = make_flex_dropout(slopes)
        kernels["triton"] = make_triton(slopes)
        kernels["triton, dropout 0.1"] = make_triton(slopes, DROPOUT)
        if args.flex_sweep:
            kernels.update({f"flex {options}": make_flex(slopes, options) for options in FLEX_CANDIDATES[1:]})
            kernels["flex, max-autotune-no-cudagraphs"] = make_flex(slopes, mode="max-autotune-no-cudagraphs")
        try:
            kernels["flash-attn-2 symmetric (reference)"] = make_flash_symmetric(slopes)
        except ImportError:
            pass
    if args.kernels:
        kernels = {name: fn for name, fn in kernels.items() if name.startswith(tuple(args.kernels.split(",")))}
    if device.type == "cuda":
        warm_clocks()
    print(f"ALiBi-offset attention fwd+bwd, batch {args.batch}, {args.heads} heads x {args.head_dim}, {args.dtype}, "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else f'CPU, {torch.get_num_threads()} threads'}")
    width = max(36, *(len(name) + 2 for name in kernels))
    print(f"{'length':>7}  {'kernel':<{width}}{'ms':>10}{'TFLOP/s':>10}{'peak GiB':>10}{'max |err|':>11}")
    for length in (int(n) for n in args.lengths.split(",")):
        g = torch.Generator().manual_seed(0)
        shape = (args.batch, args.heads, length, args.head_dim)
        q64, k64, v64 = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(3))
        bias64 = alibi_bias(slopes.cpu().double(), slopes.cpu().double(), length, length, 0.5)[None]
        reference = eager(q64, k64, v64, bias64)
        flops = 4 * args.batch * args.heads * length**2 * args.head_dim * 3.5
        for name, fn in kernels.items():
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()  # counted from here: this kernel's inputs on
            q, k, v = (t.to(device, dtype).requires_grad_() for t in (q64, k64, v64))
            bias = bias64.to(device, dtype) if name in TAKES_BIAS else None
            if name == PER_ROW:  # [1, np, s, s] -> [b, np, s, s], a copy per row
                bias = bias.expand(args.batch, -1, -1, -1).contiguous()
            try:
                seconds, memory = bench(fn, q, k, v, bias, args.repeats, device)
                with torch.no_grad():
                    error = (fn(q, k, v, bias).double().cpu() - reference).abs().max().item()
            except Exception as err:  # noqa: BLE001 - a kernel that cannot run here is a row, not the end
                print(f"{length:>7}  {name:<{width}}  failed: {type(err).__name__}: {error_line(err)[:60]}")
                continue
            finally:
                del q, k, v, bias  # before the next kernel's peak is counted
            if "reference" in name or "dropout" in name:
                error = float("nan")  # no or a different bias, or random: a speed reference only
            print(f"{length:>7}  {name:<{width}}{seconds * 1e3:>10.2f}{flops / seconds / 1e12:>10.3f}"
                  f"{memory:>10.2f}{error:>11.2e}")


if __name__ == "__main__":
    main()
