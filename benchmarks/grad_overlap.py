#!/usr/bin/env python
"""The flat engine's gradient reduction over DP after the backward vs overlapped with it
(`train.overlap_grad_reduce`), and (bf16 / fp16) in fp32 vs in the 16-bit buffer itself
(`train.grad_reduce_in_fp32=false`), on two ranks.

    python benchmarks/grad_overlap.py                        # roberta.base, 2 CPU ranks (gloo), fp32
    python benchmarks/grad_overlap.py --dtype bf16           # + the 16-bit reduction's row
    python benchmarks/grad_overlap.py --config configs/model/tiny.yaml --updates 3

The script starts itself on two ranks (torch.distributed.run). Each update is one micro-batch per rank
(no accumulation: every update reduces its gradients over DP, as a run whose global batch is micro ×
DP). Rows alternate between the settings, each built anew from the same seed, and time every
update after the first: the forward, the backward (overlapped: the reduce-scatters it starts run behind
it), the engine's step (the reduction's wait, or the whole reduction, then the norm, AdamW and the
all-gather) and the update. Times are rank 0's medians; "reduce-scatters" is how many collectives
each update's reduction took.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {  # row: overrides
    "after the backward (one collective)": [],
    "overlapped with the backward (`train.overlap_grad_reduce=true`)": ["train.overlap_grad_reduce=true"],
    "after the backward, in 16 bits (`train.grad_reduce_in_fp32=false`)": ["train.grad_reduce_in_fp32=false"],
}


def run_rank(args: argparse.Namespace) -> None:
    import torch

    from megamlm.config import ParallelConfig, load_config
    from megamlm.data.batch import collate
    from megamlm.data.masking import Masker
    from megamlm.data.tokenizer import PAD, Tokenizer
    from megamlm.evaluate import samples, token_stream
    from megamlm.objectives import get_objective
    from megamlm.parallel import init_distributed, seed_everything
    from megamlm.train.engine import build_engine

    torch.set_num_threads(args.threads)
    ctx = init_distributed(ParallelConfig())
    tokenizer = Tokenizer.gpt2()
    rows = samples(token_stream(ROOT / "data/wikitext-103/valid.txt", tokenizer,
                                2 * (args.updates + 1) * args.micro * args.seq_length), args.seq_length)
    masker = Masker(tokenizer.dictionary.mask_id, tokenizer.dictionary.ordinary_ids(), seed=1)
    mine = rows[ctx.dp_rank::2]  # each rank its own sequences
    batches = [collate([(row, i * args.micro + j) for j, row in enumerate(mine[i * args.micro:(i + 1) * args.micro])],
                       masker, 0, args.seq_length, PAD) for i in range(args.updates + 1)]
    settings = list(SETTINGS)[:2 if args.dtype == "fp32" else 3]
    times: dict[str, dict[str, list[float]]] = {setting: {} for setting in settings}
    collectives = {}
    for round_ in range(args.rounds):
        for setting in (settings if round_ % 2 == 0 else settings[::-1]):
            cfg = load_config([args.config, ROOT / "configs/variants/baseline.yaml"], [
                f"model.vocab_size={len(tokenizer.dictionary)}", "train.engine=flat",
                f"train.precision={args.dtype}", f"train.micro_batch_size={args.micro}",
                f"train.global_batch_size={2 * args.micro}", f"data.seq_length={args.seq_length}",
                f"train.grad_bucket_size={args.bucket}", *SETTINGS[setting]])
            objective = get_objective(cfg)
            seed_everything(cfg.train.seed, ctx)
            engine, _, _ = build_engine(objective.build_model(ctx), cfg, ctx, 0)
            collectives[setting] = len(engine.buckets)
            for update, batch in enumerate(batches):
                start = time.perf_counter()
                loss = objective.loss(engine, batch).loss_sum.sum() / len(batch.targets)
                forward = time.perf_counter()
                engine.backward(loss)
                backward = time.perf_counter()
                engine.step()
                end = time.perf_counter()
                if update:  # the first update builds what the later ones reuse
                    for key, seconds in (("forward", forward - start), ("backward", backward - forward),
                                         ("step", end - backward), ("update", end - start)):
                        times[setting].setdefault(key, []).append(seconds * 1000)
            del engine
    if ctx.dp_rank == 0:
        print(f"gradient reduction over DP=2, {Path(args.config).name}, {args.dtype}, micro-batch {args.micro} x "
              f"{args.seq_length}, buckets of {args.bucket:,} elements, {args.threads} thread(s) per rank, "
              f"{args.rounds} x {args.updates} updates, torch {torch.__version__}")
        print("| reduction | reduce-scatters | forward ms | backward ms | step ms | update ms |")
        print("|---|---:|---:|---:|---:|---:|")
        for setting in settings:
            median = {key: statistics.median(values) for key, values in times[setting].items()}
            print(f"| {setting} | {collectives[setting]} "
                  f"| {median['forward']:.0f} | {median['backward']:.0f} | {median['step']:.0f} "
                  f"| {median['update']:.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/model/base.yaml"))
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--micro", type=int, default=2, help="sequences per micro-batch and rank")
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--bucket", type=int, default=40_000_000, help="train.grad_bucket_size")
    parser.add_argument("--updates", type=int, default=4, help="timed updates per row")
    parser.add_argument("--rounds", type=int, default=2, help="rows per setting, in alternating order")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ:
        run_rank(args)
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               __file__, *sys.argv[1:]]
    sys.exit(subprocess.run(command, env=env).returncode)


if __name__ == "__main__":
    main()
