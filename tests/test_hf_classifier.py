"""A fine-tuned folder's classification head as transformers' *ForSequenceClassification
(`megamlm convert --to hf --classification-head NAME`): RoBERTa, BERT, ALBERT with the pooler head,
ModernBERT with its MLM-head classifier; the conversion itself checks the logits against transformers',
and a model fine-tuned by `megamlm glue --save` classifies GLUE's dev rows in transformers as it did here."""

import json

import numpy as np
import pytest
import torch

from megamlm import MaskedLM
from megamlm.cli import main as cli
from megamlm.config import ParallelConfig, replace_config
from megamlm.convert.fairseq import ConversionError
from megamlm.convert.hf_export import SequenceClassifier
from megamlm.convert.pipeline import convert
from megamlm.data.tokenizer import Tokenizer
from megamlm.glue.finetune import FinetuneOptions, SentenceClassifier, classify, encode
from megamlm.glue.run import folder_tensors, run_glue
from megamlm.glue.tasks import TASKS, read_examples
from megamlm.model.folder import read_model_folder, write_model_folder
from megamlm.model.reshard import full_state_dict
from megamlm.parallel import init_distributed
from megamlm.objectives import encoder_from
from megamlm.objectives.classification import CLASSIFIER_HEADS
from tests.test_glue import GLUE
from tests.test_hf_bert_albert import save_albert, save_bert
from tests.test_hf_import import save_roberta
from tests.test_modernbert import save_modernbert
from tests.variants import variant_config

QUIET = {"log": lambda *a: None, "tolerance": 1e-5}
SOURCES = {"Roberta": save_roberta, "Bert": save_bert, "Albert": save_albert, "ModernBert": save_modernbert}


def _with_head(folder, name: str, outputs: int, seed: int = 0):
    """Add a classification head `name` of the folder's model.classifier, every weight drawn nonzero."""
    saved = read_model_folder(folder)
    head = CLASSIFIER_HEADS[saved.cfg.model.classifier](saved.cfg.model, outputs)
    generator = torch.Generator().manual_seed(seed)
    heads = {f"{name}.{key}": torch.randn(param.shape, generator=generator) * 0.5
             for key, param in head.named_parameters()}
    write_model_folder(folder, saved.cfg, saved.full, heads={**saved.heads, **heads}, source=saved.source,
                       overwrite=True)


@pytest.mark.parametrize("architecture", sorted(SOURCES))
@pytest.mark.parametrize("outputs", [3, 1])
def test_a_classification_head_exports_with_transformers_logits(world, tmp_path, architecture, outputs):
    from transformers import AutoConfig

    convert("hf", "megamlm", SOURCES[architecture](tmp_path / "hf"), tmp_path / "megamlm", **QUIET)
    _with_head(tmp_path / "megamlm", "task", outputs)
    labels = ("a", "b", "c") if outputs == 3 else None
    report = convert("megamlm", "hf", tmp_path / "megamlm", tmp_path / "out", classifier=SequenceClassifier(
        "task", labels), **QUIET)  # the conversion compares both models' logits on the probe batch
    assert report["max_diff"][f"transformers {architecture}ForSequenceClassification"] < 1e-5
    config = AutoConfig.from_pretrained(tmp_path / "out")
    assert config.architectures == [f"{architecture}ForSequenceClassification"] and config.num_labels == outputs
    assert config.problem_type == ("regression" if outputs == 1 else "single_label_classification")
    if labels:
        assert config.id2label == {0: "a", 1: "b", 2: "c"}


def test_heads_without_a_transformers_class_are_refused(world, tmp_path):
    convert("hf", "megamlm", save_roberta(tmp_path / "hf"), tmp_path / "megamlm", **QUIET)
    _with_head(tmp_path / "megamlm", "task", 2)
    with pytest.raises(ConversionError, match="no classification head 'rte' in the folder \\(it has: task\\)"):
        convert("megamlm", "hf", tmp_path / "megamlm", tmp_path / "out", classifier=SequenceClassifier("rte"), **QUIET)
    with pytest.raises(ConversionError, match="for --to hf .* --to fairseq keeps every classification head"):
        convert("megamlm", "fairseq", tmp_path / "megamlm", tmp_path / "x.pt", classifier=SequenceClassifier("task"),
                **QUIET)
    with pytest.raises(ConversionError, match="has 2 output\\(s\\), not the 3 labels a, b, c"):
        convert("megamlm", "hf", tmp_path / "megamlm", tmp_path / "out", classifier=SequenceClassifier(
            "task", ("a", "b", "c")), **QUIET)
    saved = read_model_folder(tmp_path / "megamlm")  # the same weights under ELECTRA's linear head
    linear = replace_config(saved.cfg, ["model.classifier=linear"])
    write_model_folder(tmp_path / "linear", linear, saved.full, heads={
        "task.out_proj.weight": torch.ones(2, linear.model.hidden_size), "task.out_proj.bias": torch.ones(2)})
    with pytest.raises(ConversionError, match="RobertaForSequenceClassification computes model.classifier=pooler, "
                                              "this folder's head is linear; nothing was written"):
        convert("megamlm", "hf", tmp_path / "linear", tmp_path / "out", classifier=SequenceClassifier("task"), **QUIET)
    assert not (tmp_path / "out").exists()


def test_a_model_glue_saved_classifies_dev_rows_in_transformers_as_here(world, tmp_path, capsys):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    cfg = variant_config("baseline", ["model.vocab_size=50265", "model.hidden_size=32", "model.ffn_hidden_size=64",
                                      "model.num_layers=1", "model.max_positions=512"])  # RoBERTa's shape
    model = MaskedLM(cfg.model, init_distributed(ParallelConfig()))
    write_model_folder(tmp_path / "model", cfg, full_state_dict(model))
    report = run_glue(str(tmp_path / "model"), str(GLUE), ["RTE"], [1], str(tmp_path / "glue"),
                      FinetuneOptions(epochs=3, batch_size=4, lr=1e-2, dropout=0.0, save=True), log=lambda *a: None)
    best = report["tasks"]["RTE"]["seeds"][1]["best"]
    args = ["convert", "--from", "megamlm", "--to", "hf", str(tmp_path / "glue/models/RTE"), str(tmp_path / "hf"),
            "--classification-head", "rte"]
    assert cli(args) == 0
    assert "parity vs transformers RobertaForSequenceClassification" in capsys.readouterr().out
    assert json.loads((tmp_path / "hf/config.json").read_text())["id2label"] == {"0": "entailment",
                                                                                 "1": "not_entailment"}
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    dev = read_examples(TASKS["RTE"], GLUE / "RTE/dev.tsv")
    folder = tmp_path / "glue/models/RTE"  # what megamlm glue computes for the same rows
    saved = read_model_folder(folder)
    _, body = encoder_from(saved, folder, world)
    ours = SentenceClassifier(body, 2, seed=1, pretrained=folder_tensors(saved), name="rte").eval()
    ids = encode(dev, Tokenizer.load(saved.cfg.data.tokenizer), 512)
    with torch.no_grad():
        want = classify(ours, ids, 1, "padded", world.device)
        theirs = []
        for example, row in zip(dev, ids):
            inputs = tokenizer(*example.texts, return_tensors="pt")  # <s> A </s></s> B </s>, as megamlm glue
            assert inputs["input_ids"][0].tolist() == row
            theirs.append(model(**inputs).logits[0])
    torch.testing.assert_close(torch.stack(theirs), want, rtol=0, atol=1e-5)
    predicted = [model.config.id2label[int(logits.argmax())] for logits in theirs]
    accuracy = np.mean([label == TASKS["RTE"].labels[example.label] for label, example in zip(predicted, dev)])
    assert accuracy == pytest.approx(best["accuracy"])  # the saved epoch's score
