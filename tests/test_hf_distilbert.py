"""DistilBERT through `megamlm convert --from/--to hf`: BERT's post-LN encoder without token types, its own key
and config names (dim, n_layers, q_lin, sa_layer_norm, vocab_projector, ...), BERT's WordPiece vocabulary. A
random DistilBertForMaskedLM gives transformers' logits at TP=1/2 in both directions, also through
transformers' own tokenizer on a sentence pair, and continued pretraining starts from it."""

import json

import pytest
import torch

from megamlm.convert.hf import ACTIVATIONS
from megamlm.convert.parity import megamlm_logits
from megamlm.convert.pipeline import convert, read_megamlm
from megamlm.data.tokenizer import Tokenizer
from megamlm.glue.finetune import encode
from megamlm.glue.tasks import Example
from tests.test_hf_bert_albert import VOCAB, save_with_wordpiece
from tests.test_modernbert import QUIET

TEXT_A, TEXT_B = "the fox and the dog", "run to the river bank"


def save_distilbert(folder, heads: int = 3, activation: str = "gelu"):
    """A random DistilBertForMaskedLM (every weight nonzero) with BERT's WordPiece tokenizer."""
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    torch.manual_seed(0)
    config = DistilBertConfig(vocab_size=len(VOCAB), dim=48, n_layers=2, n_heads=heads, hidden_dim=96,
                              max_position_embeddings=40, activation=activation, pad_token_id=0)
    return save_with_wordpiece(DistilBertForMaskedLM(config), folder)


def _transformers(folder):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    inputs = AutoTokenizer.from_pretrained(folder)(TEXT_A, TEXT_B, return_tensors="pt")
    with torch.no_grad():
        logits = AutoModelForMaskedLM.from_pretrained(folder, attn_implementation="eager").eval()(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    return inputs["input_ids"], logits


@pytest.mark.parametrize("heads,tp,activation", [(3, 1, "gelu"), (6, 2, "gelu_new")])
def test_distilbert_converts_both_ways_with_transformers_logits(world, tmp_path, heads, tp, activation):
    source = save_distilbert(tmp_path / "hf", heads, activation)
    report = convert("hf", "megamlm", source, tmp_path / "megamlm", tp=tp, **QUIET)
    assert report["max_diff"]["hf source"] < 1e-5
    model = read_megamlm(tmp_path / "megamlm")
    m = model.cfg.model
    assert (m.hidden_size, m.num_layers, m.num_attention_heads, m.ffn_hidden_size, m.token_types, m.layernorm_epsilon,
            m.activation, m.max_positions) == (48, 2, heads, 96, 0, 1e-12, ACTIVATIONS[activation], 40)
    # transformers' tokenizer gives megamlm's pair (GLUE's encoding) in its own ids, and the same logits
    tokenizer = Tokenizer.load(model.cfg.data.tokenizer)
    order = torch.from_numpy(tokenizer.vocab_order)  # megamlm id -> theirs
    ids, want = _transformers(source)
    ours = torch.argsort(order)[ids]
    assert encode([Example(texts=(TEXT_A, TEXT_B), label=0)], tokenizer, 64)[0] == ours[0].tolist()
    torch.testing.assert_close(megamlm_logits(model.cfg, model.full, ours), want[..., order], rtol=0, atol=1e-5)
    # back: DistilBertForMaskedLM with its config names, the same logits from its own tokenizer
    back = convert("megamlm", "hf", tmp_path / "megamlm", tmp_path / "back", **QUIET)
    assert back["max_diff"]["transformers DistilBertForMaskedLM"] < 1e-5
    config = json.loads((tmp_path / "back/config.json").read_text())
    assert config["architectures"] == ["DistilBertForMaskedLM"]
    assert (config["dim"], config["n_layers"], config["activation"]) == (48, 2, activation)
    assert "layer_norm_eps" not in config and "type_vocab_size" not in config
    ids_back, logits_back = _transformers(tmp_path / "back")
    assert torch.equal(ids_back, ids)
    torch.testing.assert_close(logits_back, want, rtol=0, atol=1e-5)


def test_continued_pretraining_of_distilbert_starts_at_transformers_loss(world, tmp_path):
    """The first masked batch's loss in megamlm's training forward equals transformers' MLM loss on it."""
    from transformers import DistilBertForMaskedLM

    from megamlm.objectives import load_pretrained

    source = save_distilbert(tmp_path / "hf")
    convert("hf", "megamlm", source, tmp_path / "megamlm", **QUIET)
    cfg, model = load_pretrained(tmp_path / "megamlm", world)
    ids, _ = _transformers(source)
    order = torch.from_numpy(Tokenizer.load(cfg.data.tokenizer).vocab_order)
    original = torch.argsort(order)[ids]
    target_index = torch.tensor([2, 5, 9])  # flat positions
    masked = original.flatten().index_fill(0, target_index, cfg.model.vocab_size - 1).view_as(original)
    with torch.no_grad():
        ours = model(masked, target_index, targets=original.flatten()[target_index]) / len(target_index)
        labels = torch.full_like(ids, -100).flatten().index_copy(0, target_index, ids.flatten()[target_index])
        theirs = DistilBertForMaskedLM.from_pretrained(source).eval()(input_ids=order[masked],
                                                                     labels=labels.view_as(ids)).loss
    torch.testing.assert_close(ours.float().reshape(()), theirs, rtol=0, atol=1e-5)


def test_fill_mask_reads_berts_own_mask_name(world, tmp_path, capsys):
    from megamlm.fill_mask import fill_mask
    from megamlm.objectives import load_pretrained
    from tests.faults_common import run_cli

    convert("hf", "megamlm", save_distilbert(tmp_path / "hf"), tmp_path / "megamlm", **QUIET)
    cfg, model = load_pretrained(tmp_path / "megamlm", world)
    tokenizer = Tokenizer.load(cfg.data.tokenizer)
    theirs = fill_mask(model, tokenizer, "the fox and the [MASK] run", topk=3)
    assert theirs == fill_mask(model, tokenizer, "the fox and the <mask> run", topk=3)
    assert [filled.split()[4] for filled, _, _ in theirs] == [word.strip() for _, _, word in theirs]
    code, line = run_cli(capsys, "fill-mask", tmp_path / "megamlm", "the fox and the dog")
    assert code == 2 and line == "megamlm: fill-mask: the text has no <mask> or [MASK]: 'the fox and the dog'"


def test_a_fine_tuned_distilbert_exports_its_classifier_as_robertas(world, tmp_path):
    """DistilBERT's own classifier (ReLU) is not megamlm's pooler (tanh): a model `megamlm glue --save` fine-tuned
    from a DistilBERT folder goes out as RobertaForSequenceClassification (the same function), not as a crash."""
    from megamlm.convert.hf_export import SequenceClassifier
    from megamlm.glue.finetune import FinetuneOptions
    from megamlm.glue.run import run_glue
    from tests.test_glue import GLUE

    convert("hf", "megamlm", save_distilbert(tmp_path / "hf"), tmp_path / "megamlm", **QUIET)
    run_glue(str(tmp_path / "megamlm"), str(GLUE), ["RTE"], [1], str(tmp_path / "glue"),
             FinetuneOptions(epochs=1, batch_size=4, dropout=0.0, save=True), max_train=8, log=lambda *a: None)
    report = convert("megamlm", "hf", tmp_path / "glue/models/RTE", tmp_path / "out",
                     classifier=SequenceClassifier("rte", ("entailment", "not_entailment")), **QUIET)
    assert report["max_diff"]["transformers RobertaForSequenceClassification"] < 1e-5
    # its masked LM still goes out as DistilBERT
    assert convert("megamlm", "hf", tmp_path / "megamlm", tmp_path / "mlm", **QUIET)["max_diff"][
        "transformers DistilBertForMaskedLM"] < 1e-5
