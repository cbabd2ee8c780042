"""Fine-tuning heads (objectives/classification.py) against transformers: a ModernBERT folder fine-tunes with
ModernBertForSequenceClassification's head (the pretrained MLM head's transform + a classifier), on the
first token's or the mean features, with its logits in one-row-per-sequence and packed batches, and
its fresh classifier drawn as transformers draws it; BERT and ALBERT pretraining checkpoints keep their
pooler, and fine-tune from it as Bert/AlbertForSequenceClassification do."""

import json

import numpy as np
import pytest
import torch

from megamlm.convert.pipeline import convert
from megamlm.data.tokenizer import Tokenizer
from megamlm.glue.finetune import FinetuneOptions, SentenceClassifier, classify
from megamlm.objectives.classification import Pooling
from megamlm.glue.run import config_overrides, folder_tensors
from megamlm.model.embedding import token_types
from megamlm.model.encoder import Encoder
from megamlm.model.folder import read_model_folder
from megamlm.objectives import encoder_from, load_encoder
from tests.test_glue import GLUE, tiny_folder  # noqa: F401  (a fixture)
from tests.test_hf_bert_albert import save_albert, save_bert
from tests.test_modernbert import QUIET, save_modernbert
from tests.variants import variant_config

LENGTHS = (30, 5, 12, 22, 3, 17, 9)  # several longer than the 16-token window


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_a_modernbert_folder_classifies_as_transformers_does(world, tmp_path, pooling):
    from transformers import ModernBertForSequenceClassification

    source = save_modernbert(tmp_path / "hf", classifier_pooling=pooling)
    convert("hf", "megamlm", source, tmp_path / "megamlm", **QUIET)
    saved = read_model_folder(tmp_path / "megamlm")
    assert (saved.cfg.model.classifier, saved.cfg.model.classifier_pooling) == ("mlm_head", pooling)
    _, body = encoder_from(saved, tmp_path / "megamlm", world)
    ours = SentenceClassifier(body, 3, seed=1, pretrained=saved.full).eval()
    assert ours.pretrained == ["lm_head.dense.weight", "lm_head.layernorm.weight"]  # no biases in ModernBERT
    theirs = ModernBertForSequenceClassification.from_pretrained(source, num_labels=3, attn_implementation="eager")
    theirs = theirs.float().eval()
    # transformers starts `head` from the masked-LM checkpoint's, as megamlm does; the classifier is new
    for mine, other in ((ours.head.dense, theirs.head.dense), (ours.head.layernorm, theirs.head.norm)):
        assert torch.equal(mine.weight, other.weight)
    theirs.classifier.load_state_dict(ours.head.out_proj.state_dict())

    order = torch.from_numpy(Tokenizer.load(saved.cfg.data.tokenizer).vocab_order)  # megamlm id -> theirs
    rng = np.random.default_rng(0)
    sequences = [[0, *rng.integers(4, 290, n).tolist(), 2] for n in LENGTHS]  # <s> = [CLS], </s> = [SEP]
    tokens = torch.full((len(sequences), max(map(len, sequences))), 1)
    for row, ids in enumerate(sequences):
        tokens[row, :len(ids)] = torch.tensor(ids)
    with torch.no_grad():
        want = theirs(input_ids=order[tokens], attention_mask=tokens.ne(1).long()).logits
        for packing in ("padded", "packed"):
            got = classify(ours, sequences, 1, packing, world.device)
            torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    back = convert("megamlm", "hf", tmp_path / "megamlm", tmp_path / "back", **QUIET)
    assert back["max_diff"]["transformers ModernBertForMaskedLM"] < 1e-5
    assert (tmp_path / "back/config.json").read_text().count(f'"classifier_pooling": "{pooling}"') == 1


def test_a_fresh_modernbert_classifier_is_drawn_as_transformers_draws_it(world):
    # the modernbert init: the transform's dense layer as the MLM head's (σ / sqrt(2 L)), the
    # classifier with σ = h^-0.5 (transformers' "final_out"), both cut at 2σ; compared with the
    # draws of ModernBertForSequenceClassification's own initialization at the same shape
    from transformers import ModernBertConfig, ModernBertForSequenceClassification

    cfg = variant_config("modernbert", ["model.hidden_size=256", "model.ffn_hidden_size=384"])
    m = cfg.model
    ours = SentenceClassifier(Encoder(m, world, seed=1), 8, seed=1)  # no folder: nothing to start from
    assert ours.pretrained == []
    torch.manual_seed(0)
    theirs = ModernBertForSequenceClassification(ModernBertConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads, num_labels=8,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, cls_token_id=0, sep_token_id=2))
    for mine, other, std in ((ours.head.dense.weight, theirs.head.dense.weight, 0.02 / (2 * m.num_layers) ** 0.5),
                             (ours.head.out_proj.weight, theirs.classifier.weight, m.hidden_size ** -0.5)):
        assert mine.abs().max() <= 2 * std and other.abs().max() <= 2 * std
        assert mine.std().item() == pytest.approx(other.std().item(), rel=0.08)  # 0.88 σ: a normal cut at 2σ
        assert mine.std().item() == pytest.approx(0.8796 * std, rel=0.08)
    assert not ours.head.out_proj.bias.any()


@pytest.mark.parametrize("variant", ["baseline", "modernbert"])
def test_mean_pooling_gives_each_sequence_its_padded_logits_when_packed(world, variant):
    cfg = variant_config(variant, ["model.classifier_pooling=mean"])
    model = SentenceClassifier(Encoder(cfg.model, world, seed=3), num_classes=2, seed=1).eval()
    rng = np.random.default_rng(1)
    sequences = [[0, *rng.integers(4, 1000, n).tolist(), 2] for n in LENGTHS]
    with torch.no_grad():
        padded = classify(model, sequences, 1, "padded", world.device)
        packed = classify(model, sequences, 1, "packed", world.device)
        one = torch.cat([classify(model, [ids], 1, "padded", world.device) for ids in sequences])
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-5)
    torch.testing.assert_close(padded, one, rtol=0, atol=1e-5)  # padding does not enter the mean


def test_pooling_places_each_sequence():
    hidden = torch.arange(2 * 4 * 1, dtype=torch.float).reshape(2, 4, 1).transpose(0, 1)  # [s=4, b=2, h=1]
    starts = torch.tensor([4, 0, 2])  # row 1 from 0; row 0 from 0 and from 2
    assert Pooling.of(starts, [3, 2, 2], 8, "cls")(hidden).flatten().tolist() == [4, 0, 2]
    # row 0 holds 0 1 2 3, row 1 holds 4 5 6 7: means of (4 5 6), (0 1), (2 3); position 7 is padding
    assert Pooling.of(starts, [3, 2, 2], 8, "mean")(hidden).flatten().tolist() == [5, 0.5, 2.5]


def test_mean_pooling_gradient_reaches_each_sequence_s_tokens_only():
    """Mean pooling is a matmul (deterministic on a GPU, unlike index_add_): each position's gradient is
    its sequence's output gradient over the sequence's length, and padding gets none."""
    hidden = torch.randn(4, 2, 3, requires_grad=True)  # [s=4, b=2, h=3]
    upstream = torch.tensor([[1.0, 2, 3], [4, 5, 6], [7, 8, 9]])
    Pooling.of(torch.tensor([4, 0, 2]), [3, 2, 2], 8, "mean")(hidden).backward(upstream)
    want = torch.zeros(2, 4, 3)  # [b, s, h]
    want[1, :3], want[0, :2], want[0, 2:] = upstream[0] / 3, upstream[1] / 2, upstream[2] / 2
    torch.testing.assert_close(hidden.grad, want.transpose(0, 1), rtol=0, atol=1e-7)


def test_fine_tuning_a_modernbert_folder_starts_from_its_mlm_head(world, tmp_path):
    from megamlm.glue.run import run_task

    convert("hf", "megamlm", save_modernbert(tmp_path / "hf", classifier_pooling="mean"), tmp_path / "megamlm",
            **QUIET)
    lines = []
    result = run_task(str(tmp_path / "megamlm"), str(GLUE), "RTE", [1], FinetuneOptions(epochs=1, batch_size=4),
                      max_train=8, max_eval=None, ctx=world, log=lines.append)
    assert lines[0] == ("RTE: classifier mlm_head on mean features, started from lm_head.dense.weight, "
                        "lm_head.layernorm.weight")
    assert np.isfinite(result["seeds"][1]["epochs"][0]["train_loss"])


def test_glue_folders_without_an_mlm_head_draw_it(world, tmp_path):
    # a CLAP head has no transform to start from: the mlm_head classifier is drawn, and says so
    cfg = variant_config("learned-clap", ["model.classifier=mlm_head"])
    folder = {"lm_head.bias": torch.zeros(cfg.model.vocab_size)}  # what a CLAP folder has of lm_head
    model = SentenceClassifier(Encoder(cfg.model, world, seed=1), 2, seed=1, pretrained=folder)
    assert model.pretrained == []
    assert model.head.dense.weight.std().item() == pytest.approx(cfg.model.init_std, rel=0.05)  # bert init


def _padded(sequences: list[list[int]], pad: int = 1) -> torch.Tensor:
    tokens = torch.full((len(sequences), max(map(len, sequences))), pad)
    for row, ids in enumerate(sequences):
        tokens[row, :len(ids)] = torch.tensor(ids)
    return tokens


@pytest.mark.parametrize("architecture", ["BertForPreTraining", "AlbertForPreTraining"])
def test_bert_and_albert_checkpoints_fine_tune_from_their_pretrained_pooler(world, tmp_path, architecture):
    from transformers import AutoModelForSequenceClassification

    bert = architecture.startswith("Bert")
    source = (save_bert if bert else save_albert)(tmp_path / "hf", pretraining=True)
    if not bert:  # the Hub's albert-base-v2 names the masked-LM class but holds the pretraining weights
        config = json.loads((source / "config.json").read_text())
        (source / "config.json").write_text(json.dumps({**config, "architectures": ["AlbertForMaskedLM"]}))
    convert("hf", "megamlm", source, tmp_path / "megamlm", **QUIET)
    saved = read_model_folder(tmp_path / "megamlm")
    kind = "nsp" if bert else "sop"
    assert sorted(saved.heads) == [f"{kind}.{part}.{k}" for part in ("dense", "out_proj") for k in ("bias", "weight")]
    _, body = encoder_from(saved, tmp_path / "megamlm", world)
    ours = SentenceClassifier(body, 3, seed=1, pretrained=folder_tensors(saved)).eval()
    assert ours.pretrained == [f"classification_heads.{kind}.dense.{k}" for k in ("weight", "bias")]
    theirs = AutoModelForSequenceClassification.from_pretrained(source, num_labels=3, attn_implementation="eager")
    theirs = theirs.float().eval()
    pooler = theirs.bert.pooler.dense if bert else theirs.albert.pooler
    assert torch.equal(ours.head.dense.weight, pooler.weight)  # both start from the checkpoint's pooler
    theirs.classifier.load_state_dict(ours.head.out_proj.state_dict())

    order = torch.from_numpy(Tokenizer.load(saved.cfg.data.tokenizer).vocab_order)  # megamlm id -> theirs
    vocab = saved.cfg.model.vocab_size
    rng = np.random.default_rng(0)
    sequences = [[0, *rng.integers(4, vocab - 1, a).tolist(), 2, *rng.integers(4, vocab - 1, b).tolist(), 2]
                 for a, b in ((5, 9), (12, 3), (2, 20), (7, 7))]  # [CLS] A [SEP] B [SEP]
    tokens = _padded(sequences)
    with torch.no_grad():
        want = theirs(input_ids=order[tokens], attention_mask=tokens.ne(1).long(),
                      token_type_ids=token_types(tokens, saved.cfg.model)).logits
        for packing in ("padded", "packed"):
            torch.testing.assert_close(classify(ours, sequences, 1, packing, world.device), want, rtol=0, atol=2e-5)
    # and back: the pretraining class again, whose sequence classifier starts from the same pooler
    convert("megamlm", "hf", tmp_path / "megamlm", tmp_path / "back", **QUIET)
    assert json.loads((tmp_path / "back/config.json").read_text())["architectures"] == [architecture]
    again = AutoModelForSequenceClassification.from_pretrained(tmp_path / "back", num_labels=3)
    assert torch.equal((again.bert.pooler.dense if bert else again.albert.pooler).weight, pooler.weight)


def test_a_sentence_pair_model_keeps_its_pooler_through_conversion(world, tmp_path):
    # a folder trained with NSP holds pair_head.*; converted, it is a masked-LM folder whose
    # classification head `nsp` is the pair head: fine-tuning starts from the same pooler either way
    from megamlm.model.folder import write_model_folder
    from megamlm.objectives import get_objective
    from megamlm.model.reshard import full_state_dict

    cfg = variant_config("bert", ["objective.name=nsp"])
    model = get_objective(cfg).build_model(world)
    write_model_folder(tmp_path / "nsp", cfg, full_state_dict(model))
    convert("megamlm", "megamlm", tmp_path / "nsp", tmp_path / "mlm", **QUIET)
    trained, converted = read_model_folder(tmp_path / "nsp"), read_model_folder(tmp_path / "mlm")
    assert converted.cfg.objective.name == "mlm" and not any(k.startswith("pair_head") for k in converted.full)
    assert torch.equal(converted.heads["nsp.out_proj.weight"], trained.full["pair_head.classifier.weight"])
    sequences = [[0, 5, 6, 2, 7, 8, 9, 2], [0, 10, 2, 11, 2]]
    logits = []
    for folder, saved in ((tmp_path / "nsp", trained), (tmp_path / "mlm", converted)):
        _, body = encoder_from(saved, folder, world)
        classifier = SentenceClassifier(body, 2, seed=1, pretrained=folder_tensors(saved)).eval()
        assert torch.equal(classifier.head.dense.weight, trained.full["pair_head.pooler.weight"])
        with torch.no_grad():
            logits.append(classify(classifier, sequences, 1, "packed", world.device))
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


def test_the_glue_command_takes_overrides_of_the_folders_config(tiny_folder, tmp_path, capsys):  # noqa: F811
    from megamlm.cli import main as cli

    args = ["glue", "--checkpoint", str(tiny_folder), "--data-dir", str(GLUE), "--tasks", "RTE", "--epochs", "1",
            "--max-train-samples", "4", "--out", str(tmp_path / "out")]
    assert cli([*args, "model.classifier_pooling=mean"]) == 0
    assert "RTE: classifier pooler on mean features, drawn fresh" in capsys.readouterr().out
    report = json.loads((tmp_path / "out/results.json").read_text())
    assert report["options"]["overrides"] == ["model.classifier_pooling=mean"]
    assert cli([*args, "--dropout", "0.2", "--weight-decay", "0.01", "model.attention_dropout=0"]) == 0
    options = FinetuneOptions(**json.loads((tmp_path / "out/results.json").read_text())["options"])
    assert (options.weight_decay, options.classifier_dropout) == (0.01, 0.0)  # set / the recipe's
    _, body = load_encoder(tiny_folder, overrides=config_overrides(options))
    assert (body.config.hidden_dropout, body.config.attention_dropout) == (0.2, 0.0)  # the override wins
    assert cli([*args, "model.classifier_pooling=max"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.classifier_pooling='max' is invalid; allowed: cls | mean" in err


def test_continued_pretraining_with_nsp_starts_from_the_imported_nsp_head(world, tmp_path):
    # bert-base's folder holds BERT's NSP head: `train.init_from` with objective.name=nsp starts from it, so
    # the pair logits are BertForPreTraining's from the first update
    from transformers import BertForPreTraining

    from megamlm.config import replace_config
    from megamlm.objectives import get_objective
    from megamlm.train.loop import init_from_folder

    source = save_bert(tmp_path / "hf", pretraining=True)
    convert("hf", "megamlm", source, tmp_path / "megamlm", **QUIET)
    cfg = replace_config(read_model_folder(tmp_path / "megamlm").cfg, ["objective.name=nsp"])
    objective = get_objective(cfg)
    model = objective.build_model(world).eval()
    init_from_folder(model, cfg, str(tmp_path / "megamlm"), objective)
    theirs = BertForPreTraining.from_pretrained(source, attn_implementation="eager").eval()
    order = torch.from_numpy(Tokenizer.load(cfg.data.tokenizer).vocab_order)
    tokens = _padded([[0, 5, 6, 7, 2, 8, 9, 2], [0, 10, 11, 2, 12, 2]])
    with torch.no_grad():
        ours = model.pair_head(model.hidden_states(tokens)[0])  # <s> features [b, h] -> [b, 2]
        want = theirs(input_ids=order[tokens], attention_mask=tokens.ne(1).long(),
                      token_type_ids=token_types(tokens, cfg.model)).seq_relationship_logits
    torch.testing.assert_close(ours, want, rtol=0, atol=2e-5)


def test_electra_runs_fine_tune_with_one_linear_layer_on_the_first_token(world):
    # google-research/electra's classifier: tf.layers.dense on sequence_output[:, 0] (Glorot-uniform)
    from megamlm.config import load_config
    from tests.variants import CONFIGS, TINY

    cfg = load_config([CONFIGS / "variants/baseline.yaml", CONFIGS / "objectives/electra.yaml"], TINY)
    assert cfg.model.classifier == "linear"
    model = SentenceClassifier(Encoder(cfg.model, world, seed=1), 3, seed=1).eval()
    assert [name for name, _ in model.head.named_parameters()] == ["out_proj.weight", "out_proj.bias"]
    bound = (6 / (cfg.model.hidden_size + 3)) ** 0.5
    weight = model.head.out_proj.weight
    assert weight.abs().max() <= bound and weight.abs().max() > 0.8 * bound and not model.head.out_proj.bias.any()
    sequences = [[0, 5, 6, 7, 2], [0, 8, 9, 2, 2, 10, 2]]
    with torch.no_grad():
        hidden = model.body(_padded(sequences))  # [s, b, h]
        want = hidden[0] @ weight.T + model.head.out_proj.bias  # the first token's features, one layer
        for packing in ("padded", "packed"):
            torch.testing.assert_close(classify(model, sequences, 1, packing, world.device), want, rtol=0, atol=1e-5)


def test_every_classifier_name_the_config_allows_has_a_head():
    import typing

    from megamlm.config import ModelConfig
    from megamlm.objectives.classification import CLASSIFIER_HEADS

    assert set(CLASSIFIER_HEADS) == set(typing.get_args(typing.get_type_hints(ModelConfig)["classifier"]))


def test_dense_heads_drop_out_as_transformers_electra_and_distilbert_classifiers():
    """In training (dropout 0.1), dense_gelu is transformers' ElectraClassificationHead and dense_relu
    DistilBertForSequenceClassification's pre_classifier -> ReLU -> dropout -> classifier, bit for bit
    under the same seed: the same dropout draws in the same places."""
    from transformers import ElectraConfig
    from transformers.models.electra.modeling_electra import ElectraClassificationHead

    from megamlm.objectives.classification import CLASSIFIER_HEADS

    model = variant_config("baseline").model
    features = torch.randn(5, 7, model.hidden_size)  # [b, s, h]: the heads read the first token's
    electra = ElectraClassificationHead(ElectraConfig(hidden_size=model.hidden_size, num_labels=3,
                                                      hidden_dropout_prob=0.1, hidden_act="relu")).train()
    ours = {name: CLASSIFIER_HEADS[name](model, 3, dropout=0.1).train() for name in ("dense_gelu", "dense_relu")}
    for head in ours.values():
        head.load_state_dict(electra.state_dict())  # dense, out_proj: the same names
    distilbert = lambda x: ours["dense_relu"].out_proj(  # noqa: E731  (transformers' lines, its modules)
        torch.nn.functional.dropout(torch.relu(ours["dense_relu"].dense(x)), 0.1, training=True))
    for name, theirs in (("dense_gelu", electra), ("dense_relu", lambda x: distilbert(x[:, 0]))):
        torch.manual_seed(7)
        want = theirs(features)
        torch.manual_seed(7)
        got = ours[name](features[:, 0])
        assert torch.equal(got, want), name
        torch.manual_seed(8)
        assert not torch.equal(ours[name](features[:, 0]), want)  # dropout draws


def test_layerwise_lr_decay_scales_each_depth_and_zero_freezes_the_body(world):
    from megamlm.glue.finetune import finetune, layer_lr_scales
    from megamlm.glue.tasks import TASKS, Example

    # 2 layers: embedding 0, layers 1-2, head 4 (no final norm: post-LN); the GPT-2 vocabulary
    cfg = variant_config("baseline", ["model.vocab_size=50265"])
    model = SentenceClassifier(Encoder(cfg.model, world, seed=1), 2, seed=1)
    scales = layer_lr_scales(model, 0.5)
    assert scales["body.embedding.word_embeddings.weight"] == 0.5 ** 4
    assert scales["body.encoder.layers.0.mlp.linear_fc1.weight"] == 0.5 ** 3
    assert scales["body.encoder.layers.1.self_attention.linear_qkv.bias"] == 0.5 ** 2
    assert scales["head.out_proj.weight"] == scales["head.dense.bias"] == 1.0
    assert set(layer_lr_scales(model, None).values()) == {1.0}
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    rng = np.random.default_rng(0)
    words = "the a of to and in is it that was good bad".split()
    examples = [Example((" ".join(rng.choice(words, 6)),), int(rng.integers(2))) for _ in range(8)]
    tokenizer = Tokenizer.load(cfg.data.tokenizer)
    finetune(model, TASKS["SST-2"], examples, examples, tokenizer, FinetuneOptions(
        epochs=1, batch_size=4, lr=1e-3, layerwise_lr_decay=0.0), seed=1, ctx=world, log=lambda *a: None)
    for name, param in model.named_parameters():  # lr 0 below the head: AdamW leaves those weights as they were
        assert torch.equal(param, before[name]) != name.startswith("head."), name


@pytest.mark.parametrize("classifier", ["pooler", "mlm_head", "linear"])
def test_classifier_dropout_drops_the_classification_layers_input_while_training(world, classifier):
    cfg = variant_config("bert", [f"model.classifier={classifier}"])
    sequences = [[0, 5, 6, 7, 2], [0, 8, 9, 2, 10, 2]]
    model = SentenceClassifier(Encoder(cfg.model, world, seed=1), 3, seed=1, dropout=1.0)
    with torch.no_grad():
        model.head.out_proj.bias.copy_(torch.tensor([1.0, 2.0, 3.0]))
        dropped = classify(model.train(), sequences, 1, "padded", world.device)  # p = 1: the input is all zeros
        kept = classify(model.eval(), sequences, 1, "padded", world.device)
    assert torch.equal(dropped, torch.tensor([[1.0, 2.0, 3.0]] * 2))
    assert not torch.allclose(kept, dropped)
    assert isinstance(SentenceClassifier(Encoder(cfg.model, world, seed=1), 3, seed=1).head.drop, torch.nn.Identity)
