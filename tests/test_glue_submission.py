"""GLUE test predictions (`megamlm glue --predict`, glue/submission.py): test files in GLUE's layout
(real rows in tests/data/glue), errors naming file and line, and submission files made with the best
epoch's weights of the best seed — checked by predicting a test file that holds the dev rows, whose
score must be the best epoch's."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from megamlm.glue.finetune import FinetuneOptions
from megamlm.glue.run import merge_reports, run_glue
from megamlm.glue.tasks import TASKS, GlueDataError, read_examples, read_test_examples, task_test_files
from tests.test_glue import GLUE, tiny_folder  # noqa: F401  (a fixture)


def test_test_files_are_read_in_glues_layout(tmp_path):
    rte = read_test_examples(TASKS["RTE"], GLUE / "RTE/test.tsv")
    assert [row.index for row in rte] == ["0", "1", "2", "3", "4"] and all(row.label is None for row in rte)
    assert rte[0].texts == ("Mangla was summoned after Madhumita's sister Nidhi Shukla, who was the first witness "
                            "in the case.", "Shukla is related to Mangla.")
    cola = read_test_examples(TASKS["CoLA"], GLUE / "CoLA/test.tsv")  # a header, unlike CoLA's train and dev
    assert cola[0].texts == ("Bill whistled past the house.",)
    stsb = read_test_examples(TASKS["STS-B"], GLUE / "STS-B/test.tsv")  # 9 columns, the texts last
    assert stsb[0].texts == ("A girl is styling her hair.", "A girl is brushing her hair.")
    mrpc = read_test_examples(TASKS["MRPC"], GLUE / "MRPC/test.tsv")  # a byte-order mark before "index"
    assert len(mrpc) == 5 and mrpc[0].texts[0].startswith("PCCW's chief operating officer")
    assert [name for _, name in task_test_files(TASKS["MNLI"], tmp_path)] == []
    (tmp_path / "MNLI").mkdir()
    for file in ("test_matched.tsv", "test_mismatched.tsv"):
        (tmp_path / "MNLI" / file).write_text("index\tsentence1\tsentence2\n0\ta\tb\n")
    assert [name for _, name in task_test_files(TASKS["MNLI"], tmp_path)] == ["MNLI-m", "MNLI-mm"]
    bad = tmp_path / "test.tsv"
    bad.write_text("index\tsentence1\n0\tonly one\n")
    with pytest.raises(GlueDataError, match=r"test.tsv:1: header \['index', 'sentence1'\] lacks RTE's test columns"):
        read_test_examples(TASKS["RTE"], bad)
    bad.write_text("index\tsentence1\tsentence2\n0\ta\tb\n1\tc\n")
    with pytest.raises(GlueDataError, match=r"test.tsv:3: 2 columns, RTE's test file needs 3"):
        read_test_examples(TASKS["RTE"], bad)


def _dev_as_test(task: str, data: Path) -> list:
    """Rewrite <data>/<task>/test.tsv to hold the dev rows in the test layout; returns the dev rows."""
    dev = read_examples(TASKS[task], data / task / "dev.tsv")
    columns = "\t".join(TASKS[task].test_text_columns or TASKS[task].text_columns)
    rows = [f"{i}\t" + "\t".join(example.texts) for i, example in enumerate(dev)]
    (data / task / "test.tsv").write_text(f"index\t{columns}\n" + "\n".join(rows) + "\n")
    return dev


def test_predictions_come_from_the_best_epoch_of_the_best_seed(tiny_folder, tmp_path):  # noqa: F811
    data = tmp_path / "glue"
    shutil.copytree(GLUE, data)
    dev = _dev_as_test("STS-B", data)
    options = FinetuneOptions(epochs=6, batch_size=4, lr=1e-2, dropout=0.0, predict=True)
    report = run_glue(str(tiny_folder), str(data), ["STS-B", "RTE"], [1, 2], str(tmp_path / "array/out"), options,
                      max_train=8, log=lambda *a: None)
    stsb = report["tasks"]["STS-B"]
    best_seed = min(stsb["seeds"], key=lambda seed: stsb["seeds"][seed]["best"]["mse"])
    assert stsb["test_seed"] == best_seed
    lines = (tmp_path / "array/out/test/STS-B.tsv").read_text().splitlines()
    assert lines == (tmp_path / f"array/out/test/seed{best_seed}/STS-B.tsv").read_text().splitlines()
    assert lines[0] == "index\tprediction" and [line.split("\t")[0] for line in lines[1:]] == list("012345")
    scores = np.array([float(line.split("\t")[1]) for line in lines[1:]])
    assert ((0 <= scores) & (scores <= 5)).all()
    mse = float(np.mean((scores / 5 - np.array([example.label for example in dev])) ** 2))
    epochs = stsb["seeds"][best_seed]["epochs"]
    best = stsb["seeds"][best_seed]["best"]
    print(f"test-file MSE {mse:.6f}; epochs {[round(e['mse'], 6) for e in epochs]}, best epoch {best['epoch']}")
    assert best["epoch"] < len(epochs)  # the last epoch is not the best: the weights were kept
    assert mse == pytest.approx(best["mse"], abs=2e-4)  # scores are written to 3 decimals
    assert all(abs(mse - best["mse"]) < abs(mse - e["mse"]) for e in epochs if e["epoch"] != best["epoch"])
    rte = (tmp_path / "array/out/test/RTE.tsv").read_text().splitlines()  # the real test rows: label names
    assert len(rte) == 6 and {line.split("\t")[1] for line in rte[1:]} <= {"entailment", "not_entailment"}
    saved = json.loads((tmp_path / "array/out/results.json").read_text())["tasks"]["RTE"]
    assert saved["seeds"]["1"]["test_rows"] == {"RTE": 5} and "test" not in saved["seeds"]["1"]
    # a job array's folder (slurm/glue.sbatch: <model>/glue/<TASK>/): --merge gathers the submission files
    merge_reports(tmp_path / "array")
    assert sorted(p.name for p in (tmp_path / "array/test").iterdir()) == ["RTE.tsv", "STS-B.tsv"]
    assert (tmp_path / "array/test/RTE.tsv").read_text() == (tmp_path / "array/out/test/RTE.tsv").read_text()


def _predict_on_ranks(folder, data):
    from megamlm.glue.run import run_task

    options = FinetuneOptions(epochs=2, batch_size=4, lr=1e-3, dropout=0.0, predict=True, layerwise_lr_decay=0.8,
                              overrides=("model.classifier_pooling=mean",))
    return run_task(str(folder), str(data), "STS-B", [3], options, 8, None, log=lambda *a: None)


@pytest.mark.slow
def test_data_parallel_predictions_equal_one_process(tiny_folder, tmp_path):  # noqa: F811
    """DP=2 (each rank half of every batch, gradients all-reduced) with mean pooling, layer-wise decay
    and test predictions gives one process's losses and the same submission lines on both ranks."""
    from tests.multiproc import run_on_ranks

    data = tmp_path / "glue"
    shutil.copytree(GLUE, data)
    one = _predict_on_ranks(tiny_folder, data)["seeds"][3]
    two = [result["seeds"][3] for result in run_on_ranks(_predict_on_ranks, 2, tiny_folder, data)]
    assert two[0]["test"] == two[1]["test"] and len(one["test"]["STS-B"]) == 6  # header + 5 rows
    for x, y in zip(one["epochs"], two[0]["epochs"]):
        assert x["train_loss"] == pytest.approx(y["train_loss"], rel=1e-5)
    scores = [[float(line.split("\t")[1]) for line in run["test"]["STS-B"][1:]] for run in (one, two[0])]
    assert scores[0] == pytest.approx(scores[1], abs=2e-3)  # 3 decimals, float sums in another order
