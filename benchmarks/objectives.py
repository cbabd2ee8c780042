"""Pretraining objectives compared at equal compute (issue 17), on CPU, then fine-tuned on GLUE.

    python benchmarks/objectives.py [--glue-dir ../shared/data/glue] [--out runs/objectives]

Each objective pretrains the main job's model (configs/demo.yaml: tiny, length 128, 16 sequences per
update) for the same model FLOPs as the main job's 400 MLM-15% updates: updates = 400 × (MLM-15%'s
FLOPs per token / the objective's), FLOPs per token as training counts them for MFU (ELECTRA counts its
generator and both heads). Then `megamlm glue` fine-tunes each (discriminator for ELECTRA) on SST-2,
MRPC, RTE and STS-B with the recorded demo GLUE settings (3 epochs, lr 1e-4, the recipe's batch sizes)
for 2 seeds, every task's training set subsampled to --max-train-samples rows (the whole study fits
~90 minutes on 2 cores). Finished runs are kept and skipped on a rerun; the table is printed last and
written to <out>/results.md and results.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megamlm.config import load_config  # noqa: E402
from megamlm.objectives import get_objective  # noqa: E402

MAIN_JOB_UPDATES = 400
OBJECTIVES = {  # name -> config fragments after configs/demo.yaml
    "mlm-15": [],
    "mlm-30": ["configs/objectives/mlm-30.yaml"],
    "whole-word": ["configs/objectives/wwm.yaml"],
    "span": ["configs/objectives/span.yaml"],
    "electra": ["configs/objectives/electra.yaml"],
}
TASKS = ["SST-2", "MRPC", "RTE", "STS-B"]


def flops_per_token(fragments: list[str]) -> float:
    cfg = load_config([ROOT / "configs/demo.yaml", *(ROOT / f for f in fragments)])
    return get_objective(cfg).flops_per_token(cfg.data.seq_length)


def run(command: list[str]) -> float:
    """Run a command (output shown), return its wall time in seconds."""
    print("+", " ".join(command), flush=True)
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True)
    return time.perf_counter() - start


def last_event(run_dir: Path, event: str) -> dict:
    events = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return [e for e in events if e["event"] == event][-1]


def glue_finished(glue_out: Path) -> bool:
    """A GLUE run whose report has every task's results (a failed one, e.g. without data, is redone)."""
    report = glue_out / "results.json"
    return report.is_file() and all("summary" in json.loads(report.read_text())["tasks"].get(task, {})
                                    for task in TASKS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--glue-dir", default=str(ROOT.parent / "shared/data/glue"))
    parser.add_argument("--out", default="runs/objectives")
    parser.add_argument("--max-train-samples", type=int, default=2000)
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--only", default=",".join(OBJECTIVES), help="comma-separated objectives")
    parser.add_argument("--skip-glue", action="store_true", help="pretraining only")
    args = parser.parse_args()
    out = ROOT / args.out
    megamlm = [sys.executable, "-m", "megamlm"]
    reference = flops_per_token(OBJECTIVES["mlm-15"])
    rows = {}
    for name in args.only.split(","):
        fragments = OBJECTIVES[name]
        per_token = flops_per_token(fragments)
        updates = round(MAIN_JOB_UPDATES * reference / per_token)
        run_dir = out / name
        if not (run_dir / "final/config.yaml").is_file():
            configs = [arg for f in ["configs/demo.yaml", *fragments] for arg in ("--config", f)]
            run([*megamlm, "train", *configs, f"train.run_dir={run_dir}", f"train.steps={updates}",
                 "--overwrite"])
        summary, valid = last_event(run_dir, "summary"), last_event(run_dir, "valid")
        rows[name] = {"updates": updates, "flops_per_token": per_token, "minutes": summary["minutes"],
                      "budget_pflops": per_token * 16 * 128 * updates / 1e15, "valid_ppl": valid["ppl"]}
        glue_out = run_dir / "glue"
        if not args.skip_glue:
            if not glue_finished(glue_out):
                rows[name]["glue_seconds"] = run([
                    *megamlm, "glue", "--checkpoint", str(run_dir / "final"), "--data-dir", args.glue_dir,
                    "--tasks", ",".join(TASKS), "--seeds", args.seeds, "--epochs", "3", "--lr", "1e-4",
                    "--max-train-samples", str(args.max_train_samples), "--out", str(glue_out),
                    "--packing", "padded"])  # the layout of the recorded study (BENCHMARKS.md)
            report = json.loads((glue_out / "results.json").read_text())
            rows[name]["glue"] = {t: r["summary"] for t, r in report["tasks"].items() if "summary" in r}
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    table = markdown(rows)
    (out / "results.md").write_text(table)
    print(table)


def _cell(summary: dict, metric: str, percent: bool) -> str:
    s = summary[metric]
    scale = 100 if percent else 1
    digits = 1 if percent else 4
    return f"{s['median'] * scale:.{digits}f} ± {(s['max'] - s['min']) * scale / 2:.{digits}f}"


def markdown(rows: dict) -> str:
    lines = ["| objective | updates | PFLOPs (16×128 tokens/update) | minutes | own valid ppl | "
             + " | ".join(f"{t} {'MSE↓' if t == 'STS-B' else 'acc'}" for t in TASKS) + " |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(TASKS)]
    for name, r in rows.items():
        cells = [_cell(r["glue"][t], "mse" if t == "STS-B" else "accuracy", t != "STS-B")
                 if t in r.get("glue", {}) else "–" for t in TASKS]
        lines.append(f"| {name} | {r['updates']} | {r['budget_pflops']:.3f} | {r['minutes']:.1f} | "
                     f"{r['valid_ppl']:,.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
