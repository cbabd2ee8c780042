#!/usr/bin/env python
"""Memory and time of the MLM head + loss: model.head_loss=unfused vs fused (issue 20), side by side.

    python benchmarks/head_memory.py                      # CPU: tiny, length 512, batch 4, V 50,265
    python benchmarks/head_memory.py --model base --seq-length 2048 --batch 8 --dtype bf16 \
        --chunks 2097152 8388608 33554432                   # GPU: fused at three chunk sizes
    python benchmarks/head_memory.py --compiled           # also unfused under train.compile_head (time only)

One training micro-batch's head: the encoder's output at the masked positions (15%) goes through the
head (RoBERTa's or CLAP's with --variant) and the vocab-parallel cross-entropy, forward and backward.
"peak" is the most bytes held at once by tensors created during that step (operator outputs tracked
through a dispatch mode, freed when their storage is): the parameters and the features that exist
before it are not counted, the logits, their fp32 copy, the softmax and every gradient are. The whole
model's step (encoder included) is measured the same way. Times are medians of interleaved rounds.
The compiled row's peaks are not shown: Inductor's kernels run inside one call the dispatch mode cannot see.
"""

from __future__ import annotations

import argparse
import statistics
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megamlm.config import ParallelConfig, load_config
from megamlm.objectives import MaskedLM
from megamlm.parallel import init_distributed, seed_everything
from megamlm.train.layers import compile_head
from train_throughput import timed  # benchmarks/ is the script's folder: on sys.path

ROOT = Path(__file__).resolve().parents[1]


class PeakMemory(TorchDispatchMode):
    """Bytes of live storages created by operators inside the mode: `peak` is their maximum."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.storages: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.storages.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # an output sharing an input's storage (a view, an in-place result) holds no new memory
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes and key not in self.storages and key not in inputs:
                self.storages.add(key)
                self.live += nbytes
                weakref.finalize(storage, self._freed, key, nbytes)
        self.peak = max(self.peak, self.live)
        return out


COMPILED = "unfused, compiled"
"""The row of the unfused head under train.compile_head (--compiled)."""


def head_step(model: MaskedLM, features: torch.Tensor, targets: torch.Tensor, dtype) -> None:
    """Forward and backward of the head + summed loss from features [n, h]."""
    with torch.autocast(features.device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = model.loss_sum(features, targets)
    loss.backward()


def model_step(model: MaskedLM, inputs, masked_index, targets, dtype) -> None:
    with torch.autocast(inputs.device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = model(inputs, masked_index, targets=targets)
    loss.backward()


def peak_bytes(step) -> int:
    mode = PeakMemory()
    with mode:
        step()
    return mode.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", choices=("tiny", "base", "large"))
    parser.add_argument("--variant", default="baseline", help="configs/variants/<name>.yaml")
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per round")
    parser.add_argument("--chunks", type=int, nargs="+", help="model.head_loss_chunk values of the fused rows "
                        "(default: the config's)")
    parser.add_argument("--compiled", action="store_true", help="a row of the unfused head under train.compile_head")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    ctx = init_distributed(ParallelConfig())
    seed_everything(1, ctx)
    files = [ROOT / f"configs/model/{args.model}.yaml", ROOT / f"configs/variants/{args.variant}.yaml"]
    sizes = [f"model.max_positions={max(512, args.seq_length)}", "model.hidden_dropout=0", "model.attention_dropout=0"]
    chunks = args.chunks or [load_config(files).model.head_loss_chunk]
    modes = {"unfused": ["model.head_loss=unfused"],
             **{f"fused {chunk:,}": ["model.head_loss=fused", f"model.head_loss_chunk={chunk}"] for chunk in chunks}}
    if args.compiled:
        modes[COMPILED] = modes["unfused"]
    models = {mode: MaskedLM(load_config(files, sizes + overrides).model, ctx, seed=1).train()
              for mode, overrides in modes.items()}
    for model in models.values():
        model.load_state_dict(models["unfused"].state_dict())
    if args.compiled:
        compile_head(models[COMPILED])
    m = models["unfused"].config
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, m.vocab_size - 1, (args.batch, args.seq_length), generator=g).to(ctx.device)
    masked = (torch.rand(tokens.shape, generator=g) < 0.15).to(ctx.device)
    masked_index, targets = masked.flatten().nonzero().squeeze(1), tokens[masked]
    inputs = tokens.masked_fill(masked, m.vocab_size - 1)
    features = torch.randn(len(targets), m.hidden_size, device=ctx.device, requires_grad=True)
    heads = {mode: (lambda model=model: head_step(model, features, targets, dtype)) for mode, model in models.items()}
    steps = {mode: (lambda model=model: model_step(model, inputs, masked_index, targets, dtype))
             for mode, model in models.items()}
    for step in (*heads.values(), *steps.values()):  # warm-up
        step()
    head_peak = {mode: peak_bytes(step) for mode, step in heads.items() if mode != COMPILED}
    step_peak = {mode: peak_bytes(step) for mode, step in steps.items() if mode != COMPILED}
    head_time: dict[str, list[float]] = {mode: [] for mode in modes}
    step_time: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:
            head_time[mode].append(timed(heads[mode], args.steps, ctx.device) / args.steps)
            step_time[mode].append(timed(steps[mode], args.steps, ctx.device) / args.steps)
    n, vocab_local = len(targets), models["unfused"].padded_vocab_size
    logits_mb = n * vocab_local * torch.finfo(dtype).bits / 8 / 2**20
    device = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "CPU"
    print(f"{args.model} {args.variant} (h={m.hidden_size}, V={m.vocab_size}, V_local={vocab_local}), length "
          f"{args.seq_length}, batch {args.batch}, {n} masked positions, {args.dtype}, device {device}, "
          f"{torch.get_num_threads()} threads; logits [n, V_local] = {logits_mb:,.1f} MiB in {args.dtype}")
    print(f"{'head_loss (chunk)':<20}{'head peak MiB':>15}{'saved':>8}{'step peak MiB':>15}{'head ms':>10}"
          f"{'step ms':>10}")
    for mode in modes:
        if mode in head_peak:
            saved = (head_peak["unfused"] - head_peak[mode]) / 2**20
            peaks = f"{head_peak[mode] / 2**20:>15,.1f}{saved / logits_mb:>7.2f}x{step_peak[mode] / 2**20:>15,.1f}"
        else:
            peaks = f"{'-':>15}{'-':>8}{'-':>15}"
        print(f"{mode:<20}{peaks}{statistics.median(head_time[mode]) * 1e3:>10,.1f}"
              f"{statistics.median(step_time[mode]) * 1e3:>10,.1f}")
    print("saved: the head's peak below unfused's, in multiples of the logits' size")


if __name__ == "__main__":
    main()
