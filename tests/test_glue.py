"""GLUE: every task's file layout (from a few real rows in tests/data/glue), metrics against
hand-computed values, the recipe's fine-tuning on CPU (a learnable toy task is learned), the report,
and MLM perplexity / extrapolation evaluation."""

import json
from pathlib import Path

import numpy as np
import pytest

from megamlm import MaskedLM
from megamlm.cli import main as cli
from megamlm.glue.finetune import FinetuneOptions
from megamlm.glue.metrics import compute_metrics
from megamlm.glue.run import run_glue
from megamlm.glue.tasks import TASKS, GlueDataError, read_examples, task_files, task_names
from tests.variants import variant_config

GLUE = Path(__file__).parent / "data" / "glue"


def test_every_task_layout_is_parsed():
    cola = read_examples(TASKS["CoLA"], GLUE / "CoLA/train.tsv")  # no header: label col 1, text col 3
    assert len(cola) == 9 and cola[0].texts == (
        "Our friends won't buy this analysis, let alone the next one we propose.",)
    assert cola[0].label == 1
    mrpc = read_examples(TASKS["MRPC"], GLUE / "MRPC/train.tsv")  # BOM before "Quality"
    assert len(mrpc) == 8 and mrpc[0].label == 1 and mrpc[0].texts[0].startswith("Amrozi accused his brother")
    stsb = read_examples(TASKS["STS-B"], GLUE / "STS-B/train.tsv")
    assert stsb[0].label == pytest.approx(1.0) and stsb[1].label == pytest.approx(3.8 / 5)  # 0-5 -> [0, 1]
    assert stsb[0].texts == ("A plane is taking off.", "An air plane is taking off.")
    rte = read_examples(TASKS["RTE"], GLUE / "RTE/train.tsv")
    assert rte[0].label == TASKS["RTE"].labels.index("not_entailment") == 1
    sst = read_examples(TASKS["SST-2"], GLUE / "SST-2/dev.tsv")
    assert len(sst) == 6 and {x.label for x in sst} <= {0, 1} and len(sst[0].texts) == 1
    qnli = read_examples(TASKS["QNLI"], GLUE / "QNLI/dev.tsv")
    assert qnli[0].texts[0] == "What came into force after the new constitution was herald?" and qnli[0].label == 0
    mnli = read_examples(TASKS["MNLI"], GLUE / "MNLI/dev_matched_3col.tsv")  # ids 0/1/2 = ent/neu/con
    assert [x.label for x in mnli[:2]] == [TASKS["MNLI"].labels.index("neutral"),
                                           TASKS["MNLI"].labels.index("contradiction")]
    assert task_files(TASKS["MNLI"], GLUE).startswith("missing") and "MNLI/train.tsv" in task_files(TASKS["MNLI"], GLUE)


def test_task_names_are_taken_in_any_case_with_or_without_the_hyphen():
    assert task_names(["rte", "sst2", "STSB", "sts-b", "cola", "Mnli", " QQP"]) == [
        "RTE", "SST-2", "STS-B", "STS-B", "CoLA", "MNLI", "QQP"]
    with pytest.raises(GlueDataError, match=r"^unknown GLUE task\(s\) \['wnli'\]; allowed: MNLI, QNLI, QQP, RTE, "):
        task_names(["rte", "wnli"])
    with pytest.raises(GlueDataError, match=r"^unknown GLUE task\(s\) \['sst'\]; allowed: .*; did you mean 'SST-2'\?$"):
        task_names(["sst"])

def test_qqp_layout_and_errors_name_file_and_line(tmp_path):
    qqp = tmp_path / "train.tsv"
    qqp.write_text("id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
                   "0\t1\t2\tHow do I learn?\tHow can I learn?\t1\n"
                   "1\t3\t4\tWhat is 2+2?\tWho won?\t0\n")
    rows = read_examples(TASKS["QQP"], qqp)
    assert [r.label for r in rows] == [1, 0] and rows[1].texts == ("What is 2+2?", "Who won?")
    qqp.write_text(qqp.read_text() + "2\t5\t6\tonly one question\n")
    with pytest.raises(GlueDataError, match=r"train.tsv:4: 4 columns, QQP needs 6"):
        read_examples(TASKS["QQP"], qqp)
    rte = tmp_path / "rte.tsv"
    rte.write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tmaybe\n")
    with pytest.raises(GlueDataError, match=r"rte.tsv:2: label 'maybe' is not one of RTE's"):
        read_examples(TASKS["RTE"], rte)
    with pytest.raises(GlueDataError, match=r"rte.tsv:1: header .* lacks STS-B's columns"):
        read_examples(TASKS["STS-B"], rte)


def test_metrics_equal_hand_computed_values():
    labels, predictions = np.array([1, 1, 1, 0, 0, 0]), np.array([1, 1, 0, 0, 0, 1])
    m = compute_metrics(("accuracy", "f1", "mcc"), predictions, labels)
    # TP 2, TN 2, FP 1, FN 1: MCC = (4 - 1) / sqrt(3^4) = 1/3; F1 = 4 / 6
    assert m == pytest.approx({"accuracy": 4 / 6, "f1": 2 / 3, "mcc": 1 / 3})
    m = compute_metrics(("pearson", "spearman", "mse"), np.array([1.0, 2, 3, 4]), np.array([1.0, 3, 2, 4]))
    # Pearson: cov 4 / var 5 = 0.8; Spearman: 1 - 6 * 2 / (4 * 15) = 0.8; MSE: (0 + 1 + 1 + 0) / 4
    assert m == pytest.approx({"pearson": 0.8, "spearman": 0.8, "mse": 0.5})


def write_tiny_folder(folder: Path) -> Path:
    """A one-layer ALiBi model's folder (random weights) at `folder`."""
    from megamlm.model.reshard import full_state_dict
    from megamlm.config import ParallelConfig
    from megamlm.parallel import init_distributed
    from megamlm.model.folder import write_model_folder

    cfg = variant_config("alibi", ["model.vocab_size=50265", "model.hidden_size=32", "model.ffn_hidden_size=64",
                                   "model.num_layers=1"])
    write_model_folder(folder, cfg, full_state_dict(MaskedLM(cfg.model, init_distributed(ParallelConfig()))))
    return folder


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return write_tiny_folder(tmp_path_factory.mktemp("glue") / "model")


def test_two_update_fine_tune_runs_on_every_available_task_and_reports(tiny_folder, tmp_path):
    options = FinetuneOptions(epochs=1, batch_size=4)
    report = run_glue(str(tiny_folder), str(GLUE), list(TASKS), [1, 2], str(tmp_path), options,
                      max_train=8, log=lambda *a: None)
    ran = {name for name, r in report["tasks"].items() if "summary" in r}
    assert ran == {"QNLI", "RTE", "SST-2", "MRPC", "CoLA", "STS-B"}
    assert "missing" in report["tasks"]["MNLI"]["skipped"] and "missing" in report["tasks"]["QQP"]["skipped"]
    for name in ran:
        for seed in (1, 2):
            result = report["tasks"][name]["seeds"][seed]
            assert result["updates"] == 2 and len(result["epochs"]) == 1  # 8 rows / batch 4
            assert np.isfinite(result["epochs"][0]["train_loss"])
    assert set(report["tasks"]["STS-B"]["summary"]) == {"mse", "pearson", "spearman"}
    assert set(report["tasks"]["CoLA"]["summary"]) == {"accuracy", "mcc"}
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["tasks"]["RTE"]["seeds"]["1"]["epochs"][0]["accuracy"] == report["tasks"]["RTE"]["seeds"][1][
        "epochs"][0]["accuracy"]
    table = (tmp_path / "results.md").read_text().splitlines()
    assert table[2] == "| PPL↓ | MNLI | QNLI | QQP | RTE | SST-2 | MRPC | CoLA | STS-B↓ |"
    assert table[4].startswith("| – | – |") and "| MNLI | skipped |" not in table  # MNLI/QQP not run


@pytest.mark.parametrize("packing", ["packed", "padded"])
def test_fine_tuning_learns_a_learnable_task(tiny_folder, tmp_path, packing):
    """SST-2 layout, label = which of two words the sentence holds: the pipeline must learn it, in
    both batch layouts (sentences of 3-13 words: packed rows hold several)."""
    folder = tmp_path / "glue" / "SST-2"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    filler = "the a of to and in is it that was".split()

    def rows(n):
        lines = ["sentence\tlabel"]
        for _ in range(n):
            label = int(rng.integers(2))
            words = list(rng.choice(filler, int(rng.integers(2, 12)))) + ["wonderful" if label else "terrible"]
            rng.shuffle(words)
            lines.append(f"{' '.join(words)}\t{label}")
        return "\n".join(lines) + "\n"

    (folder / "train.tsv").write_text(rows(96))
    (folder / "dev.tsv").write_text(rows(32))
    report = run_glue(str(tiny_folder), str(tmp_path / "glue"), ["SST-2"], [1], str(tmp_path / "out"),
                      FinetuneOptions(epochs=4, batch_size=8, lr=1e-2, packing=packing), log=lambda *a: None)
    accuracies = [e["accuracy"] for e in report["tasks"]["SST-2"]["seeds"][1]["epochs"]]
    assert accuracies[-1] >= 0.9, accuracies


def test_glue_command_reports_a_missing_data_dir_without_traceback(capsys, tmp_path, tiny_folder):
    """A wrong --data-dir, or one that holds none of the tasks asked for, is one line (exit 2) before any
    work; a task missing beside others that run is skipped and reported (the previous test)."""
    assert cli(["glue", "--checkpoint", str(tiny_folder), "--data-dir", str(tmp_path / "none"), "--tasks", "RTE",
                "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"megamlm: glue: GLUE data dir {tmp_path / 'none'}: not a folder (it holds " \
        "<TASK>/train.tsv and dev.tsv)\n"
    assert cli(["glue", "--checkpoint", str(tiny_folder), "--data-dir", str(GLUE), "--tasks", "MNLI,QQP",
                "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"megamlm: glue: GLUE data dir {GLUE} holds the files of none of the tasks asked for: "
                          f"MNLI: missing {GLUE}/MNLI/train.tsv") and "; QQP: missing " in err, err
    assert not (tmp_path / "out/results.json").exists()
    assert cli(["glue", "--checkpoint", str(tiny_folder), "--data-dir", str(GLUE), "--tasks", "WNLI"]) == 2
    assert "unknown GLUE task(s) ['WNLI']" in capsys.readouterr().err
    for ppl in ("0.5", "nan"):  # the table's perplexity (megamlm eval ppl) is at least 1
        assert cli(["glue", "--checkpoint", str(tiny_folder), "--data-dir", str(GLUE), "--tasks", "RTE", "--ppl",
                    ppl, "--out", str(tmp_path / "out")]) == 2
        assert capsys.readouterr().err == f"megamlm: glue: --ppl {ppl} must be >= 1\n"
    # a wrong --checkpoint is said first, whatever the data dir holds
    assert cli(["glue", "--checkpoint", str(tmp_path / "typo"), "--data-dir", str(tmp_path / "none"), "--tasks",
                "RTE", "--out", str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"megamlm: glue: {tmp_path / 'typo' / 'config.yaml'} not found: not a megamlm model folder")
    assert not (tmp_path / "out2/results.json").exists()


def test_perplexity_and_extrapolation_report(tiny_folder, tmp_path):
    from megamlm.evaluate import evaluate_lengths, extrapolation_report

    text = Path(__file__).resolve().parents[1] / "data/wikitext-103/test.txt"
    rows = evaluate_lengths(tiny_folder, text, [32, 64, 128], max_tokens=2048)
    assert [r["length"] for r in rows] == [32, 64, 128]
    # fixed masking: the same model and data give the same numbers; ~15% of the tokens are targets
    assert rows == evaluate_lengths(tiny_folder, text, [32, 64, 128], max_tokens=2048)
    assert all(0.12 < r["masked_tokens"] / (r["samples"] * r["length"]) < 0.18 for r in rows)
    assert all(50265 / 10 < r["ppl"] < 50265 * 10 for r in rows)  # a random model: about uniform
    learned = variant_config("baseline", ["model.vocab_size=50265", "model.max_positions=64"])
    from megamlm.model.reshard import full_state_dict
    from megamlm.config import ParallelConfig
    from megamlm.parallel import init_distributed
    from megamlm.model.folder import write_model_folder

    write_model_folder(tmp_path / "learned", learned,
                       full_state_dict(MaskedLM(learned.model, init_distributed(ParallelConfig()))))
    capped = evaluate_lengths(tmp_path / "learned", text, [32, 64, 128], max_tokens=2048)
    assert capped[2] == {"length": 128, "skipped": "learned position table holds 64"}
    table = extrapolation_report({"alibi": rows, "learned": capped}, tmp_path / "report", train_length=64)
    assert "| learned | " in table and "n/a (learned position table holds 64)" in table
    assert (tmp_path / "report/ppl-vs-length.png").stat().st_size > 10_000


def _glue_on_ranks(folder, tasks):
    from megamlm.glue.run import run_task

    options = FinetuneOptions(epochs=2, batch_size=4, dropout=0.0)
    return {t: run_task(str(folder), str(GLUE), t, [3], options, 8, None, log=lambda *a: None) for t in tasks}


@pytest.mark.slow
def test_data_parallel_and_parallel_processes_give_the_single_process_results(tiny_folder, tmp_path):
    """DP=2 (gradients all-reduced, each rank half of every batch) equals one process; so do tasks
    run in spawned processes."""
    from tests.multiproc import run_on_ranks

    tasks = ["RTE", "STS-B"]
    one = _glue_on_ranks(tiny_folder, tasks)
    two = run_on_ranks(_glue_on_ranks, 2, tiny_folder, tasks)
    for task in tasks:
        a, b = one[task]["seeds"][3]["epochs"], two[0][task]["seeds"][3]["epochs"]
        for x, y in zip(*(r[task]["seeds"][3]["epochs"] for r in two)):  # both ranks report the same
            assert {k: v for k, v in x.items() if k != "seconds"} == {k: v for k, v in y.items() if k != "seconds"}
        for x, y in zip(a, b):
            assert x["train_loss"] == pytest.approx(y["train_loss"], rel=1e-5)
            metric = TASKS[task].metrics[0]
            assert x[metric] == pytest.approx(y[metric], rel=1e-4, abs=1e-6)
    spawned = run_glue(str(tiny_folder), str(GLUE), tasks, [3], str(tmp_path), FinetuneOptions(
        epochs=2, batch_size=4, dropout=0.0), max_train=8, parallel=2, log=lambda *a: None)
    for task in tasks:
        assert spawned["tasks"][task]["seeds"][3]["epochs"][-1]["train_loss"] == pytest.approx(
            one[task]["seeds"][3]["epochs"][-1]["train_loss"], rel=1e-6)


@pytest.mark.parametrize("variant", ["baseline", "zero-clap", "sinusoidal"])
def test_packed_batches_give_each_sequence_its_padded_logits(world, variant):
    import torch

    from megamlm.glue.finetune import SentenceClassifier, classify, pack
    from megamlm.model.encoder import Encoder

    cfg = variant_config(variant)
    model = SentenceClassifier(Encoder(cfg.model, world, seed=3), num_classes=3, seed=1).eval()
    rng = np.random.default_rng(0)
    sequences = [[0, *rng.integers(4, 1000, n).tolist(), 2] for n in (30, 5, 12, 22, 3, 17, 9)]
    tokens, segments, starts = pack(sequences, pad=1)
    assert tokens.shape == (4, 32) and (segments >= 0).sum() == sum(map(len, sequences)) == 112  # 4 rows, not 7
    assert all(tokens.flatten()[starts].eq(0))  # every start is a sequence's <s>
    with torch.no_grad():
        padded = classify(model, sequences, 1, "padded", world.device)
        packed = classify(model, sequences, 1, "packed", world.device)
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-5)




@pytest.mark.parametrize("mismatched_rows", [3, None])
def test_mnli_scores_its_mismatched_dev_set_too(tiny_folder, tmp_path, mismatched_rows):
    """MNLI with both dev sets (3-column copies): each epoch scores both, the matched one chooses the best
    epoch, and the report lists accuracy_mm beside accuracy."""
    import shutil

    data = tmp_path / "glue"
    shutil.copytree(GLUE / "MNLI", data / "MNLI")
    matched = (data / "MNLI/dev_matched_3col.tsv").read_text().splitlines()
    labels = dict(zip("012", ("entailment", "neutral", "contradiction")))
    (data / "MNLI/train.tsv").write_text("sentence1\tsentence2\tgold_label\n" + "".join(
        f"{a}\t{b}\t{labels[y]}\n" for a, b, y in (line.split("\t") for line in matched)))
    mismatched = matched[:mismatched_rows]
    (data / "MNLI/dev_mismatched_3col.tsv").write_text("".join(f"{line}\n" for line in mismatched))
    report = run_glue(str(tiny_folder), str(data), ["MNLI"], [1], str(tmp_path / "out"),
                      FinetuneOptions(epochs=3, batch_size=4, lr=1e-2, dropout=0.0), log=lambda *a: None)
    mnli = report["tasks"]["MNLI"]
    assert (mnli["dev_rows"], mnli["dev_rows_mm"]) == (len(matched), len(mismatched))
    epochs = mnli["seeds"][1]["epochs"]
    assert all(set(epoch) == {"epoch", "train_loss", "seconds", "accuracy", "accuracy_mm"} for epoch in epochs)
    assert mnli["seeds"][1]["best"] == max(epochs, key=lambda epoch: epoch["accuracy"])
    if mismatched_rows is None:  # the same rows: the same scores
        assert all(epoch["accuracy_mm"] == epoch["accuracy"] for epoch in epochs)
    else:  # the accuracy on those 3 rows: a multiple of 1/3
        assert all(round(epoch["accuracy_mm"] * 3, 9).is_integer() for epoch in epochs)
    table = (tmp_path / "out/results.md").read_text()
    assert "| MNLI | accuracy |" in table and "| MNLI | accuracy_mm |" in table


def test_long_epochs_show_progress_with_the_running_loss(tiny_folder, tmp_path, monkeypatch):
    import megamlm.glue.finetune as finetune

    monkeypatch.setattr(finetune, "PROGRESS_SECONDS", 0.0)  # a line after every update
    lines = []
    report = run_glue(str(tiny_folder), str(GLUE), ["RTE"], [1], str(tmp_path), FinetuneOptions(epochs=1, batch_size=4),
                      max_train=8, log=lines.append)
    progress = [line for line in lines if "update " in line]
    assert [line.split(" | ")[0] for line in progress] == [f"RTE seed 1 epoch 1/1: update {k}/2" for k in (1, 2)]
    # after the last update the running mean is the epoch's train loss
    epoch = report["tasks"]["RTE"]["seeds"][1]["epochs"][0]
    assert progress[-1].split(" | ")[1] == f"train loss {epoch['train_loss']:.4f}"
