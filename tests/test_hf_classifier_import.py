"""transformers' *ForSequenceClassification -> a megamlm folder (`megamlm convert --from hf CLS --to megamlm OUT
[--classification-head NAME]`): the encoder and the classification head (no masked-LM head), for RoBERTa, BERT,
ALBERT and ModernBERT. The conversion checks the head's logits against transformers'; a Hub classifier whose
id2label names a GLUE task's labels in another order is reordered, and `megamlm glue --epochs 0` scores the
dev set exactly as transformers classifies it."""

import shutil

import numpy as np
import pytest
import torch

from megamlm.config import ConfigError, replace_config
from megamlm.convert.fairseq import ConversionError
from megamlm.convert.hf_export import SequenceClassifier
from megamlm.convert.pipeline import convert
from megamlm.glue.finetune import FinetuneOptions
from megamlm.glue.run import run_glue
from megamlm.glue.tasks import TASKS, read_examples
from megamlm.model.folder import read_model_folder, write_model_folder
from megamlm.objectives import load_pretrained
from tests.faults_common import run_cli
from tests.test_glue import GLUE
from tests.test_hf_classifier import QUIET, SOURCES

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def as_sequence_classifier(masked_lm, folder, id2label: dict[int, str], **config):
    """A random *ForSequenceClassification of the masked-LM folder's shape and tokenizer (every weight drawn
    nonzero), `id2label` its classes."""
    return as_transformers_class(masked_lm, folder, "AutoModelForSequenceClassification", num_labels=len(id2label),
                                 id2label=id2label, label2id={name: i for i, name in id2label.items()}, **config)


def as_transformers_class(masked_lm, folder, auto: str, **config):
    """A random model of transformers' `auto` class (AutoModel: the bare encoder) with the masked-LM folder's
    shape and tokenizer, every weight drawn nonzero; `config`: config attributes set."""
    import transformers

    values = transformers.AutoConfig.from_pretrained(masked_lm)
    for key, value in config.items():
        setattr(values, key, value)
    torch.manual_seed(3)
    model = getattr(transformers, auto).from_config(values)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (masked_lm / name).is_file():
            shutil.copyfile(masked_lm / name, folder / name)
    return folder


@pytest.mark.parametrize("architecture", sorted(SOURCES))
def test_a_sequence_classifier_imports_with_transformers_logits(world, tmp_path, architecture):
    source = as_sequence_classifier(SOURCES[architecture](tmp_path / "mlm"), tmp_path / "cls",
                                    {0: "a", 1: "b", 2: "c"}, finetuning_task="Task")
    report = convert("hf", "megamlm", source, tmp_path / "megamlm", **QUIET)  # its head: finetuning_task's name
    assert report["max_diff"]["hf source"] < 1e-5 and report["max_diff"]["written megamlm folder"] == 0
    saved = read_model_folder(tmp_path / "megamlm")
    assert saved.heads["task.out_proj.weight"].shape[0] == 3
    assert not any(key.startswith("lm_head.") for key in saved.full)  # a classifier holds no masked-LM head
    assert saved.cfg.model.classifier == ("mlm_head" if architecture == "ModernBert" else "pooler")
    # and back: the same head as transformers' class again
    back = convert("megamlm", "hf", tmp_path / "megamlm", tmp_path / "back",
                   classifier=SequenceClassifier("task", ("a", "b", "c")), **QUIET)
    assert back["max_diff"][f"transformers {architecture}ForSequenceClassification"] < 1e-5
    # what needs the masked-LM head refuses in one line
    with pytest.raises(ConfigError, match="this model folder holds no masked-LM head"):
        load_pretrained(tmp_path / "megamlm", world)
    for src in (source, tmp_path / "megamlm"):
        kind = "hf" if src == source else "megamlm"
        with pytest.raises((ConfigError, ConversionError), match="no masked-LM head"):
            convert(kind, "fairseq", src, tmp_path / "x.pt", **QUIET)
    assert not (tmp_path / "x.pt").exists()


def test_a_hub_rte_classifier_scores_the_dev_set_in_megamlm_glue_as_in_transformers(world, tmp_path, capsys):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    # the classes in the other order than megamlm's RTE (entailment, not_entailment)
    source = as_sequence_classifier(SOURCES["Roberta"](tmp_path / "mlm"), tmp_path / "cls",
                                    {0: "not_entailment", 1: "entailment"})
    code, line = run_cli(capsys, "convert", "--from", "hf", "--to", "megamlm", source, tmp_path / "megamlm")
    assert code == 2 and "without finetuning_task: name its classification head with --classification-head" in line
    capsys.readouterr()
    from megamlm.cli import main as cli

    assert cli(["convert", "--from", "hf", "--to", "megamlm", str(source), str(tmp_path / "megamlm"),
                "--classification-head", "rte"]) == 0
    out = capsys.readouterr().out
    assert "parity vs hf source" in out and "; no masked-LM head; classification head rte" in out
    saved = read_model_folder(tmp_path / "megamlm")
    model = AutoModelForSequenceClassification.from_pretrained(source).eval()
    torch.testing.assert_close(saved.heads["rte.out_proj.weight"], model.classifier.out_proj.weight.flip(0))

    report = run_glue(str(tmp_path / "megamlm"), str(GLUE), ["RTE"], [1], str(tmp_path / "glue"),
                      FinetuneOptions(epochs=0, dropout=0.0), log=lambda *a: None)
    ours = report["tasks"]["RTE"]["seeds"][1]["best"]["accuracy"]
    tokenizer = AutoTokenizer.from_pretrained(source)
    dev = read_examples(TASKS["RTE"], GLUE / "RTE/dev.tsv")
    with torch.no_grad():
        predicted = [model.config.id2label[int(model(**tokenizer(*e.texts, return_tensors="pt")).logits.argmax())]
                     for e in dev]
    theirs = np.mean([label == TASKS["RTE"].labels[e.label] for label, e in zip(predicted, dev)])
    assert ours == pytest.approx(theirs) and 0.3 < theirs < 0.7  # the same predictions, not all one class


def test_mnli_label_names_in_any_case_put_the_rows_in_megamlm_order(world, tmp_path):
    from transformers import BertForSequenceClassification

    source = as_sequence_classifier(SOURCES["Bert"](tmp_path / "mlm"), tmp_path / "cls",
                                    {0: "CONTRADICTION", 1: "NEUTRAL", 2: "ENTAILMENT"}, finetuning_task="mnli")
    convert("hf", "megamlm", source, tmp_path / "megamlm", classifier=SequenceClassifier("mnli", TASKS["MNLI"].labels),
            **QUIET)  # (the conversion's check compares the logits with the columns in that order)
    want = BertForSequenceClassification.from_pretrained(source).classifier.weight[[0, 2, 1]]
    assert TASKS["MNLI"].labels == ("contradiction", "entailment", "neutral")
    assert torch.equal(read_model_folder(tmp_path / "megamlm").heads["mnli.out_proj.weight"], want)


def test_label_names_that_do_not_match_keep_the_rows_and_say_so(world, tmp_path):
    source = as_sequence_classifier(SOURCES["Bert"](tmp_path / "mlm"), tmp_path / "cls", {0: "LABEL_0", 1: "LABEL_1"})
    lines = []
    convert("hf", "megamlm", source, tmp_path / "megamlm", tolerance=1e-5, log=lines.append,
            classifier=SequenceClassifier("rte", ("entailment", "not_entailment")))
    assert any("does not name rte's labels (entailment, not_entailment): the classifier's rows are kept in their "
               "order" in line for line in lines), lines
    from transformers import BertForSequenceClassification

    want = BertForSequenceClassification.from_pretrained(source).classifier.weight
    assert torch.equal(read_model_folder(tmp_path / "megamlm").heads["rte.out_proj.weight"], want)


def test_classification_head_from_hf_needs_a_sequence_classifier(world, tmp_path):
    three = as_sequence_classifier(SOURCES["Roberta"](tmp_path / "mlm3"), tmp_path / "cls3", {0: "a", 1: "b", 2: "c"})
    with pytest.raises(ConversionError, match="its classifier has 3 output\\(s\\), not the 2 labels entailment, "
                                              "not_entailment of rte; nothing was written"):
        convert("hf", "megamlm", three, tmp_path / "out", classifier=SequenceClassifier("rte", TASKS["RTE"].labels),
                **QUIET)
    with pytest.raises(ConversionError, match=r"--classification-head with --from hf: for a "
                                              r"\*ForSequenceClassification folder .* holds BertForMaskedLM"):
        convert("hf", "megamlm", SOURCES["Bert"](tmp_path / "mlm"), tmp_path / "out",
                classifier=SequenceClassifier("rte"), **QUIET)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("architecture,head", [("Electra", "dense_gelu"), ("DistilBert", "dense_relu")])
def test_electra_and_distilbert_classifiers_convert_both_ways_with_transformers_logits(world, tmp_path,
                                                                                       architecture, head):
    """ElectraForSequenceClassification (dense -> GELU, whatever ELECTRA's hidden_act) and
    DistilBertForSequenceClassification (pre_classifier -> ReLU): imported as the encoder and that head (the
    conversion checks the logits against transformers'), exported back as the same class, the same tensors.
    (Their dropout in training: test_glue_heads.py.)"""
    from transformers import AutoModelForSequenceClassification

    from tests.test_electra_hf import save_electra
    from tests.test_hf_distilbert import save_distilbert

    masked = (save_electra(tmp_path / "mlm", hidden_act="gelu_new") if architecture == "Electra"
              else save_distilbert(tmp_path / "mlm"))
    source = as_sequence_classifier(masked, tmp_path / "cls", {0: "a", 1: "b"}, finetuning_task="Task")
    report = convert("hf", "megamlm", source, tmp_path / "megamlm", **QUIET)
    assert report["max_diff"]["hf source"] < 1e-5
    saved = read_model_folder(tmp_path / "megamlm")
    assert saved.cfg.model.classifier == head and sorted(saved.heads) == [
        "task.dense.bias", "task.dense.weight", "task.out_proj.bias", "task.out_proj.weight"]
    back = convert("megamlm", "hf", tmp_path / "megamlm", tmp_path / "back",
                   classifier=SequenceClassifier("task", ("a", "b")), **QUIET)
    assert back["max_diff"][f"transformers {architecture}ForSequenceClassification"] < 1e-5
    theirs = AutoModelForSequenceClassification.from_pretrained(source).state_dict()
    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "back")
    assert type(exported).__name__ == f"{architecture}ForSequenceClassification"
    for key, value in exported.state_dict().items():
        assert torch.equal(value, theirs[key]), key

    # a pooler head on the same encoder is not this class's function: refused in one line
    pooler = replace_config(saved.cfg, ["model.classifier=pooler"])
    write_model_folder(tmp_path / "pooler", pooler, saved.full, heads=saved.heads)
    if architecture == "Electra":
        with pytest.raises(ConversionError, match="ElectraForSequenceClassification computes "
                                                  "model.classifier=dense_gelu, this folder's head is pooler"):
            convert("megamlm", "hf", tmp_path / "pooler", tmp_path / "x", classifier=SequenceClassifier("task"),
                    **QUIET)
    else:  # DistilBERT's shape with tanh is RoBERTa's classifier (as a fine-tuned DistilBERT folder goes out)
        report = convert("megamlm", "hf", tmp_path / "pooler", tmp_path / "x", classifier=SequenceClassifier("task"),
                         **QUIET)
        assert report["max_diff"]["transformers RobertaForSequenceClassification"] < 1e-5
