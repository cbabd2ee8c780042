"""GLUE tasks: files and columns as GLUE's download script writes them, and the reference recipe.

Column quirks handled here: CoLA has no header (source, label, original label, sentence); MRPC's
header starts with a byte-order mark and has quality/ID columns; STS-B scores are floats (0-5,
divided by 5 as fairseq's preprocessing does); RTE/QNLI labels are words; MNLI's dev files are
dev_matched.tsv (GLUE layout) or a reduced 3-column copy (premise, hypothesis, label id), and likewise
its mismatched set, scored as well (accuracy_mm). Test files
have a header, an `index` column and no label (CoLA's too); MNLI has a matched and a mismatched one.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from megamlm.errors import MegamlmError, did_you_mean


STSB_SCALE = 5.0
"""STS-B's similarity scores are 0-5; fine-tuning regresses score / STSB_SCALE (fairseq's preprocessing)."""


class GlueDataError(MegamlmError):
    """A GLUE file that does not have its task's layout; the message names file and line."""


@dataclass(frozen=True)
class Task:
    name: str
    text_columns: tuple[str | int, ...]
    """Header names (or positions for header-less files) of sentence A (and B)."""
    label_column: str | int
    labels: tuple[str, ...] | None
    """Label strings in class order; None = regression (STS-B)."""
    lr: float
    batch_size: int
    max_update: int
    warmup: int
    """The reference recipe (fairseq examples/roberta/config/finetuning, 10 epochs)."""
    metrics: tuple[str, ...]
    train_rows: int
    """GLUE's training rows, which the recipe's max_update was computed for (10 epochs)."""
    dev_files: tuple[str, ...] = ("dev.tsv",)
    header: bool = True
    test_files: tuple[tuple[str, str], ...] = (("test.tsv", ""),)
    """(test file, its predictions' name in a GLUE submission; "" = the task's name)."""
    test_text_columns: tuple[str, ...] | None = None
    """Header names of the test file's texts, where they differ from text_columns (CoLA)."""
    extra_dev: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """(suffix, its files: the first present) of further dev sets scored each epoch with the task's
    metrics, reported as `<metric>_<suffix>` (MNLI's mismatched set: accuracy_mm); the first dev set
    alone chooses the best epoch."""

    @property
    def num_classes(self) -> int:
        return 1 if self.labels is None else len(self.labels)

    @property
    def reported_metrics(self) -> tuple[str, ...]:
        """The metrics of the dev set, then of each extra one."""
        return (*self.metrics, *(f"{metric}_{suffix}" for suffix, _ in self.extra_dev for metric in self.metrics))

    @property
    def head_name(self) -> str:
        """The name of this task's classification head in a model folder (fairseq's classification_heads)."""
        return self.name.lower()

    def schedule(self, epochs: int, updates_per_epoch: int) -> tuple[int, int]:
        """(total, warm-up) updates of the polynomial schedule for this run: the recipe's numbers
        at its 10 epochs of GLUE's full training set, proportionally fewer for shorter runs."""
        recipe_per_epoch = -(-self.train_rows // self.batch_size)
        total = max(1, round(self.max_update / (10 * recipe_per_epoch) * epochs * updates_per_epoch))
        return total, round(self.warmup / self.max_update * total)


TASKS: dict[str, Task] = {t.name: t for t in [
    Task("MNLI", ("sentence1", "sentence2"), "gold_label", ("contradiction", "entailment", "neutral"),
         1e-5, 32, 123873, 7432, ("accuracy",), 392702, ("dev_matched.tsv", "dev_matched_3col.tsv"),
         test_files=(("test_matched.tsv", "MNLI-m"), ("test_mismatched.tsv", "MNLI-mm")),
         extra_dev=(("mm", ("dev_mismatched.tsv", "dev_mismatched_3col.tsv")),)),
    Task("QNLI", ("question", "sentence"), "label", ("entailment", "not_entailment"),
         1e-5, 32, 33112, 1986, ("accuracy",), 104743),
    Task("QQP", ("question1", "question2"), "is_duplicate", ("0", "1"),
         1e-5, 32, 113272, 28318, ("accuracy", "f1"), 363846),
    Task("RTE", ("sentence1", "sentence2"), "label", ("entailment", "not_entailment"),
         2e-5, 16, 2036, 122, ("accuracy",), 2490),
    Task("SST-2", ("sentence",), "label", ("0", "1"), 1e-5, 32, 20935, 1256, ("accuracy",), 67349),
    Task("MRPC", ("#1 String", "#2 String"), "Quality", ("0", "1"), 1e-5, 16, 2296, 137, ("accuracy", "f1"), 3668),
    Task("CoLA", (3,), 1, ("0", "1"), 1e-5, 16, 5336, 320, ("accuracy", "mcc"), 8551, header=False,
         test_text_columns=("sentence",)),
    Task("STS-B", ("sentence1", "sentence2"), "score", None, 2e-5, 16, 3598, 214,
         ("mse", "pearson", "spearman"), 5749),
]}


def task_names(asked: list[str]) -> list[str]:
    """The tasks `asked` for, as TASKS spells them: any case, with or without the hyphen (rte, sst2, stsb:
    the Hub's spelling); one that is no GLUE task of ours is refused, naming those that are."""
    spellings = {_spelling(name): name for name in TASKS}
    unknown = [name for name in asked if _spelling(name) not in spellings]
    if unknown:
        raise GlueDataError(f"unknown GLUE task(s) {unknown}; allowed: {', '.join(TASKS)}"
                            f"{did_you_mean(unknown[0], TASKS) if len(unknown) == 1 else ''}")
    return [spellings[_spelling(name)] for name in asked]


def _spelling(name: str) -> str:
    return name.strip().lower().replace("-", "").replace("_", "")


MNLI_3COL_LABELS = ("0", "1", "2")  # the reduced copy's ids: entailment, neutral, contradiction
MNLI_3COL_ORDER = ("entailment", "neutral", "contradiction")


@dataclass
class Example:
    texts: tuple[str, ...]
    label: float | int | None
    """The class id, STS-B's score / 5, or None in a test file (then `index` is its row's index)."""
    index: str | None = None


def read_examples(task: Task, path: str | Path) -> list[Example]:
    """Rows of one TSV; a row without the task's columns is an error naming the file and line."""
    path = Path(path)
    threecol = path.name.endswith("_3col.tsv")
    header = task.header and not threecol
    with open(path, encoding="utf-8-sig", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if not rows:
        raise GlueDataError(f"{path}: empty file")
    if threecol:
        columns, label_column = (0, 1), 2
    elif header:
        names = rows[0]
        try:
            columns = tuple(names.index(c) for c in task.text_columns)
            label_column = names.index(task.label_column)
        except ValueError:
            raise GlueDataError(f"{path}:1: header {names} lacks {task.name}'s columns "
                                f"{[*task.text_columns, task.label_column]}") from None
    else:
        columns, label_column = task.text_columns, task.label_column
    examples = []
    for number, row in enumerate(rows[1:] if header else rows, 2 if header else 1):
        if len(row) <= max(*columns, label_column):
            raise GlueDataError(f"{path}:{number}: {len(row)} columns, {task.name} needs "
                                f"{max(*columns, label_column) + 1}")
        raw = row[label_column].strip()
        if task.labels is None:
            try:
                label = float(raw) / STSB_SCALE
            except ValueError:
                raise GlueDataError(f"{path}:{number}: score {raw!r} is not a number") from None
        else:
            if threecol:
                raw = MNLI_3COL_ORDER[MNLI_3COL_LABELS.index(raw)] if raw in MNLI_3COL_LABELS else raw
            if raw not in task.labels:
                raise GlueDataError(f"{path}:{number}: label {raw!r} is not one of {task.name}'s {task.labels}")
            label = task.labels.index(raw)
        examples.append(Example(tuple(row[c] for c in columns), label))
    return examples


def read_test_examples(task: Task, path: str | Path) -> list[Example]:
    """Rows of a test file (index, the task's texts, no label); errors name the file and line."""
    path = Path(path)
    with open(path, encoding="utf-8-sig", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if not rows:
        raise GlueDataError(f"{path}: empty file")
    wanted = ["index", *(task.test_text_columns or task.text_columns)]
    try:
        columns = [rows[0].index(name) for name in wanted]
    except ValueError:
        raise GlueDataError(f"{path}:1: header {rows[0]} lacks {task.name}'s test columns {wanted}") from None
    examples = []
    for number, row in enumerate(rows[1:], 2):
        if len(row) <= max(columns):
            raise GlueDataError(f"{path}:{number}: {len(row)} columns, {task.name}'s test file needs "
                                f"{max(columns) + 1}")
        examples.append(Example(tuple(row[c] for c in columns[1:]), None, row[columns[0]]))
    return examples


def task_test_files(task: Task, data_dir: str | Path) -> list[tuple[Path, str]]:
    """(test file, submission name) of each of the task's test files present in `data_dir`."""
    folder = Path(data_dir) / task.name
    return [(folder / file, name or task.name) for file, name in task.test_files if (folder / file).is_file()]


def _first_present(folder: Path, files: tuple[str, ...]) -> Path | None:
    """The first of `files` that `folder` holds."""
    return next((folder / name for name in files if (folder / name).is_file()), None)


def task_extra_dev_files(task: Task, data_dir: str | Path) -> dict[str, Path]:
    """suffix -> the file of each of the task's extra dev sets present in `data_dir`."""
    found = {suffix: _first_present(Path(data_dir) / task.name, files) for suffix, files in task.extra_dev}
    return {suffix: path for suffix, path in found.items() if path is not None}


def task_files(task: Task, data_dir: str | Path) -> tuple[Path, Path] | str:
    """(train, dev) paths, or the reason the task cannot run from this directory."""
    folder = Path(data_dir) / task.name
    train = folder / "train.tsv"
    dev = _first_present(folder, task.dev_files)
    missing = [str(p) for p in (train,) if not p.is_file()] + ([] if dev else [str(folder / task.dev_files[0])])
    return f"missing {', '.join(missing)}" if missing else (train, dev)
