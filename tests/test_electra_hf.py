"""ELECTRA against transformers: megamlm's generator is `ElectraForMaskedLM` and its discriminator
`ElectraForPreTraining` (BERT-shaped: token types, post-LN, learned positions), given the same weights —
the generator reading the discriminator's embedding module, as the paper ties them. One forward of
megamlm's ElectraModel gives the generator's logits at the masked positions and the discriminator's
logits over the text with the generator's samples in place; transformers' two models give the same
(but for the padding column, which megamlm's generator never predicts)."""

import json

import pytest
import torch

from megamlm.convert.hf import megamlm_to_hf
from megamlm.convert.hf_formats import BERT
from megamlm.model import names
from megamlm.model.embedding import token_types
from megamlm.model.reshard import full_state_dict
from megamlm.objectives import get_objective
from tests.variants import variant_config

GENERATOR_HEAD = {"bert.": "electra.", "cls.predictions.transform.": "generator_predictions.",
                  "cls.predictions.decoder.": "generator_lm_head."}
"""BertForMaskedLM's key prefixes -> ElectraForMaskedLM's."""


def _as_electra(bert_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in bert_state.items():
        for bert, electra in GENERATOR_HEAD.items():
            if key.startswith(bert):
                out[electra + key.removeprefix(bert)] = value
    return out


def test_electra_is_transformers_generator_and_discriminator(world):
    from transformers import ElectraConfig, ElectraForMaskedLM, ElectraForPreTraining

    cfg = variant_config("bert", ["objective.name=electra", "objective.generator_size=0.5",
                                  "model.hidden_dropout=0", "model.attention_dropout=0"])
    objective = get_objective(cfg)
    model = objective.build_model(world).eval()
    with torch.no_grad():  # every weight nonzero: biases and norms too
        for param in model.parameters():
            param.normal_(0, 0.2)
    m, g = cfg.model, objective.generator
    full = full_state_dict(model)
    vocab = m.vocab_size
    full = {k: v[:vocab] if k in (names.WORD_EMBEDDINGS, "generator.lm_head.bias") else v for k, v in full.items()}
    shared = {k: v for k, v in full.items() if k.startswith("embedding.")}

    def config(model, **extra):
        return ElectraConfig(vocab_size=vocab, embedding_size=m.hidden_size, hidden_size=model.hidden_size,
                             num_hidden_layers=model.num_layers, num_attention_heads=model.num_attention_heads,
                             intermediate_size=model.ffn_hidden_size, max_position_embeddings=m.max_positions,
                             type_vocab_size=2, layer_norm_eps=m.layernorm_epsilon, pad_token_id=m.pad_token_id,
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **extra)

    discriminator = ElectraForPreTraining(config(m)).eval()
    body = megamlm_to_hf({**{k: v for k, v in full.items() if not k.startswith("generator.")},
                          names.LM_HEAD_BIAS: torch.zeros(vocab)}, m, BERT)
    state = {key: value for key, value in _as_electra(body).items() if key.startswith("electra.")}
    state.update({f"discriminator_predictions.{theirs}.{k}": full[f"discriminator_head.{ours}.{k}"]
                  for ours, theirs in (("dense", "dense"), ("prediction", "dense_prediction"))
                  for k in ("weight", "bias")})
    assert not [k for k in discriminator.load_state_dict(state, strict=False).missing_keys if "position_ids" not in k]

    generator = ElectraForMaskedLM(config(g)).eval()  # embedding_size 64 -> hidden 32: embeddings_project
    own = {k.removeprefix("generator."): v for k, v in full.items() if k.startswith("generator.")}
    state = _as_electra(megamlm_to_hf({**shared, **own}, g, BERT))
    state.update({f"electra.embeddings_project.{k}": own[f"embedding_projection.{k}"] for k in ("weight", "bias")})
    state["generator_lm_head.bias"] = own[names.LM_HEAD_BIAS]
    assert not [k for k in generator.load_state_dict(state, strict=False).missing_keys if "position_ids" not in k]

    torch.manual_seed(0)
    original = torch.randint(4, vocab - 1, (3, 24))
    original[:, 0], original[:, 10], original[:, -1] = 0, 2, 2  # [CLS] A [SEP] B [SEP]: both token types
    original[2, 16:] = m.pad_token_id
    original[2, 15] = 2
    target_index = torch.tensor([3, 7, 12, 24 + 5, 24 + 20, 48 + 2, 48 + 13])  # flat (b, s) positions
    inputs = original.flatten().index_fill(0, target_index, vocab - 1).view_as(original)  # the mask id
    with torch.no_grad():
        out = model(inputs, original, target_index, sampling_seed=7)
        attention = inputs.ne(m.pad_token_id).long()
        theirs = generator(input_ids=inputs, attention_mask=attention, token_type_ids=token_types(inputs, m)).logits
        ours, theirs = out.generator_logits[:, :vocab], theirs.flatten(0, 1)[target_index]  # [n, V]
        # the one difference: megamlm's generator never predicts (nor samples) padding
        assert ours[:, m.pad_token_id].eq(float("-inf")).all()
        keep = torch.arange(vocab) != m.pad_token_id
        torch.testing.assert_close(ours[:, keep], theirs[:, keep], rtol=0, atol=2e-5)
        assert not out.corrupted.flatten()[target_index].eq(m.pad_token_id).any()
        theirs = discriminator(input_ids=out.corrupted, attention_mask=attention,
                               token_type_ids=token_types(out.corrupted, m)).logits
    real = attention.bool()
    torch.testing.assert_close(out.discriminator_logits[real], theirs[real], rtol=0, atol=2e-5)


def save_electra(folder, heads: int = 4, seed: int = 0, hidden_act: str = "gelu"):
    """A random ElectraForPreTraining (E = 32 != H = 48: embeddings_project; both token types) and its
    WordPiece tokenizer (BERT's vocabulary and specials)."""
    from transformers import ElectraConfig, ElectraForPreTraining

    from tests.test_hf_bert_albert import VOCAB, save_with_wordpiece

    torch.manual_seed(seed)
    config = ElectraConfig(vocab_size=len(VOCAB), embedding_size=32, hidden_size=48, num_hidden_layers=2,
                           num_attention_heads=heads, intermediate_size=96, max_position_embeddings=40,
                           type_vocab_size=2, pad_token_id=0, hidden_act=hidden_act)
    return save_with_wordpiece(ElectraForPreTraining(config), folder)


@pytest.mark.parametrize("tp,hidden_act", [(1, "gelu"), (2, "gelu_new")])  # the head's activation is hidden_act
def test_an_electra_discriminator_imports_with_transformers_logits(world, tmp_path, tp, hidden_act, capsys):
    from transformers import AutoTokenizer, ElectraForPreTraining

    from megamlm.cli import main as cli
    from megamlm.config import replace_config
    from megamlm.convert.parity import megamlm_logits
    from megamlm.convert.pipeline import convert
    from megamlm.data.tokenizer import Tokenizer
    from megamlm.glue.finetune import SentenceClassifier, classify
    from megamlm.model.folder import read_model_folder
    from megamlm.objectives import load_encoder
    from megamlm.train.loop import init_from_folder
    from tests.faults_common import one_line
    from tests.test_modernbert import QUIET

    source = save_electra(tmp_path / "hf", hidden_act=hidden_act)
    report = convert("hf", "megamlm", source, tmp_path / "megamlm", tp=tp, **QUIET)
    assert report["max_diff"]["hf source"] < 1e-5
    saved = read_model_folder(tmp_path / "megamlm")
    cfg, m = saved.cfg, saved.cfg.model
    assert (cfg.objective.name, m.classifier, m.embedding_size, m.token_types, m.hidden_size) == (
        "electra", "linear", 32, 2, 48)
    assert not any(k.startswith("generator.") for k in saved.full)
    # a sentence pair through transformers' own tokenizer: the discriminator's logit at every token
    inputs = AutoTokenizer.from_pretrained(source)("the fox and the dog", "run to the river bank", return_tensors="pt")
    with torch.no_grad():
        want = ElectraForPreTraining.from_pretrained(source).eval()(**inputs).logits
    order = torch.from_numpy(Tokenizer.load(cfg.data.tokenizer).vocab_order)  # megamlm id -> theirs
    ours = torch.argsort(order)[inputs["input_ids"]]
    assert torch.equal(token_types(ours, m), inputs["token_type_ids"])
    torch.testing.assert_close(megamlm_logits(cfg, saved.full, ours), want, rtol=0, atol=1e-5)
    # fine-tuning reads the discriminator's encoder; continued pretraining adds a new generator
    _, body = load_encoder(tmp_path / "megamlm", world)
    logits = classify(SentenceClassifier(body, 3, seed=1), [ours[0].tolist()], m.pad_token_id, "packed", world.device)
    assert logits.shape == (1, 3)
    cfg = replace_config(cfg, ["parallel.tensor_parallel=1"])  # this world's (a TP=2 folder loads at TP=1)
    objective = get_objective(cfg)
    model = objective.build_model(world)
    init_from_folder(model, cfg, str(tmp_path / "megamlm"), objective)
    assert torch.equal(model.discriminator_head.prediction.weight, saved.full["discriminator_head.prediction.weight"])
    assert model.generator is not None
    # and back to transformers' class; fairseq has no ELECTRA: one line, nothing written
    back = convert("megamlm", "hf", tmp_path / "megamlm", tmp_path / "back", **QUIET)
    assert back["max_diff"]["transformers ElectraForPreTraining"] < 1e-5
    assert json.loads((tmp_path / "back/config.json").read_text())["architectures"] == ["ElectraForPreTraining"]
    with torch.no_grad():
        torch.testing.assert_close(ElectraForPreTraining.from_pretrained(tmp_path / "back").eval()(**inputs).logits,
                                   want, rtol=0, atol=1e-5)
    capsys.readouterr()
    out = tmp_path / "model.pt"
    assert cli(["convert", "--from", "megamlm", "--to", "fairseq", str(tmp_path / "megamlm"), str(out)]) == 2
    line = one_line(capsys.readouterr().err)
    assert "objective.name=electra: conversion to fairseq" in line and "(this one converts to megamlm, hf)" in line
    assert not out.exists()
