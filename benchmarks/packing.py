#!/usr/bin/env python
"""Padded vs packed micro-batches, side by side in one run (CPU, tiny model): fill ratio, real
(non-padding) tokens/s and useful MFU of a training step (forward, backward, AdamW).

    python benchmarks/packing.py [--steps 8] [--rounds 2]

Corpora:
  wikitext-512   WikiText-103 valid+test at 512, long documents split (as the main job)
  pile-like-2048 a Pile-like length distribution at 2048: lognormal document lengths with median
                 1,024 tokens and 1/7 longer than 2,048 (sigma = ln 2 / 1.0676 = 0.649), documents
                 longer than a sample dropped and the rest in fairseq `complete` samples (the
                 reference's recipe); each document is random single-token words (3,000 documents)
Both layouts get the same token slots per micro-batch: padded = `micro` rows of `seq_length`,
packed = one row of micro x seq_length tokens. Useful MFU counts only real tokens (the objective's
FLOPs per token x real tokens/s / the CPU's matmul peak measured in the same run).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from megamlm.config import load_config
from megamlm.data.shards import BuildOptions, build_shards
from megamlm.data.stream import MaskedBatches, ShardSet
from megamlm.data.tokenizer import Tokenizer
from megamlm.objectives import get_objective
from megamlm.parallel import init_distributed, seed_everything
from megamlm.train.flops import measured_matmul_peak

ROOT = Path(__file__).resolve().parents[1]
WORDS = [" the", " of", " and", " to", " in", " a", " is", " that", " for", " it", " was", " on"]


def pile_like_corpus(path: Path, documents: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    lengths = np.round(rng.lognormal(np.log(1024), np.log(2) / 1.0676, documents)).astype(int)
    with open(path, "w") as f:
        for n in lengths:
            f.write("".join(rng.choice(WORDS, max(1, n))).strip() + "\n")


def measure(cfg, shards: Path, packing: str, steps: int, tokenizer: Tokenizer) -> tuple[float, float]:
    """(real tokens/s, fill) over `steps` micro-batches after one warm-up step."""
    ctx = init_distributed(cfg.parallel)
    seed_everything(1, ctx)
    objective = get_objective(cfg)
    model = objective.build_model(ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    stream = MaskedBatches(ShardSet(shards), objective.corruption(tokenizer, 1),
                           seq_length=cfg.data.seq_length, micro_batch=cfg.train.micro_batch_size,
                           block_mode="complete", shuffle_window=1000, pad_multiple=cfg.data.seq_length,
                           packing=packing)
    real = slots = 0
    start = time.perf_counter()
    for i, batch in enumerate(stream):
        if i == 1:
            real, slots, start = 0, 0, time.perf_counter()
        out = objective.loss(model, batch)
        out.mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        real, slots = real + batch.real_tokens(), slots + batch.inputs.numel()
        if i == steps:
            break
    return real / (time.perf_counter() - start), real / slots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="timed micro-batches per layout and round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (padded, packed, ...)")
    args = parser.parse_args()
    tokenizer = Tokenizer.gpt2()
    with tempfile.TemporaryDirectory(prefix="megamlm-packing-") as work:  # the shards go with it, also on Ctrl-C
        compare(args, tokenizer, Path(work))


def compare(args: argparse.Namespace, tokenizer: Tokenizer, work: Path) -> None:
    pile = work / "pile-like.txt"
    pile_like_corpus(pile, 3000)
    corpora = {
        "wikitext-512": ([ROOT / "data/wikitext-103/valid.txt", ROOT / "data/wikitext-103/test.txt"], 512, 8,
                         "split", "paragraphs"),
        "pile-like-2048": ([pile], 2048, 4, "drop", "lines"),
    }
    print(f"tiny baseline, CPU {torch.get_num_threads()} threads, {args.rounds} interleaved rounds x "
          f"{args.steps} micro-batches per layout")
    print(f"{'corpus':<16}{'layout':<8}{'fill':>7}{'real tok/s':>12}{'useful MFU':>12}   per round")
    for name, (inputs, length, micro, long_docs, text_mode) in corpora.items():
        shards = work / name
        build_shards(BuildOptions([str(p) for p in inputs], str(shards), seq_length=length, long_docs=long_docs,
                                  text_mode=text_mode, valid_fraction=0.0), tokenizer, progress=False)
        cfg = load_config([ROOT / "configs/model/tiny.yaml", ROOT / "configs/variants/baseline.yaml"],
                          [f"data.seq_length={length}", f"model.max_positions={length}",
                           f"train.micro_batch_size={micro}"])
        flops = get_objective(cfg).flops_per_token(length)
        rates: dict[str, list[float]] = {"padded": [], "packed": []}
        fills, peaks = {}, []
        for _ in range(args.rounds):
            peaks.append(measured_matmul_peak())
            for layout in rates:
                rate, fills[layout] = measure(cfg, shards, layout, args.steps, tokenizer)
                rates[layout].append(rate)
        peak = statistics.median(peaks)
        for layout, values in rates.items():
            rate = statistics.median(values)
            print(f"{name:<16}{layout:<8}{100 * fills[layout]:>6.1f}%{rate:>12,.0f}{100 * flops * rate / peak:>11.1f}%"
                  f"   {', '.join(f'{v:,.0f}' for v in values)}")
        gain = statistics.median(rates["packed"]) / statistics.median(rates["padded"])
        print(f"{name:<16}packed / padded real tokens/s: {gain:.2f}x (1 / padded fill = {1 / fills['padded']:.2f}x)")


if __name__ == "__main__":
    main()
