#!/usr/bin/env python
"""The trainer's share of the data: how long its next() calls take to get an update's micro-batches from
data.loader_workers processes while it is busy between updates (queueing a GPU's kernels), side by side in
one run:

- **workers → trainer**: the trainer's own next() receives each batch's tensors from a worker (a socket
  round trip per storage to the worker's resource-sharer thread, which waits for that worker's GIL);
- **workers → thread → trainer**: a thread of the trainer's process receives them and the trainer takes
  them from a queue. On a GPU that thread is torch's pin-memory thread (`make_loader(pin_memory=True)`, what
  the training loop runs there since session 63), which also pins them; on a CPU, where pinning needs a GPU,
  a thread that does the same handover without the pinning.

    python benchmarks/loader_handover.py [--workers 4] [--accumulation 2] [--busy-ms 156] [--updates 30]

gpu.sh's data (WikiText-103 valid+test, 2048, long documents split) in its best row's layout: packed,
micro-batch 16, one row of 32,768 tokens, 2 per update; 4 workers as the Pile recipe's. As the loop does,
the trainer takes an update's micro-batches one after another, then is busy for --busy-ms (lease 8's best
row: 161.5 ms per update, ~5.4 of them in next()). The table's times are per update, what the loop logs as
"data wait".
"""

from __future__ import annotations

import argparse
import queue
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from data_throughput import CORPUS, ROOT  # benchmarks/ is the script's folder: on sys.path

from megamlm.config import load_config
from megamlm.data.loader import make_loader
from megamlm.data.shards import BuildOptions, build_shards
from megamlm.data.stream import MaskedBatches, ShardSet
from megamlm.data.tokenizer import Tokenizer
from megamlm.objectives import get_objective

class Handover:
    """A thread that takes the loader's first `count` batches over into a queue, as torch's pin-memory thread
    does (then it ends, and with it the loader and its workers)."""

    def __init__(self, batches: Iterator, depth: int, count: int):
        self.queue: queue.Queue = queue.Queue(depth)
        threading.Thread(target=self._take, args=(batches, count), daemon=True).start()

    def _take(self, batches: Iterator, count: int) -> None:
        for _ in range(count):
            self.queue.put(next(batches))

    def __next__(self):
        return self.queue.get()


WARM_UP = 8
"""next() calls before the timed ones: the workers start and fill their queues."""


def update_times(batches: Iterator, updates: int, accumulation: int, busy_s: float) -> list[float]:
    """The trainer's seconds in next() per update, for `updates` updates of `accumulation` micro-batches
    `busy_s` apart, after WARM_UP calls."""
    for _ in range(WARM_UP):
        next(batches)
    times = []
    for _ in range(updates):
        time.sleep(busy_s)
        start = time.perf_counter()
        for _ in range(accumulation):
            next(batches)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per update")
    parser.add_argument("--busy-ms", type=float, default=156.0, help="the trainer's time per update beside next()")
    parser.add_argument("--updates", type=int, default=30, help="timed updates per way and round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the two ways")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--shards", type=Path, help="built shards to read (default: build gpu.sh's into a temp folder)")
    args = parser.parse_args()
    tokenizer = Tokenizer.gpt2()
    cfg = load_config([ROOT / "configs/pile/base-zero-clap.yaml"], [f"data.seq_length={args.seq_length}"])
    gpu = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="megamlm-handover-") as work:
        shards = args.shards or Path(work) / "shards"
        if args.shards is None:
            build_shards(BuildOptions([str(p) for p in CORPUS], str(shards), seq_length=args.seq_length,
                                      long_docs="split", valid_fraction=0.0), tokenizer, progress=False)

        def batches(threaded: bool) -> Iterator:
            stream = MaskedBatches(ShardSet(shards), get_objective(cfg).corruption(tokenizer, 1),
                                   seq_length=args.seq_length, micro_batch=args.micro_batch, packing="packed",
                                   pad_multiple=args.seq_length)
            loader = iter(make_loader(stream, args.workers, pin_memory=threaded and gpu))
            count = WARM_UP + args.updates * args.accumulation
            return Handover(loader, 4 * args.workers, count) if threaded and not gpu else loader

        ways = {"workers -> trainer": False,
                f"workers -> {'pin-memory' if gpu else 'handover'} thread -> trainer": True}
        times: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(args.rounds):
            for way, threaded in ways.items():
                times[way] += update_times(batches(threaded), args.updates, args.accumulation, args.busy_ms / 1e3)
    print(f"the trainer's next() per update: {args.workers} loader workers, {args.accumulation} packed micro-batches "
          f"of {args.micro_batch} x {args.seq_length} tokens per update, {args.busy_ms:g} ms busy per update, "
          f"{args.rounds} interleaved rounds x {args.updates} updates, {'CUDA' if gpu else 'CPU'}")
    print(f"{'way':<44}{'median ms':>10}{'mean ms':>10}{'p90 ms':>10}{'max ms':>10}")
    for way, seconds in times.items():
        ms = sorted(1e3 * s for s in seconds)
        print(f"{way:<44}{statistics.median(ms):>10.2f}{statistics.mean(ms):>10.2f}"
              f"{ms[int(0.9 * len(ms))]:>10.2f}{ms[-1]:>10.2f}")


if __name__ == "__main__":
    main()
