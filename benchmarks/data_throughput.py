#!/usr/bin/env python
"""Data pipeline throughput next to what a training step consumes, measured in one run.

    python benchmarks/data_throughput.py [--seq-length 512] [--micro-batch 8]

Rows: shard building (tokenize + write) per tokenizer worker count; reading + packing + masking per
loader worker count; and the tokens/s a tiny-model training step (forward, backward, AdamW) consumes
at the same sample length. The ratio column is data rate / training rate.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from megamlm.config import load_config
from megamlm.data.masking import Masker
from megamlm.data.shards import BuildOptions, build_shards
from megamlm.data.loader import make_loader
from megamlm.data.stream import MaskedBatches, ShardSet
from megamlm.data.tokenizer import Tokenizer
from megamlm.objectives import MaskedLM
from megamlm.parallel import init_distributed, seed_everything

ROOT = Path(__file__).resolve().parents[1]
CORPUS = [ROOT / "data/wikitext-103/valid.txt", ROOT / "data/wikitext-103/test.txt"]


def build_rate(workdir: Path, tokenizer: Tokenizer, seq_length: int, workers: int) -> float:
    out = workdir / f"build-{workers}"
    start = time.perf_counter()
    manifest = build_shards(BuildOptions([str(p) for p in CORPUS], str(out), seq_length=seq_length,
                                         long_docs="split", shard_tokens=100_000, workers=workers),
                            tokenizer, progress=False)
    return manifest["splits"]["train"]["tokens"] / (time.perf_counter() - start)


def read_rate(folder: Path, tokenizer: Tokenizer, seq_length: int, micro_batch: int, workers: int) -> float:
    masker = Masker(tokenizer.dictionary.mask_id, tokenizer.dictionary.ordinary_ids())
    stream = MaskedBatches(ShardSet(folder), masker, seq_length=seq_length, micro_batch=micro_batch,
                           epochs=1)
    tokens, start = 0, time.perf_counter()
    for batch in make_loader(stream, workers=workers):
        tokens += batch.real_tokens()
    return tokens / (time.perf_counter() - start)


def train_rate(seq_length: int, micro_batch: int, steps: int = 5) -> float:
    cfg = load_config([ROOT / "configs/demo.yaml"], [f"data.seq_length={seq_length}"])
    ctx = init_distributed(cfg.parallel)
    seed_everything(1, ctx)
    model = MaskedLM(cfg.model, ctx)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(4, 50000, (micro_batch, seq_length))
    masked = torch.rand(tokens.shape) < 0.15
    for step in range(steps + 1):
        if step == 1:  # the first step warms up allocators
            start = time.perf_counter()
        loss = model.loss(model(tokens, masked), tokens[masked])
        optim.zero_grad()
        loss.backward()
        optim.step()
    return micro_batch * seq_length * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=8)
    args = parser.parse_args()
    tokenizer = Tokenizer.gpt2()
    workdir = Path(tempfile.mkdtemp(prefix="megamlm-bench-"))
    try:
        consume = train_rate(args.seq_length, args.micro_batch)
        rows = [(f"build shards, {w} tokenizer worker(s)", build_rate(workdir, tokenizer, args.seq_length, w))
                for w in (1, 2)]
        rows += [(f"read + pack + mask, {w} loader worker(s)",
                  read_rate(workdir / "build-1", tokenizer, args.seq_length, args.micro_batch, w))
                 for w in (0, 1, 2)]
        rows.append((f"tiny model train step (b={args.micro_batch}, s={args.seq_length})", consume))
    finally:
        shutil.rmtree(workdir)
    print(f"{'stage':<48}{'tokens/s':>12}{'x training':>12}")
    for name, rate in rows:
        print(f"{name:<48}{rate:>12,.0f}{rate / consume:>12.1f}")


if __name__ == "__main__":
    main()
