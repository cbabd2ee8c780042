#!/usr/bin/env python
"""Memory of an elastic resume: the checkpoint's files read whole vs memory-mapped and streamed.

    python benchmarks/elastic_memory.py                  # roberta.base, written at DP=2 ZeRO-1, resumed at DP=1
    python benchmarks/elastic_memory.py --model tiny     # seconds instead of minutes

A checkpoint written at one layout and resumed at another is resharded by megamlm.train.elastic:
every rank reads the optimizer state of every file it needs (fp32 master weights and AdamW's two
moments: 12 bytes per parameter). The script trains one update at DP=2 ZeRO-1 (torchrun, 2 gloo
ranks on the bundled WikiText-103 shards of `make demo`), then resumes it at DP=1 in a fresh process
per mode, in alternating order:

  whole     the previous implementation: each file read into memory (torch.load), every parameter's
            full tensors formed, then loaded
  streamed  megamlm's: the files memory-mapped (the page cache, which the ranks of a node share,
            holds them once), one parameter's full tensors formed at a time

"private" is the most anonymous memory (RssAnon, sampled every 2 ms) the load added to the process:
what each rank of a node pays on its own. "file" is the most file-backed memory it touched (RssFile):
pages of the page cache, one copy per node however many ranks read them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("whole", "streamed")


def memory() -> dict[str, int]:
    """RssAnon and RssFile of this process, in bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {key: int(fields[key].split()[0]) * 1024 for key in ("RssAnon", "RssFile")}


class PeakSampler(threading.Thread):
    """The most of each `memory()` field seen while it runs."""

    def __init__(self, interval: float = 0.002):
        super().__init__(daemon=True)
        self.interval, self.peak, self.done = interval, memory(), threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = {k: max(v, self.peak[k]) for k, v in memory().items()}
            time.sleep(self.interval)

    def __enter__(self) -> PeakSampler:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.join()
        self.peak = {k: max(v, self.peak[k]) for k, v in memory().items()}


def settings(run_dir: Path, model: str) -> tuple[Path, list[str]]:
    """The run's config file and overrides: the demo's data, `model`, one update saved."""
    config = run_dir.parent / "config.yaml"
    config.write_text(f"include: [{ROOT / 'configs/demo.yaml'}, {ROOT / 'configs/model' / model}.yaml]\n")
    return config, [f"train.run_dir={run_dir}", "train.steps=1", "train.save_interval=1", "train.eval_batches=1",
                    "train.micro_batch_size=2", "train.global_batch_size=4", "train.zero_stage=1"]


def write_checkpoint(run_dir: Path, model: str) -> None:
    config, overrides = settings(run_dir, model)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "megamlm", "train", "--config", str(config), *overrides]
    print(f"writing the checkpoint (DP=2 ZeRO-1, {model}): {' '.join(command[2:])}", flush=True)
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def resume(run_dir: Path, model: str, mode: str) -> dict:
    """In this process: build the DP=1 engine, load the newest checkpoint resharded, measure."""
    import torch

    import megamlm.train.checkpoint as checkpoint_module
    from megamlm.config import load_config
    from megamlm.objectives import get_objective
    from megamlm.parallel import init_distributed
    from megamlm.train import elastic
    from megamlm.train.engine import build_engine

    if mode == "whole":  # the implementation before memory-mapping (megamlm before 2026-11-25)
        elastic._load = lambda path: torch.load(path, map_location="cpu", weights_only=False)
        streamed = checkpoint_module.read_full_state

        def read_whole(*args):
            state = streamed(*args)
            tensors = {(name, kind): state.full(name, kind) for name in state.names for kind in elastic.KINDS}
            state.full = lambda name, kind: tensors[name, kind]
            return state

        checkpoint_module.read_full_state = read_whole
    config, overrides = settings(run_dir, model)
    cfg = load_config(config, overrides)
    ctx = init_distributed(cfg.parallel)
    checkpoints = checkpoint_module.Checkpoints(run_dir, cfg.train.keep_last)
    tag = (checkpoints.root / "latest").read_text().strip()
    engine, _, schedule = build_engine(get_objective(cfg).build_model(ctx), cfg, ctx,
                                       checkpoints.resume_stage(tag, cfg, ctx.dp_size))
    before = memory()
    start = time.perf_counter()
    with PeakSampler() as sampler:
        state = checkpoints.load(engine, schedule, tag, cfg, ctx)
    seconds = time.perf_counter() - start
    assert state.resharded, "the checkpoint was not resharded: nothing measured"
    files = sum(f.stat().st_size for f in (checkpoints.root / tag).iterdir())
    moments = 2 * 4 * sum(p.numel() for p in engine.module.parameters())  # DP=1: all of them, on this rank
    return {"mode": mode, "seconds": seconds, "moments": moments, "checkpoint": files, "resharded": state.resharded,
            "private": sampler.peak["RssAnon"] - before["RssAnon"], "file": sampler.peak["RssFile"] - before["RssFile"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="base", help="configs/model/<name>.yaml (default: base)")
    parser.add_argument("--rounds", type=int, default=2, help="resumes per mode, alternating (default 2)")
    parser.add_argument("--resume-one", nargs=2, metavar=("RUN_DIR", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.resume_one:  # the child process of one measurement
        print(json.dumps(resume(Path(args.resume_one[0]), args.model, args.resume_one[1])))
        return
    with tempfile.TemporaryDirectory(prefix="elastic-memory-") as tmp:
        run_dir = Path(tmp) / "run"
        write_checkpoint(run_dir, args.model)
        results: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                command = [sys.executable, __file__, "--model", args.model, "--resume-one", str(run_dir), mode]
                out = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True,
                                     env={**os.environ, "PYTHONWARNINGS": "ignore"}).stdout
                results[mode].append(json.loads(out.strip().splitlines()[-1]))
    first = results[MODES[0]][0]
    print(f"\n{args.model}: checkpoint {first['checkpoint'] / 2**20:,.0f} MiB, resumed {first['resharded']}; "
          f"median of {args.rounds}; both include the engine's AdamW moments, which torch creates during the load "
          f"({first['moments'] / 2**20:,.0f} MiB)\n")
    print("| mode | load s | private MiB (each rank) | file MiB (page cache, per node) |")
    print("|---|---:|---:|---:|")
    for mode, runs in results.items():
        seconds, private, file = (statistics.median(r[k] for r in runs) for k in ("seconds", "private", "file"))
        print(f"| {mode} | {seconds:.2f} | {private / 2**20:,.0f} | {file / 2**20:,.0f} |")


if __name__ == "__main__":
    main()
