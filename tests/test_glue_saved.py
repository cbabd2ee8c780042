"""Fine-tuned models (`megamlm glue --save`): the best seed at its best epoch is a model folder whose
encoder and classification head give that epoch's dev scores and test predictions again (`--epochs 0`),
and whose head travels to fairseq's classification_heads."""

import json
import shutil

import pytest
import torch

from megamlm.cli import main as cli
from megamlm.convert.pipeline import convert
from megamlm.convert.safe_load import load_untrusted
from megamlm.errors import MegamlmError
from megamlm.glue.finetune import FinetuneOptions, SentenceClassifier
from megamlm.glue.run import run_glue
from megamlm.model.encoder import Encoder
from megamlm.model.folder import read_model_folder
from tests.test_glue import GLUE, tiny_folder  # noqa: F401  (a fixture)
from tests.test_glue_submission import _dev_as_test
from tests.variants import variant_config


def test_a_saved_model_scores_and_predicts_as_its_best_epoch(tiny_folder, tmp_path):  # noqa: F811
    data = tmp_path / "glue"
    shutil.copytree(GLUE, data)
    _dev_as_test("STS-B", data)
    options = FinetuneOptions(epochs=4, batch_size=4, lr=1e-2, dropout=0.0, predict=True, save=True)
    lines = []
    first = run_glue(str(tiny_folder), str(data), ["STS-B", "RTE"], [1, 2], str(tmp_path / "out"), options,
                     max_train=8, log=lines.append)
    for name in ("STS-B", "RTE"):
        task = first["tasks"][name]
        kept = task["test_seed"]  # the seed --predict's submission comes from, the best one
        best = task["seeds"][kept]["best"]
        assert task["saved"] == str(tmp_path / "out/models" / name)
        assert f"{name}: saved seed {kept} at epoch {best['epoch']} to {task['saved']}" in lines
        folder = read_model_folder(task["saved"])
        original = read_model_folder(tiny_folder)
        assert set(folder.full) == set(original.full)
        changed = [key for key in folder.full if not torch.equal(folder.full[key], original.full[key])]
        assert changed and not any(key.startswith("lm_head.") for key in changed)  # the MLM head kept as it was
        head = name.lower()
        assert {key.split(".")[0] for key in folder.heads} == {head}
        # scored again from the folder, without training: the best epoch's numbers and test predictions
        again = run_glue(task["saved"], str(data), [name], [1], str(tmp_path / "again" / name),
                         FinetuneOptions(epochs=0, batch_size=4, dropout=0.0, predict=True), log=lines.append)
        epoch0 = again["tasks"][name]["seeds"][1]["epochs"]
        assert len(epoch0) == 1 and epoch0[0]["epoch"] == 0 and epoch0[0]["train_loss"] is None
        for metric in (key for key in best if key not in ("epoch", "train_loss", "seconds")):
            assert epoch0[0][metric] == pytest.approx(best[metric], rel=1e-6, abs=1e-9), (name, metric)
        for submission in (tmp_path / "out/test").glob(f"{name}*.tsv"):
            assert (tmp_path / "again" / name / "test" / submission.name).read_text() == submission.read_text()
        assert any(line.startswith(f"{name}: classifier pooler on cls features, started from "
                                   f"classification_heads.{head}.dense.weight") for line in lines)
        # fairseq's classification_heads.<name>.* (fairseq's sentence_prediction reads its head by name)
        convert("megamlm", "fairseq", task["saved"], tmp_path / f"{name}.pt", log=lambda *a: None)
        state = load_untrusted(tmp_path / f"{name}.pt")["model"]
        for key, tensor in folder.heads.items():
            assert torch.equal(state[f"classification_heads.{key}"].float(), tensor), key


def test_a_saved_head_that_does_not_fit_is_refused(world):
    cfg = variant_config("baseline", ["model.vocab_size=50265"])
    h = cfg.model.hidden_size
    three_classes = {"classification_heads.rte.dense.weight": torch.zeros(h, h),
                     "classification_heads.rte.dense.bias": torch.zeros(h),
                     "classification_heads.rte.out_proj.weight": torch.zeros(3, h),
                     "classification_heads.rte.out_proj.bias": torch.zeros(3)}
    with pytest.raises(MegamlmError, match=r"classification head 'rte' does not fit this PoolerHead .* "
                                           r"with 2 output\(s\): out_proj.bias, out_proj.weight"):
        SentenceClassifier(Encoder(cfg.model, world, seed=1), 2, seed=1, pretrained=three_classes, name="rte")
    model = SentenceClassifier(Encoder(cfg.model, world, seed=1), 3, seed=1, pretrained=three_classes, name="rte")
    assert model.pretrained == [f"classification_heads.rte.{key}" for key in ("dense.weight", "dense.bias",
                                                                              "out_proj.weight", "out_proj.bias")]
    assert torch.equal(model.head.out_proj.weight, torch.zeros(3, h))
    # another task's head is not taken: the head is drawn as for any folder
    assert SentenceClassifier(Encoder(cfg.model, world, seed=1), 2, seed=1, pretrained=three_classes,
                              name="mrpc").pretrained == []


def test_the_glue_command_saves_and_refuses_negative_epochs(tiny_folder, tmp_path, capsys):  # noqa: F811
    args = ["glue", "--checkpoint", str(tiny_folder), "--data-dir", str(GLUE), "--tasks", "RTE",
            "--max-train-samples", "4", "--out", str(tmp_path / "out")]
    assert cli([*args, "--epochs", "1", "--save"]) == 0
    report = json.loads((tmp_path / "out/results.json").read_text())
    assert report["tasks"]["RTE"]["saved"] == str(tmp_path / "out/models/RTE")
    assert (tmp_path / "out/models/RTE/config.yaml").is_file()
    capsys.readouterr()
    assert cli([*args, "--epochs", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "epochs -1: must be >= 0" in err
