"""XLM-R (and any RoBERTa with a vocabulary of its own in a tokenizer.json) through `megamlm convert --from hf`:
RoBERTa's model with a SentencePiece tokenizer whose ids are fairseq's order (<s> <pad> </s> <unk> ... <mask>).
The tokenizer travels with the model; megamlm's ids, its `<s> A </s></s> B </s>` pairs and its logits are
transformers' (XLMRobertaTokenizer, XLMRobertaForMaskedLM), at TP=1 and TP=2, and the folder goes back as
XLMRobertaForMaskedLM."""

import json

import pytest
import torch

from megamlm.convert.fairseq import ConversionError
from megamlm.convert.parity import megamlm_logits
from megamlm.convert.pipeline import convert, read_megamlm
from megamlm.data.tokenizer import Tokenizer
from megamlm.glue.finetune import encode
from megamlm.glue.tasks import TASKS, Example
from tests.test_hf_bert_albert import ALBERT_VOCAB
from tests.test_hf_import import save_roberta
from tests.test_modernbert import QUIET

VOCAB = ["<s>", "<pad>", "</s>", "<unk>"] + ALBERT_VOCAB[5:] + ["<mask>"]
"""The ALBERT tests' SentencePiece pieces with XLM-R's specials (fairseq's places)."""
TEXT_A, TEXT_B = "the fox and the dog", "run to the river bank"


def save_xlmr(folder, heads: int = 3):
    """A random XLMRobertaForMaskedLM (every weight nonzero) and its SentencePiece (Unigram) XLMRobertaTokenizer."""
    from transformers import XLMRobertaTokenizer

    save_roberta(folder, heads, architecture="XLMRoberta", vocab_size=len(VOCAB))
    scores = [(piece, 0.0 if piece.startswith("<") else -1.0 - len(piece) * 0.1) for piece in VOCAB]
    XLMRobertaTokenizer(vocab=scores).save_pretrained(folder)
    return folder


def _transformers(folder):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    inputs = AutoTokenizer.from_pretrained(folder)(TEXT_A, TEXT_B, return_tensors="pt")
    with torch.no_grad():
        logits = AutoModelForMaskedLM.from_pretrained(folder, attn_implementation="eager").eval()(**inputs).logits
    return inputs["input_ids"], logits


@pytest.mark.parametrize("heads,tp", [(3, 1), (6, 2)])
def test_xlm_r_converts_both_ways_with_transformers_ids_and_logits(world, tmp_path, heads, tp):
    source = save_xlmr(tmp_path / "hf", heads)
    report = convert("hf", "megamlm", source, tmp_path / "megamlm", tp=tp, **QUIET)
    assert report["max_diff"]["hf source"] < 1e-5
    model = read_megamlm(tmp_path / "megamlm")
    assert model.cfg.model.vocab_size == len(VOCAB) and model.cfg.model.token_types == 0
    tokenizer = Tokenizer.load(model.cfg.data.tokenizer)
    assert tokenizer.vocab_order.tolist() == list(range(len(VOCAB)))  # fairseq's order already
    # transformers' tokenizer and megamlm's give the same pair (GLUE's encoding), and the same logits
    ids, want = _transformers(source)
    example = Example(texts=(TEXT_A, TEXT_B), label=0)
    assert encode([example], tokenizer, 64)[0] == ids[0].tolist()  # <s> A </s></s> B </s>
    torch.testing.assert_close(megamlm_logits(model.cfg, model.full, ids), want, rtol=0, atol=1e-5)
    # back to transformers: XLMRobertaForMaskedLM again, the same tokenizer and logits
    back = convert("megamlm", "hf", tmp_path / "megamlm", tmp_path / "back", **QUIET)
    assert back["max_diff"]["transformers XLMRobertaForMaskedLM"] < 1e-5
    assert json.loads((tmp_path / "back/config.json").read_text())["architectures"] == ["XLMRobertaForMaskedLM"]
    ids_back, logits_back = _transformers(tmp_path / "back")
    assert torch.equal(ids_back, ids)
    torch.testing.assert_close(logits_back, want, rtol=0, atol=1e-5)


def test_an_xlm_r_classifier_imports_too(world, tmp_path):
    from tests.test_hf_classifier_import import as_sequence_classifier

    source = as_sequence_classifier(save_xlmr(tmp_path / "mlm"), tmp_path / "cls", dict(enumerate(TASKS["RTE"].labels)),
                                    finetuning_task="rte")
    report = convert("hf", "megamlm", source, tmp_path / "megamlm", **QUIET)
    assert report["max_diff"]["hf source"] < 1e-5
    assert read_megamlm(tmp_path / "megamlm").heads["rte.out_proj.weight"].shape[0] == 2


def test_a_roberta_of_another_vocabulary_needs_its_tokenizer(world, tmp_path):
    source = save_xlmr(tmp_path / "hf")
    (source / "tokenizer.json").unlink()
    with pytest.raises(ConversionError, match=rf"no tokenizer\.json: XLMRobertaForMaskedLM folders need the tokenizer "
                                              rf"of their vocabulary \(vocab_size={len(VOCAB)}, not roberta-base's"):
        convert("hf", "megamlm", source, tmp_path / "out", **QUIET)
    assert not (tmp_path / "out").exists()


CAMEMBERT_VOCAB = (["<s>NOTUSED", "<pad>", "</s>NOTUSED", "<unk>", "<unk>NOTUSED", "<s>", "</s>"] + ALBERT_VOCAB[5:]
                   + ["<mask>"])
"""CamemBERT's layout: its <s> and </s> at rows 5 and 6, rows 0, 2 and 4 unused."""


def test_camembert_moves_its_specials_and_goes_back(world, tmp_path):
    from transformers import CamembertTokenizer

    save_roberta(tmp_path / "hf", architecture="Camembert", vocab_size=len(CAMEMBERT_VOCAB))
    scores = [(piece, 0.0 if piece.startswith("<") else -1.0 - len(piece) * 0.1) for piece in CAMEMBERT_VOCAB]
    CamembertTokenizer(vocab=scores).save_pretrained(tmp_path / "hf")
    assert convert("hf", "megamlm", tmp_path / "hf", tmp_path / "megamlm", **QUIET)["max_diff"]["hf source"] < 1e-5
    model = read_megamlm(tmp_path / "megamlm")
    tokenizer = Tokenizer.load(model.cfg.data.tokenizer)
    assert tokenizer.vocab_order[:5].tolist() == [5, 1, 6, 3, 0]  # <s> <pad> </s> <unk>, then the unused rows
    ids, want = _transformers(tmp_path / "hf")
    ours = torch.argsort(torch.from_numpy(tokenizer.vocab_order))[ids]
    assert encode([Example(texts=(TEXT_A, TEXT_B), label=0)], tokenizer, 64)[0] == ours[0].tolist()
    back = convert("megamlm", "hf", tmp_path / "megamlm", tmp_path / "back", **QUIET)
    assert back["max_diff"]["transformers CamembertForMaskedLM"] < 1e-5
    config = json.loads((tmp_path / "back/config.json").read_text())
    assert (config["architectures"], config["bos_token_id"], config["eos_token_id"]) == (["CamembertForMaskedLM"], 5, 6)
    ids_back, logits_back = _transformers(tmp_path / "back")
    assert torch.equal(ids_back, ids)
    torch.testing.assert_close(logits_back, want, rtol=0, atol=1e-5)
