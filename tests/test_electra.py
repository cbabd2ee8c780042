"""ELECTRA (objective.name=electra): TP- and DP-invariant, resumable, unbiased sampling, the shared
embedding learns from both models, exports the discriminator, refuses bad settings in one line."""

from pathlib import Path

import numpy as np
import pytest
import torch

from megamlm.config import ConfigError, ParallelConfig
from megamlm.data.batch import collate
from megamlm.data.tokenizer import Tokenizer
from megamlm.objectives import get_objective
from megamlm.objectives.electra import generator_config, roc_auc, sample_vocab_parallel
from tests.multiproc import run_on_ranks
from tests.test_train import _straight_then_resume, _train, _zero_runs, config, logged, tiny_shards

ELECTRA = ["objective.name=electra", "objective.generator_size=0.5", "data.leave_unmasked_prob=0.15",
           "data.random_token_prob=0"]
NO_DROPOUT = ["model.hidden_dropout=0", "model.attention_dropout=0"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return tiny_shards(tmp_path_factory, "electra")


def _batch(cfg, rows: int = 4, length: int = 48):
    tokenizer = Tokenizer.gpt2()
    rng = np.random.default_rng(0)
    samples = [(np.concatenate([[0], rng.integers(4, 50000, length - 2 - 5 * i), [2]]), 10 + i) for i in range(rows)]
    return collate(samples, get_objective(cfg).corruption(tokenizer, 1), 0, length, cfg.model.pad_token_id)


def _one_step(cfg, tp):
    from megamlm.model.reshard import full_state_dict
    from megamlm.parallel import init_distributed, seed_everything

    ctx = init_distributed(ParallelConfig(tensor_parallel=tp))
    seed_everything(1, ctx)
    objective = get_objective(cfg)
    model = objective.build_model(ctx)
    batch = _batch(cfg)
    out = objective.loss(model, batch)
    out.mean().backward()
    with torch.no_grad():  # what the discriminator read in that step (same seed, same samples)
        corrupted = model(batch.inputs, batch.original, batch.target_index, objective.sampling_seed(batch)).corrupted
    return {"loss": out.loss_sum.detach(), "corrupted": corrupted, "original": batch.original,
            "targets": batch.target_index, "grads": full_state_dict(model, grads=True)}


def test_tp2_equals_tp1_losses_samples_and_every_gradient(tmp_path):
    cfg = config(tmp_path, tmp_path / "run", *ELECTRA, *NO_DROPOUT, "model.position=alibi", "model.alibi_mode=offset")
    (one,) = run_on_ranks(_one_step, 1, cfg, 1)
    two, _ = run_on_ranks(_one_step, 2, cfg, 2)
    torch.testing.assert_close(two["loss"], one["loss"], rtol=1e-5, atol=1e-5)
    assert torch.equal(two["corrupted"], one["corrupted"])  # the same replacements at TP=1 and TP=2
    replaced = (one["corrupted"] != one["original"]).sum()
    assert 0 < replaced <= len(one["targets"])  # replacements only at the masked positions
    assert one["grads"].keys() == two["grads"].keys()
    for name, grad in one["grads"].items():
        torch.testing.assert_close(two["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # the one token table serves both models: its gradient comes from each of them
    assert "generator.embedding.word_embeddings.weight" not in one["grads"]
    assert one["grads"]["embedding.word_embeddings.weight"].abs().sum() > 0


def test_the_shared_embedding_gets_gradients_from_both_models(world, tmp_path):
    cfg = config(tmp_path, tmp_path, *ELECTRA, *NO_DROPOUT)
    objective = get_objective(cfg)
    model = objective.build_model(world)
    table = model.embedding.word_embeddings.weight
    batch = _batch(cfg)
    grads = []
    for term in range(2):  # the generator's MLM term, then the discriminator's RTD term
        model.zero_grad()
        objective.loss(model, batch).loss_sum[term].backward()
        grads.append(table.grad.clone())
    touched = [set(torch.nonzero(g.abs().sum(1)).flatten().tolist()) for g in grads]
    # MLM reaches every row through the tied output layer; RTD only the rows of the tokens it read
    read = set(batch.original[~batch.target_mask].tolist()) - {1}  # what the discriminator read unchanged
    assert len(touched[0]) > 1000 and read <= touched[1]
    assert len(touched[1]) < 300
    assert not any(name.startswith("generator.embedding.") for name, _ in model.named_parameters())


def test_shard_table_covers_the_generator(world, tmp_path):
    from tests.test_convert import assert_shard_table_matches

    cfg = config(tmp_path, tmp_path, *ELECTRA, "model.position=alibi", "model.alibi_mode=learned")
    model = get_objective(cfg).build_model(world)
    assert any(name == "generator.alibi.log_slopes" for name, _ in model.named_parameters())
    assert_shard_table_matches(model)


@pytest.mark.parametrize("extra", [[], ["model.position=alibi", "model.alibi_mode=learned"],
                                   ["objective.generator_size=1", "model.head=clap"]])
def test_plan_counts_both_models(world, tmp_path, extra):
    from megamlm.plan import parameter_count

    cfg = config(tmp_path, tmp_path, *ELECTRA, *extra)
    assert parameter_count(cfg) == get_objective(cfg).build_model(world).parameter_count()


def test_activation_checkpointing_covers_both_models_with_equal_gradients(world, tmp_path):
    from megamlm.parallel import seed_everything
    from megamlm.train.layers import apply_activation_checkpointing, encoder_layers

    cfg = config(tmp_path, tmp_path, *ELECTRA, "model.hidden_dropout=0.1", "model.attention_dropout=0.1")
    objective = get_objective(cfg)
    batch = _batch(cfg)
    grads = []
    for checkpointed in (False, True):
        seed_everything(3, world)
        model = objective.build_model(world)
        if checkpointed:
            apply_activation_checkpointing(model)
        assert len(encoder_layers(model)) == 2 * cfg.model.num_layers
        objective.loss(model, batch).mean().backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name  # the same dropout masks recomputed


def test_generator_is_a_fraction_of_the_discriminator():
    from megamlm.config import ModelConfig

    base = ModelConfig()  # 12 heads of 64, FFN 4h
    gen = generator_config(base, 1 / 3)
    assert (gen.num_attention_heads, gen.hidden_size, gen.ffn_hidden_size, gen.num_layers) == (4, 256, 1024, 12)
    assert generator_config(base, 0.01).num_attention_heads == 1


def test_gumbel_max_samples_follow_the_softmax(world):
    torch.manual_seed(0)
    vocab = 12
    logits = torch.randn(vocab) * 1.5
    logits[3] = float("-inf")  # a column that may never be drawn
    rows = 40_000
    padded = torch.cat([logits, torch.full((4,), float("-inf"))])  # vocabulary padding columns
    samples = sample_vocab_parallel(padded.expand(rows, -1), 0, vocab, seed=7, chunk_elements=1000)
    empirical = torch.bincount(samples, minlength=vocab).double() / rows
    expected = torch.softmax(logits.double(), 0)
    assert samples.max() < vocab and empirical[3] == 0
    total_variation = 0.5 * (empirical - expected).abs().sum()
    assert total_variation < 0.01, (empirical, expected)  # ~0.004 expected from 40k draws
    again = sample_vocab_parallel(padded.expand(rows, -1), 0, vocab, seed=7, chunk_elements=1000)
    assert torch.equal(samples, again)  # seeded


def test_auc_from_histograms():
    separated = torch.zeros(2, 8)
    separated[0, 1], separated[1, 6] = 5, 3
    assert roc_auc(separated) == 1.0
    assert roc_auc(separated.flip(1)) == 0.0
    same = torch.zeros(2, 8)
    same[:, 2:4] = 1
    assert roc_auc(same) == 0.5


def _runs(cfgs):
    return [_train(cfg) for cfg in cfgs]


@pytest.mark.slow
def test_zero_dp2_equals_dp1_with_accumulation_and_trains(shards, tmp_path):
    common = [*ELECTRA, *NO_DROPOUT, "train.global_batch_size=8", "train.steps=6"]
    (reference,) = run_on_ranks(_zero_runs, 1, [config(shards, tmp_path / "dp1", *common)])[0]
    (dp2,), _ = run_on_ranks(_zero_runs, 2, [config(shards, tmp_path / "dp2", *common, "train.zero_stage=2")])
    assert max(abs(a - b) for a, b in zip(dp2["losses"], reference["losses"])) < 1e-4
    assert reference["losses"][-1] < reference["losses"][0]
    for key in ("generator_loss", "discriminator_loss", "rtd_accuracy", "rtd_auc", "replaced_share"):
        one, two = logged(tmp_path / "dp1", key=key), logged(tmp_path / "dp2", key=key)
        assert len(one) == 6 and max(abs(one[s] - two[s]) for s in one) < 1e-4, key
    assert all(0 < v < 0.2 for v in logged(tmp_path / "dp1", key="replaced_share").values())


@pytest.mark.slow
def test_resume_after_sigkill_is_bit_exact(shards, tmp_path):
    steps = [*ELECTRA, "train.steps=8", "train.save_interval=4"]
    killed = config(shards, tmp_path / "killed", *steps)
    with pytest.raises(RuntimeError, match="died without a result"):
        run_on_ranks(_train, 1, killed, None, 6)
    straight = config(shards, tmp_path / "straight", *steps)
    ((full, resumed),) = run_on_ranks(_straight_then_resume, 1, straight, killed)
    assert resumed["losses"] == full["losses"][4:]


def _export_and_reload(cfg):
    import megamlm
    from megamlm.evaluate import mlm_perplexity
    from megamlm.fill_mask import fill_mask
    from megamlm.objectives import load_encoder, load_pretrained

    summary = _train(cfg)
    folder = cfg.train.run_dir + "/final"
    model = megamlm.from_pretrained(folder)
    _, encoder = load_encoder(folder)
    result = {"losses": summary["losses"], "has_generator": model.generator is not None,
              "encoder_parameters": encoder.parameter_count(), "model_parameters": model.parameter_count()}
    tokenizer = Tokenizer.gpt2()
    try:
        fill_mask(model, tokenizer, "The capital of France is <mask>.")
    except Exception as err:  # noqa: BLE001 - the message is what is tested
        result["fill_mask"] = str(err)
    from megamlm.convert.pipeline import convert
    from megamlm.errors import MegamlmError

    try:
        convert("megamlm", "hf", folder, folder + "-hf", log=lambda *_: None)
    except MegamlmError as err:
        result["convert"] = str(err)
    result["convert_wrote"] = Path(folder + "-hf").exists()
    cfg2, model2 = load_pretrained(folder)
    tokens = np.random.default_rng(0).integers(4, 50000, (4, 32))
    try:
        result["eval"] = mlm_perplexity(get_objective(cfg2), model2, tokens, tokenizer)
    except ConfigError as err:
        result["eval"] = str(err)
    return result


def test_export_holds_the_discriminator_unless_the_generator_is_asked_for(shards, tmp_path):
    common = [*ELECTRA, "train.steps=2"]
    plain = run_on_ranks(_export_and_reload, 1, config(shards, tmp_path / "plain", *common))[0]
    both = run_on_ranks(_export_and_reload, 1, config(shards, tmp_path / "both", *common,
                                                      "objective.export_generator=true"))[0]
    assert not plain["has_generator"] and both["has_generator"]
    # GLUE reads the discriminator: the encoder is the model minus its RTD head (h² + h, then h + 1)
    h = 64
    assert plain["model_parameters"] - plain["encoder_parameters"] == h * h + h + h + 1
    assert "has none" in plain["fill_mask"] and "has none" in both["fill_mask"]
    assert "no generator" in plain["eval"]
    assert "objective.name=electra: conversion" in plain["convert"] and not plain["convert_wrote"]
    assert both["eval"]["ppl"] > 1 and 0 <= both["eval"]["rtd_accuracy"] <= 1


@pytest.mark.parametrize("override, message", [
    ("objective.generator_size=1.5", r"objective.generator_size=1.5 must be in \(0, 1\]"),
    ("objective.rtd_weight=0", r"objective.rtd_weight=0.0 must be > 0"),
    ("objective.name=electro", r"objective.name='electro' is not an objective; allowed: electra \| mlm"),
])
def test_bad_settings_are_refused_in_one_line(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        get_objective(config(tmp_path, tmp_path, "objective.name=electra", override))


def test_generator_heads_must_divide_over_tensor_parallel(tmp_path):
    cfg = config(tmp_path, tmp_path, "objective.name=electra", "objective.generator_size=0.25",
                 "parallel.tensor_parallel=2")  # 4 heads -> a generator of 1
    with pytest.raises(ConfigError, match=r"objective.generator_size=0.25 gives the generator 1 attention "
                                          r"head\(s\), not divisible by parallel.tensor_parallel=2"):
        get_objective(cfg)


@pytest.mark.slow
def test_the_discriminator_learns_to_spot_replacements_it_can_see(shards, tmp_path, monkeypatch):
    """With replacements drawn uniformly from the vocabulary (a generator that never learns), the
    discriminator must leave the prior: it reads the corrupted text at the right positions and its
    loss reaches the encoder. (A learning generator's samples soon fit the context; at the demo's
    scale the discriminator then stays at the prior, BENCHMARKS.md "Objectives at equal compute".)"""
    import megamlm.objectives.electra as electra

    def uniform(logits_local, vocab_start, vocab_size, seed, tp_group=None):
        return torch.randint(4, vocab_size - 1, (len(logits_local),), generator=torch.Generator().manual_seed(seed))

    monkeypatch.setattr(electra, "sample_vocab_parallel", uniform)
    run_dir = tmp_path / "uniform"
    _train(config(shards, run_dir, *ELECTRA, "train.steps=100", "train.log_interval=10"))
    auc, bce, share = (logged(run_dir, key=k) for k in ("rtd_auc", "rtd_bce", "replaced_share"))
    assert auc[10] < 0.65 and min(auc[s] for s in (80, 90, 100)) > 0.75
    prior = max(-(p * np.log(p) + (1 - p) * np.log(1 - p)) for p in share.values())  # BCE of the base rate
    assert max(bce[s] for s in (80, 90, 100)) < 0.85 * prior
