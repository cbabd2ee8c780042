#!/usr/bin/env python
"""The main job's update, a revision against the working tree, side by side: each round runs `megamlm train`
on both, interleaved (a machine's drift hits both), and reads the loop's own profile (train.profile_updates:
the time per update after the warm-up, and the host's time in each phase), the command's start (from its launch
to the loop's "start" event: imports, model, engine, data) and the last update's loss, which a change that keeps
the numbers leaves the same to the last digit.

    python benchmarks/main_job_ab.py                            # the uncommitted change against HEAD
    python benchmarks/main_job_ab.py --base 0013e62 --rounds 5 --updates 48
    python benchmarks/main_job_ab.py --config configs/demo.yaml --set train.micro_batch_size=8

The revision runs from a git worktree of it (its megamlm; this tree's configs and data: the same job, whose
shards both read from this tree's cache/), removed at the end. Exit status 1 if the two losses differ.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megamlm.train.profiling import WARM_UP  # updates before the profile starts recording

ROOT = Path(__file__).resolve().parent.parent


def train(tree: Path, args: argparse.Namespace, run_dir: Path) -> dict:
    """One profiled run of the job with `tree`'s megamlm: {"ms": per update, "phases": {phase: host ms},
    "start_s": from the launch to the loop's start, "loss": the last update's}."""
    steps = args.updates + WARM_UP
    # the tree's tools/train.py, not `python -m megamlm`: -m puts the working directory (this tree, whose
    # relative data paths the job reads) first on sys.path, and every run would import this tree's megamlm
    command = [sys.executable, str(tree / "tools/train.py"), "--config", args.config, *args.set,
               f"train.run_dir={run_dir}", f"train.steps={steps}", f"train.profile_updates={args.updates}",
               f"train.log_interval={steps}", f"train.eval_interval={steps + 1}", f"train.save_interval={steps + 1}"]
    launched = time.time()  # the clock of the log's event times
    done = subprocess.run(command, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(tree)), capture_output=True,
                          text=True)
    if done.returncode:
        sys.exit(f"main_job_ab: `megamlm train` of {tree} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    events = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    profile = next(e for e in events if e["event"] == "profile")
    loss = [e["loss"] for e in events if e["event"] == "train"][-1]
    start = next(e for e in events if e["event"] == "start")["time"] - launched
    return {"ms": profile["update_s"] * 1e3, "phases": profile["host_ms"], "start_s": start, "loss": loss}


def imported_from(tree: Path) -> Path:
    """Where `train`'s runs of `tree` import megamlm from (sys.path as a script in tree/tools gets it)."""
    where = subprocess.run([sys.executable, "-c", "import megamlm; print(megamlm.__file__)"], cwd=tree / "tools",
                           env=dict(os.environ, PYTHONPATH=str(tree)), capture_output=True, text=True, check=True)
    return Path(where.stdout.strip()).parent


def describe(revision: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short", revision], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD", help="the revision the working tree is compared with")
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for both runs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--updates", type=int, default=24, help="profiled updates per run (after the warm-up)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="main_job_ab-") as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(base_tree), args.base], cwd=ROOT,
                       check=True)
        try:
            trees = {"base": base_tree, "tree": ROOT}
            for name, tree in trees.items():
                if (found := imported_from(tree)) != tree / "megamlm":
                    sys.exit(f"main_job_ab: the {name} runs would import {found}, not {tree}/megamlm")
            runs = {name: [] for name in trees}
            for round_ in range(args.rounds):
                for name, tree in trees.items():
                    runs[name].append(train(tree, args, Path(tmp) / f"{name}-{round_}"))
                    print(f"round {round_ + 1}/{args.rounds}: {name} {runs[name][-1]['ms']:.1f} ms per update",
                          file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=False)

    phases = list(runs["base"][0]["phases"])
    print(f"{' '.join([args.config, *args.set])}: base {describe(args.base)} against the working tree "
          f"({describe('HEAD')} + its changes), {args.updates} profiled updates, {args.rounds} interleaved rounds")
    print("| round | run | start s | ms per update | " + " | ".join(f"{p} (host ms)" for p in phases)
          + " | last loss |")
    print("|---|---|---:|---:|" + "---:|" * len(phases) + "---|")
    for round_ in range(args.rounds):
        for name in trees:
            r = runs[name][round_]
            print(f"| {round_ + 1} | {name} | {r['start_s']:.1f} | {r['ms']:.1f} | "
                  + " | ".join(f"{r['phases'][p]:.1f}" for p in phases) + f" | {r['loss']!r} |")
    print(f"median start: base {statistics.median(r['start_s'] for r in runs['base']):.1f} s, tree "
          f"{statistics.median(r['start_s'] for r in runs['tree']):.1f} s")
    ratios = [t["ms"] / b["ms"] for t, b in zip(runs["tree"], runs["base"])]
    same = all(t["loss"] == b["loss"] for t, b in zip(runs["tree"], runs["base"]))
    print(f"median ms per update: base {statistics.median(r['ms'] for r in runs['base']):.1f}, tree "
          f"{statistics.median(r['ms'] for r in runs['tree']):.1f}; tree / base per round: median "
          f"{statistics.median(ratios):.3f} (rounds {', '.join(f'{x:.3f}' for x in ratios)}); last losses "
          + ("the same to the last digit" if same else "DIFFER"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
