"""Length extrapolation of every positional encoding at equal pretraining compute (issue 19), on CPU.

    python benchmarks/extrapolation.py [--seeds 1,2] [--out runs/extrapolation]

Each encoding pretrains the main job's model (configs/demo.yaml: tiny, post-LN, samples of <= 128
tokens, 16 per update) changed only in its position knobs, for the model FLOPs of the main job's 400
updates (updates = 400 × the learned baseline's FLOPs per token / the encoding's: RoPE + local/global
attends fewer keys, so it gets a few more updates), once per seed. Then `megamlm eval extrapolation`'s
measurement scores each at 1×, 2×, 4× and 8× the training length on the held-out valid split (the
same tokens cut into samples of each length, 15% masked with a fixed seed, so every cell scores the
same targets). Per encoding: perplexity = exp(mean over seeds of the MLM loss), ± half the range of the
seeds' perplexities. Finished runs are kept and skipped on a rerun; the table is printed last and
written with the plot (ppl-vs-length.png) and the per-seed numbers (runs.json) to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megamlm.config import load_config  # noqa: E402
from megamlm.evaluate import evaluate_lengths, extrapolation_report  # noqa: E402
from megamlm.objectives import get_objective  # noqa: E402

MAIN_JOB_UPDATES = 400
TRAIN_LENGTH = 128
ENCODINGS = {  # name -> (config fragments after configs/demo.yaml, overrides)
    "learned": ([], []),
    "sinusoidal": (["configs/variants/sinusoidal.yaml"], []),
    "alibi-symmetric": (["configs/variants/alibi.yaml"], ["model.alibi_mode=symmetric"]),
    "alibi-offset": (["configs/variants/alibi.yaml"], []),
    "rope": ([], ["model.position=rope"]),
    # layers 0 and 3 global, 1 and 2 a 32-token window (16 keys each side; ModernBERT: 128 of 1,024)
    "rope-local-global": ([], ["model.position=rope", "model.local_window=32", "model.global_every=3"]),
}


def flops_per_token(fragments: list[str], overrides: list[str]) -> float:
    cfg = load_config([ROOT / "configs/demo.yaml", *(ROOT / f for f in fragments)], overrides)
    return get_objective(cfg).flops_per_token(cfg.data.seq_length)


def train(run_dir: Path, fragments: list[str], overrides: list[str], updates: int, seed: int) -> None:
    if (run_dir / "final/config.yaml").is_file():
        return
    configs = [arg for f in ["configs/demo.yaml", *fragments] for arg in ("--config", f)]
    command = [sys.executable, "-m", "megamlm", "train", *configs, *overrides, f"train.run_dir={run_dir}",
               f"train.steps={updates}", f"train.seed={seed}", "--overwrite"]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


def combine(per_seed: list[list[dict]]) -> list[dict]:
    """Rows of several seeds -> one row per length: ppl = exp(mean loss), spread = half the ppl range."""
    rows = []
    for cells in zip(*per_seed):
        if "skipped" in cells[0]:
            rows.append(cells[0])
            continue
        ppls = [c["ppl"] for c in cells]
        rows.append({"length": cells[0]["length"], "ppl": math.exp(sum(c["loss"] for c in cells) / len(cells)),
                     "spread": (max(ppls) - min(ppls)) / 2, "seeds": ppls})
    return rows


def markdown(results: dict, budget: dict, lengths: list[int]) -> str:
    lines = ["| encoding | updates | PFLOPs | " + " | ".join(f"{n} ({n // TRAIN_LENGTH}×)" for n in lengths) + " |",
             "|---|---:|---:|" + "---:|" * len(lengths)]
    for name, rows in results.items():
        by_length = {r["length"]: r for r in rows}
        cells = [f"{r['ppl']:.1f} ± {r['spread']:.1f}" if "ppl" in r else f"n/a ({r['skipped']})"
                 for r in (by_length[n] for n in lengths)]
        spent = budget[name]
        lines.append(f"| {name} | {spent['updates']} | {spent['pflops']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/extrapolation")
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--only", default=",".join(ENCODINGS), help="comma-separated encodings")
    parser.add_argument("--lengths", default="128,256,512,1024")
    parser.add_argument("--max-tokens", type=int, default=21000)
    args = parser.parse_args()
    out, seeds = ROOT / args.out, [int(s) for s in args.seeds.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    reference = flops_per_token(*ENCODINGS["learned"])
    start = time.perf_counter()
    results, budget, runs = {}, {}, {}
    for name in args.only.split(","):
        fragments, overrides = ENCODINGS[name]
        per_token = flops_per_token(fragments, overrides)
        updates = round(MAIN_JOB_UPDATES * reference / per_token)
        budget[name] = {"updates": updates, "pflops": per_token * 16 * TRAIN_LENGTH * updates / 1e15}
        runs[name] = []
        for seed in seeds:
            run_dir = out / f"{name}-seed{seed}"
            train(run_dir, fragments, overrides, updates, seed)
            cfg = load_config([run_dir / "final/config.yaml"])
            runs[name].append(evaluate_lengths(run_dir / "final", cfg.data.shards, lengths, args.max_tokens))
        results[name] = combine(runs[name])
    (out / "runs.json").write_text(json.dumps({"budget": budget, "runs": runs}, indent=1))
    extrapolation_report(results, out, TRAIN_LENGTH)  # results.json and the plot (the mean curves)
    table = markdown(results, budget, lengths)
    (out / "results.md").write_text(table)
    print(table + f"\nwall time {(time.perf_counter() - start) / 60:.1f} min (runs already finished are reused)")


if __name__ == "__main__":
    main()
