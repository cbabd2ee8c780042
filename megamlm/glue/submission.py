"""GLUE test-set predictions in the benchmark's submission format (gluebenchmark.com): one `<name>.tsv`
per test file, a header `index<TAB>prediction`, then each row's index and its prediction — the class by
the task's label name (`entailment`, `1`, ...), STS-B's similarity on its 0-5 scale.

`megamlm glue --predict` predicts every test file with the best epoch's weights of each seed and writes
<out>/test/seed<k>/<name>.tsv, and <out>/test/<name>.tsv from the seed whose best validation score is
the best (what a submission zip holds).
"""

from __future__ import annotations

from pathlib import Path

from megamlm.glue.metrics import best_of
from megamlm.glue.tasks import STSB_SCALE, Example, Task

HEADER = "index\tprediction"


def prediction_lines(task: Task, rows: list[Example], predictions: list[float | int]) -> list[str]:
    """The file's lines: the header, then `index<TAB>prediction` in the test file's order."""
    if task.labels is None:
        values = [f"{min(STSB_SCALE, max(0.0, value * STSB_SCALE)):.3f}" for value in predictions]
    else:
        values = [task.labels[int(value)] for value in predictions]
    return [HEADER, *(f"{row.index}\t{value}" for row, value in zip(rows, values, strict=True))]


def write_submission(folder: str | Path, task: Task, result: dict) -> dict[str, str]:
    """Write each seed's predictions (result["seeds"][seed]["test"]: {name: lines}, moved out of the
    result, which keeps the row counts) and the best seed's as the submission; returns {name: path}."""
    seeds = {seed: run for seed, run in result["seeds"].items() if "test" in run}
    if not seeds:
        return {}
    best = best_of(task.metrics[0], seeds, lambda seed: seeds[seed]["best"])
    written = {}
    for seed, run in seeds.items():
        files = run.pop("test")
        run["test_rows"] = {name: len(lines) - 1 for name, lines in files.items()}
        for name, lines in files.items():
            text = "\n".join(lines) + "\n"
            _write(Path(folder) / f"seed{seed}" / f"{name}.tsv", text)
            if seed == best:
                written[name] = str(_write(Path(folder) / f"{name}.tsv", text))
    result["test_seed"] = best
    return written


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path
