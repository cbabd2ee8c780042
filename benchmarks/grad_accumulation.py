#!/usr/bin/env python
"""An update's gradient summed over micro-batches in the weights' 16-bit dtype vs in fp32
(`train.fp32_grad_accumulation`), on the flat engine, against the exact sum.

    PYTHONPATH=. python benchmarks/grad_accumulation.py              # the demo's tiny model, bf16 and fp16
    PYTHONPATH=. python benchmarks/grad_accumulation.py --config configs/model/base.yaml --micro 2

For k micro-batches of real text (WikiText-103 valid: `megamlm eval`'s samples, masked by the fairseq
rule), the gradient that AdamW receives (clipping off, one rank: the accumulated gradient / k, fp16
unscaled) is read with the option off and on. The engine's weights are the config's model in bf16 /
fp16; dropout is off, so that every backward of a micro-batch computes the same function.
"exact" is the float64 sum of the same micro-batches' 16-bit gradients, each from its own backward:
what an accumulation that loses nothing would hold, so the error columns are the accumulation's alone.
"16-bit backward" is, for scale, how far that exact sum is from the gradient of the same weights
computed in fp32: the error of the micro-batches' gradients before any accumulation.
Errors are relative L2 norms over all parameters.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from megamlm.config import ParallelConfig, load_config
from megamlm.data.batch import collate
from megamlm.data.masking import Masker
from megamlm.data.tokenizer import PAD, Tokenizer
from megamlm.evaluate import samples, token_stream
from megamlm.objectives import get_objective
from megamlm.parallel import init_distributed, seed_everything
from megamlm.train.engine import build_engine
from megamlm.train.loss_scale import FP16_LOSS_SCALING

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def wikitext_batches(tokenizer: Tokenizer, count: int, micro: int, seq_length: int) -> list:
    """`count` micro-batches of `micro` samples of WikiText-103 valid (`megamlm eval`'s samples), masked by
    the fairseq rule with a fixed seed."""
    rows = samples(token_stream(ROOT / "data/wikitext-103/valid.txt", tokenizer, count * micro * seq_length),
                   seq_length)
    masker = Masker(tokenizer.dictionary.mask_id, tokenizer.dictionary.ordinary_ids(), seed=1)
    return [collate([(row, i * micro + j) for j, row in enumerate(rows[i * micro:(i + 1) * micro])],
                    masker, 0, seq_length, PAD) for i in range(len(rows) // micro)]


def loss_scale(dtype: torch.dtype) -> float:
    """What the flat engine multiplies the loss by: fp16's initial dynamic scale."""
    return 2.0 ** FP16_LOSS_SCALING["initial_scale_power"] if dtype == torch.float16 else 1.0


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and its micro-batches (the demo's tiny model on 4 x 128 tokens by default)."""
    parser.add_argument("--config", default=str(ROOT / "configs/model/tiny.yaml"))
    parser.add_argument("--variant", default=str(ROOT / "configs/variants/baseline.yaml"))
    parser.add_argument("--micro", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--seq-length", type=int, default=128)


def model_config(args: argparse.Namespace, tokenizer: Tokenizer, precision: str, *overrides: str):
    """The model of `add_model_arguments` at `precision`, dropout off: every backward of a micro-batch
    computes the same function."""
    return load_config([args.config, args.variant], [
        f"model.vocab_size={len(tokenizer.dictionary)}", f"train.precision={precision}",
        f"data.seq_length={args.seq_length}", "model.hidden_dropout=0", "model.attention_dropout=0", *overrides])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def engine_gradient(cfg, ctx, objective, batches, fp32_accumulation: bool) -> tuple[torch.Tensor, float, float]:
    """(the flat gradient AdamW receives, ms per micro-batch of forward + backward, ms of the fp32 sum's two
    operations over the gradient buffers) for one update over `batches`."""
    cfg.train.fp32_grad_accumulation = fp32_accumulation
    seed_everything(cfg.train.seed, ctx)
    engine, _, _ = build_engine(objective.build_model(ctx), cfg, ctx, 0)
    received = {}
    step = engine.optimizer.step

    def record_then_step():
        received["grad"] = engine.master.grad.double().clone()
        step()

    engine.optimizer.step = record_then_step
    start = time.perf_counter()
    for batch in batches:
        engine.backward(objective.loss(engine, batch).loss_sum.sum() / len(batch.targets))
        engine.step()
    micro_ms = (time.perf_counter() - start) / len(batches) * 1e3
    start = time.perf_counter()
    for _ in range(10):  # what fp32 accumulation adds to each micro-batch (the buffers' values do not matter now)
        engine.grads32.add_(engine.grads)
        engine.grads.zero_()
    return received["grad"], micro_ms, (time.perf_counter() - start) / 10 * 1e3


def twin_models(cfg, ctx, objective, dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the config's model with its parameters in `dtype`, as the engine holds them; an fp32 model with the
    same weights), in training mode; buffers keep their dtype."""
    seed_everything(cfg.train.seed, ctx)
    model, reference = objective.build_model(ctx).train(), objective.build_model(ctx).train()
    for p, wide_p in zip(model.parameters(), reference.parameters()):
        p.data = p.data.to(dtype)
        wide_p.data = p.data.float()
    return model, reference


def exact_sums(cfg, ctx, objective, batches, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 sum of each micro-batch's 16-bit gradient / k, the fp32 model's gradient / k), flat in
    the engine's parameter order (the model's, which the flat engine's offsets keep per kind)."""
    model, reference = twin_models(cfg, ctx, objective, dtype)
    exact = [torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()]
    wide = [torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()]
    scale = loss_scale(dtype)
    for batch in batches:
        for net, sums, factor in ((model, exact, scale), (reference, wide, 1.0)):
            net.zero_grad(set_to_none=True)
            (objective.loss(net, batch).loss_sum.sum() / len(batch.targets) / len(batches) * factor).backward()
            for total, p in zip(sums, net.parameters()):
                total += p.grad.double() / factor
    return exact, wide


def flat_order(engine_like, tensors, params) -> torch.Tensor:
    """Per-parameter tensors laid out as the flat engine's buffer (offsets, zeros between)."""
    flat = torch.zeros(engine_like.master.numel(), dtype=torch.float64)
    for tensor, p in zip(tensors, params):
        first = engine_like.offsets[id(p)]
        flat[first:first + p.numel()] = tensor.flatten()
    return flat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--accumulation", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    ctx = init_distributed(ParallelConfig())
    tokenizer = Tokenizer.gpt2()
    batches = wikitext_batches(tokenizer, max(args.accumulation), args.micro, args.seq_length)
    print(f"gradient accumulation, {Path(args.config).name} + {Path(args.variant).name}, micro-batch "
          f"{args.micro} x {args.seq_length}, CPU {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| dtype | micro-batches | 16-bit sum: error | fp32 sum: error | 16-bit backward (for scale) "
          "| ms / micro-batch | fp32 sum's add + zero, ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.dtypes:
        for k in args.accumulation:
            cfg = model_config(args, tokenizer, name, "train.engine=flat", f"train.micro_batch_size={args.micro}",
                               f"train.global_batch_size={args.micro * k}", "optim.clip_grad=0")
            objective = get_objective(cfg)
            chosen = batches[:k]
            summed16, micro_ms, _ = engine_gradient(cfg, ctx, objective, chosen, False)
            summed32, _, extra_ms = engine_gradient(cfg, ctx, objective, chosen, True)
            seed_everything(cfg.train.seed, ctx)
            layout, _, _ = build_engine(objective.build_model(ctx), cfg, ctx, 0)
            exact, wide = exact_sums(cfg, ctx, objective, chosen, DTYPES[name])
            params = list(layout.module.parameters())
            exact, wide = flat_order(layout, exact, params), flat_order(layout, wide, params)
            print(f"| {name} | {k} | {relative(summed16, exact):.2e} | {relative(summed32, exact):.2e} | "
                  f"{relative(exact, wide):.2e} | {micro_ms:.0f} | {extra_ms:.1f} |", flush=True)


if __name__ == "__main__":
    main()
