#!/usr/bin/env python
"""Training throughput: megamlm vs Hugging Face (`RobertaForMaskedLM`, or the transformers class of the
variant) at identical configuration.

    python benchmarks/train_throughput.py                                          # CPU: tiny, 512, fp32
    python benchmarks/train_throughput.py --keep-freed-memory                      # CPU, as `megamlm train` allocates
    python benchmarks/train_throughput.py --model base --seq-length 2048 --batch 8 --dtype bf16   # GPU
    python benchmarks/train_throughput.py --model base --seq-length 2048 --batch 8 --dtype bf16 \
        --variant zero-clap --set model.attention_backend=flex model.attention_dropout=0
    python benchmarks/train_throughput.py --model modernbert-base --variant modernbert --seq-length 8192 \
        --batch 2 --dtype bf16 --set model.attention_backend=flex         # vs ModernBertForMaskedLM

Both models: post-LN RoBERTa (the baseline variant: learned positions, RoBERTa head), the real
50265-symbol vocabulary, the same sequence length, batch, dropout, 15% masking and torch AdamW; one
update = forward + backward + optimizer step. Hugging Face projects every position onto the
vocabulary, megamlm only the masked ones. Rounds are interleaved (A B A B ...) so drift on a noisy
machine hits both; the table gives medians, the median per-round ratio, and the model FLOP rate
against a matmul timed in the same run (CPU) or the GPU's datasheet peak. `--variant` (and `--set`
overrides) changes megamlm's model; Hugging Face gets the same configuration in the transformers
class that computes it (convert/hf_export.py's `hf_format`: BERT, ModernBERT, ...) and otherwise (ALiBi,
CLAP) stays the baseline RoBERTa, a reference rather than a like-for-like pair. `--compile` compiles
every transformer layer of both models (torch.compile). `--dtype bf16` runs both models as the training
loop does (train.precision=bf16 under DeepSpeed): bf16 weights, fp32 master weights in the optimizer
only, no per-forward casts; `--dtype bf16-autocast` keeps fp32 weights and casts them in every forward
(torch.autocast, what BENCHMARKS.md's first GPU rows ran).
"""

from __future__ import annotations

import argparse
import statistics
import time
import typing
from pathlib import Path

import torch

from megamlm.config import ParallelConfig, TrainConfig, load_config
from megamlm.convert.hf import hf_config_values
from megamlm.convert.hf_export import hf_format
from megamlm.host_memory import keep_freed_host_memory
from megamlm.model.encoder import encoder_flops_per_token
from megamlm.objectives import MaskedLM
from megamlm.objectives.mlm import mlm_head_flops_per_token
from megamlm.parallel import init_distributed, seed_everything
from megamlm.train.flops import device_peak, measured_matmul_peak
from megamlm.train.layers import compile_layers

ROOT = Path(__file__).resolve().parents[1]


def make_batch(batch: int, length: int, vocab: int, mask_id: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, vocab - 1, (batch, length), generator=g)
    tokens[:, 0], tokens[:, -1] = 0, 2
    masked = torch.rand(batch, length, generator=g) < 0.15
    inputs = tokens.masked_fill(masked, mask_id)
    return inputs.to(device), tokens.to(device), masked.to(device)


class MasterWeightsAdamW:
    """DeepSpeed's bf16 optimizer in miniature, as the training loop runs (train.precision=bf16): the
    model holds bf16 parameters (no per-forward casts), AdamW steps fp32 master copies, which are
    copied back into the model after each step."""

    def __init__(self, model: torch.nn.Module, **adamw):
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float() for p in self.parameters]
        for p in self.parameters:
            p.data = p.data.to(torch.bfloat16)
        self.optimizer = torch.optim.AdamW(self.masters, **adamw)

    def step(self) -> None:
        for master, p in zip(self.masters, self.parameters):
            master.grad = p.grad.float()
        self.optimizer.step()
        with torch.no_grad():
            torch._foreach_copy_(self.parameters, self.masters)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters:
            p.grad = None


def megamlm_step(model, optimizer, inputs, masked_index, targets, autocast, host_layout):
    # as the training loop: flat indices and targets prepared by the loader, the layout read from the
    # batch's host copy (no host sync), the summed loss as model.head_loss computes it
    with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(inputs, masked_index, targets=targets, host_layout=host_layout) / len(targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def hf_step(model, optimizer, inputs, tokens, masked, autocast):
    labels = tokens.masked_fill(~masked, -100)
    with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=inputs, labels=labels).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed(step, steps: int, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", choices=("tiny", "base", "large", "modernbert-base",
                                                            "modernbert-large"))
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "bf16-autocast"),
                        help="bf16: bf16 weights, fp32 masters in the optimizer (as the training loop); "
                             "bf16-autocast: fp32 weights cast to bf16 in every forward")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="updates per round")
    parser.add_argument("--variant", default="baseline", help="configs/variants/<name>.yaml for megamlm")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="megamlm config overrides")
    parser.add_argument("--compile", action="store_true", help="torch.compile each transformer layer")
    parser.add_argument("--compile-mode", default="default",
                        choices=typing.get_args(typing.get_type_hints(TrainConfig)["compile_mode"]),
                        help="torch.compile's mode with --compile (train.compile_mode); reduce-overhead: CUDA graphs")
    parser.add_argument("--profile", action="store_true", help="also print megamlm's top kernels (torch.profiler)")
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="both models under megamlm train's CPU allocator policy (megamlm/host_memory.py): "
                             "large freed blocks kept for the next step's tensors, no page faults")
    args = parser.parse_args()
    if args.keep_freed_memory and not keep_freed_host_memory():
        raise SystemExit("--keep-freed-memory: the C library is not glibc")
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    autocast = args.dtype == "bf16-autocast"
    sizes = [f"model.max_positions={max(512, args.seq_length)}"]
    m = load_config([ROOT / f"configs/model/{args.model}.yaml", ROOT / "configs/variants/baseline.yaml"], sizes).model
    ours_cfg = load_config([ROOT / f"configs/model/{args.model}.yaml", ROOT / f"configs/variants/{args.variant}.yaml"],
                           sizes + args.set).model
    ctx = init_distributed(ParallelConfig())
    seed_everything(1, ctx)
    device = ctx.device
    ours = MaskedLM(ours_cfg, ctx, seed=1).train()
    if hf_format(ours_cfg) is not None:  # the variant is a transformers class: compare like for like
        m = ours_cfg
    fmt = hf_format(m)
    hf = fmt.build(hf_config_values(m, fmt, m.pad_token_id), attn_implementation="sdpa").to(device).train()
    if args.compile:
        compile_layers(ours, args.compile_mode)  # what train.compile does
        for layer in next(sub for sub in hf.base_model.modules() if isinstance(sub, torch.nn.ModuleList)):
            layer.compile(mode=args.compile_mode)
    adamw = dict(lr=1e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01, fused=True)
    optimizers = {name: MasterWeightsAdamW(model, **adamw) if args.dtype == "bf16"
                  else torch.optim.AdamW(model.parameters(), **adamw)
                  for name, model in (("megamlm", ours), ("hf", hf))}
    vocab = min(m.vocab_size, ours_cfg.vocab_size)  # zero-clap has 50262 rows, its mask id is 50262
    inputs, tokens, masked = make_batch(args.batch, args.seq_length, vocab, vocab - 1, device)
    masked_index, targets = masked.flatten().nonzero().squeeze(1), tokens[masked]
    host_layout = (inputs.cpu(), None, None)  # what collate keeps (Batch.host_layout)
    steps = {"megamlm": lambda: megamlm_step(ours, optimizers["megamlm"], inputs, masked_index, targets, autocast,
                                             host_layout),
             "hf": lambda: hf_step(hf, optimizers["hf"], inputs, tokens, masked, autocast)}
    for step in steps.values():  # warm-up: allocator, kernels, optimizer state
        step()
    peak_source = "datasheet"
    matmul = []
    rates: dict[str, list[float]] = {"megamlm": [], "hf": []}
    for _ in range(args.rounds):
        if device.type != "cuda":
            matmul.append(measured_matmul_peak(dtype))
        for name, step in steps.items():
            rates[name].append(args.batch * args.seq_length * args.steps / timed(step, args.steps, device))
    if device.type == "cuda":
        peak, peak_source = device_peak(device, "fp32" if dtype == torch.float32 else "bf16")
    else:
        peak, peak_source = statistics.median(matmul), f"CPU {args.dtype} matmul, same run (median of rounds)"
    fraction = masked.float().mean().item()

    def flops_per_token(model, seq_length, head_fraction):  # MLM: the encoder + a head on a share of positions
        return encoder_flops_per_token(model, seq_length) + mlm_head_flops_per_token(model, head_fraction)

    model_flops = {"megamlm": flops_per_token(ours_cfg, args.seq_length, fraction),
                   "hf": flops_per_token(m, args.seq_length, 1.0)}
    useful = {"megamlm": model_flops["megamlm"],  # what an MLM update of each model needs
              "hf": flops_per_token(m, args.seq_length, fraction)}
    ratios = [a / b for a, b in zip(rates["megamlm"], rates["hf"])]
    print(f"{args.model} (L={m.num_layers}, h={m.hidden_size}, V={m.vocab_size}), megamlm {args.variant} "
          f"vs {fmt.architecture} "
          f"{' '.join(args.set)}{f', compiled ({args.compile_mode})' if args.compile else ''}, "
          f"length {args.seq_length}, {'freed memory kept, ' if args.keep_freed_memory else ''}"
          f"batch {args.batch}, {args.dtype}, {args.rounds} interleaved rounds x {args.steps} updates, "
          f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, "
          f"{torch.get_num_threads()} threads")
    print(f"peak reference: {peak / 1e12:.3f} TFLOP/s ({peak_source})")
    print(f"{'implementation':<18}{'tokens/s':>12}{'min':>10}{'max':>10}{'model TFLOP/s':>15}"
          f"{'model/peak':>12}{'useful/peak':>13}")
    for name in ("megamlm", "hf"):
        tps = statistics.median(rates[name])
        print(f"{name:<18}{tps:>12,.0f}{min(rates[name]):>10,.0f}{max(rates[name]):>10,.0f}"
              f"{model_flops[name] * tps / 1e12:>15.3f}{model_flops[name] * tps / peak:>12.1%}"
              f"{useful[name] * tps / peak:>13.1%}")
    print(f"megamlm / hf per round: median {statistics.median(ratios):.2f}x "
          f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})")
    if args.profile:
        profile(steps["megamlm"], device)


def profile(step, device) -> None:
    """Where one megamlm update spends its time, by operator (self time, device time on GPU)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        timed(step, 2, device)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
