"""GLUE fine-tuning recipes (glue/recipes.py): each resolves per task and model size as its paper's code
does, the ELECTRA recipe's optimizer is TF's AdamWeightDecayOptimizer and its schedule TF's, gradients
are clipped, and `megamlm glue --recipe` records what each task ran with."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from megamlm.config import OptimConfig
from megamlm.data.tokenizer import Tokenizer
from megamlm.glue.finetune import FinetuneOptions, SentenceClassifier, finetune, param_groups
from megamlm.glue.optimizer import AdamWeightDecay
from megamlm.glue.recipes import RECIPES
from megamlm.glue.tasks import TASKS, Example
from megamlm.model.encoder import Encoder
from megamlm.train.schedule import lr_at
from tests.test_glue import GLUE, tiny_folder  # noqa: F401  (a fixture)
from tests.variants import variant_config


def _model(hidden: int):
    return variant_config("baseline", [f"model.hidden_size={hidden}", "model.num_attention_heads=4"]).model


@pytest.mark.parametrize("hidden, lr, decay", [(256, 3e-4, 0.8), (768, 1e-4, 0.8), (1024, 5e-5, 0.9)])
def test_the_electra_recipe_takes_the_papers_values_per_task_and_model_size(hidden, lr, decay):
    electra = RECIPES["electra"]
    rte, sst = (electra.for_task(TASKS[name], _model(hidden)) for name in ("RTE", "SST-2"))
    assert (rte.epochs, sst.epochs) == (10, 3)  # configure_finetuning.py: RTE and STS-B 10 epochs
    assert (sst.lr, sst.layerwise_lr_decay, sst.batch_size, sst.max_length) == (lr, decay, 32, 128)
    assert (sst.warmup, sst.weight_decay, sst.betas, sst.clip_grad) == (0.1, 0.01, (0.9, 0.999), 1.0)
    assert not sst.bias_correction and not sst.decay_norms_and_biases and sst.per_task == sst.per_size == {}
    # what the user sets wins; an unset (None) option leaves the recipe's value
    assert electra.for_task(TASKS["RTE"], _model(hidden), {"epochs": 2, "lr": None}).epochs == 2
    assert electra.for_task(TASKS["RTE"], _model(hidden), {"epochs": 2, "lr": None}).lr == lr


def test_the_fairseq_recipe_takes_the_task_tables_values():
    fairseq = RECIPES["fairseq"]
    for task in TASKS.values():
        resolved = fairseq.for_task(task, _model(768))
        assert (resolved.lr, resolved.batch_size, resolved.epochs) == (task.lr, task.batch_size, 10)
        assert resolved.updates(task, 100) == task.schedule(10, 100)
    assert fairseq.for_task(TASKS["RTE"], _model(768), {"batch_size": 8}).batch_size == 8
    # a report's options: what does not vary per task or size
    assert "lr" not in fairseq.shared() and fairseq.shared()["weight_decay"] == 0.1
    assert {"epochs", "lr", "layerwise_lr_decay"}.isdisjoint(RECIPES["electra"].shared())
    assert RECIPES["electra"].updates(RECIPES["electra"].for_task(TASKS["SST-2"], _model(768)), 57) == (171, 17)


def test_adam_weight_decay_is_tfs_update_without_bias_correction():
    rng = np.random.default_rng(0)
    params = [torch.tensor(rng.normal(size=(3, 4))), torch.tensor(rng.normal(size=4))]
    adamw = [p.clone().requires_grad_(True) for p in params]
    torch_adamw = torch.optim.AdamW([{"params": [adamw[0]], "weight_decay": 0.01},
                                     {"params": [adamw[1]], "weight_decay": 0.0}], lr=0.1, betas=(0.9, 0.999), eps=1e-6)
    groups = [{"params": [params[0]], "weight_decay": 0.01}, {"params": [params[1]], "weight_decay": 0.0}]
    for p in params:
        p.requires_grad_(True)
    optimizer = AdamWeightDecay(groups, lr=0.1, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0)
    # BERT/ELECTRA's model/optimization.py, step by step in numpy
    want = [p.detach().numpy().copy() for p in params]
    m, v = [np.zeros_like(w) for w in want], [np.zeros_like(w) for w in want]
    for _ in range(3):
        grads = [rng.normal(size=w.shape) for w in want]
        for p, q, g in zip(params, adamw, grads):
            p.grad, q.grad = torch.tensor(g), torch.tensor(g)
        optimizer.step()
        torch_adamw.step()
        for i, (g, decay) in enumerate(zip(grads, (0.01, 0.0))):
            m[i] = 0.9 * m[i] + (1 - 0.9) * g
            v[i] = 0.999 * v[i] + (1 - 0.999) * np.square(g)
            update = m[i] / (np.sqrt(v[i]) + 1e-6) + decay * want[i]
            want[i] = want[i] - 0.1 * update
        for p, w in zip(params, want):
            np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-12, atol=1e-12)
    # torch's AdamW (bias-corrected: its first steps are ~lr, these ~lr·(1 − β1) / √(1 − β2)) is not it
    assert max(float((p - q).detach().abs().max()) for p, q in zip(params, adamw)) > 0.1


def test_the_warmup_times_polynomial_schedule_is_tfs():
    optim = OptimConfig(lr=1.0, min_lr=0.0, schedule="warmup_times_polynomial", warmup_steps=2, end_lr=0.0)
    # lr · (1 − t / 10) · min(1, t / 2)
    assert [lr_at(t, optim, 10) for t in range(11)] == pytest.approx(
        [0.0, 0.45, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0])
    after = dataclasses.replace(optim, schedule="polynomial")  # fairseq's: the decay starts after the warm-up
    assert lr_at(3, after, 10) == pytest.approx(7 / 8)


def _toy(world):
    cfg = variant_config("baseline", ["model.vocab_size=50265"])
    model = SentenceClassifier(Encoder(cfg.model, world, seed=1), 2, seed=1)
    rng = np.random.default_rng(0)
    words = "the a of to and in is it that was good bad".split()
    examples = [Example((" ".join(rng.choice(words, 6)),), int(rng.integers(2))) for _ in range(16)]
    return model, examples, Tokenizer.load(cfg.data.tokenizer)


def test_the_electra_recipe_decays_matrices_only_per_depth(world):
    model, _, _ = _toy(world)
    recipe = RECIPES["electra"].for_task(TASKS["SST-2"], model.body.config)
    names = {id(p): name for name, p in model.named_parameters()}
    groups = param_groups(model, recipe)
    assert sum(len(g["params"]) for g in groups) == len(names)
    for group in groups:
        for param in group["params"]:
            assert group["weight_decay"] == (0.01 if param.dim() > 1 else 0.0), names[id(param)]
    assert [g["lr_scale"] for g in groups] == sorted((g["lr_scale"] for g in groups), reverse=True)
    # head 1, layers 0.8² and 0.8³, embedding 0.8⁴ (2 layers; post-LN: no final norm at 0.8)
    assert {g["lr_scale"] for g in groups} == {0.8 ** k for k in (0, 2, 3, 4)}
    fairseq = param_groups(model, RECIPES["fairseq"].for_task(TASKS["SST-2"], model.body.config))
    assert [(g["lr_scale"], g["weight_decay"]) for g in fairseq] == [(1.0, 0.1)]  # one group, as before


def test_the_electra_recipe_clips_the_gradient_norm(world, monkeypatch):
    norms = []
    original = AdamWeightDecay.step

    def step(self):  # the global gradient norm the optimizer receives
        norms.append(float(torch.sqrt(sum(p.grad.square().sum() for g in self.param_groups for p in g["params"]))))
        return original(self)

    monkeypatch.setattr(AdamWeightDecay, "step", step)
    unclipped = dataclasses.replace(RECIPES["electra"], name="electra-unclipped", clip_grad=0.0)
    monkeypatch.setitem(RECIPES, unclipped.name, unclipped)
    for name in ("electra-unclipped", "electra"):
        model, examples, tokenizer = _toy(world)
        result = finetune(model, TASKS["SST-2"], examples, examples, tokenizer,
                          FinetuneOptions(recipe=name, epochs=2, batch_size=4, lr=1e-3),
                          seed=1, ctx=world, log=lambda *a: None)
        assert result["recipe"]["epochs"] == 2 and result["schedule_updates"] == result["updates"] == 8
    raw, clipped = norms[:8], norms[8:]
    assert max(raw) > 1.5  # the toy's gradients exceed the threshold ...
    assert max(clipped) == pytest.approx(1.0, rel=1e-5)  # ... and are clipped to it
    assert clipped[0] == pytest.approx(min(raw[0], 1.0), rel=1e-5)  # the same first batch


def test_the_glue_command_records_each_tasks_recipe(tiny_folder, tmp_path, capsys):  # noqa: F811
    from megamlm.cli import main as cli

    assert cli(["glue", "--checkpoint", str(tiny_folder), "--data-dir", str(GLUE), "--tasks", "RTE,SST-2",
                "--recipe", "electra", "--max-train-samples", "4", "--max-eval-samples", "4",
                "--out", str(tmp_path / "out")]) == 0
    assert "(electra recipe, median over 1 seed(s)" in capsys.readouterr().out
    report = json.loads((tmp_path / "out/results.json").read_text())
    assert report["options"]["recipe"] == "electra" and report["options"]["epochs"] is None  # varies per task
    assert report["options"]["weight_decay"] == 0.01 and report["options"]["classifier_dropout"] == 0.1
    for task, epochs in (("RTE", 10), ("SST-2", 3)):
        ran = report["tasks"][task]["seeds"]["1"]
        assert (ran["recipe"]["epochs"], len(ran["epochs"]), ran["updates"]) == (epochs, epochs, epochs)
        assert ran["recipe"]["lr"] == 3e-4  # the tiny model's width is ELECTRA-small's
    with pytest.raises(SystemExit) as refused:
        cli(["glue", "--checkpoint", str(tiny_folder), "--data-dir", str(GLUE), "--recipe", "bert"])
    assert refused.value.code == 2
    assert "invalid choice: 'bert'" in capsys.readouterr().err


def test_a_folder_whose_objective_has_its_own_recipe_says_so_under_another(world, tmp_path):
    """An ELECTRA folder fine-tuned with the default (fairseq) recipe: one line names ELECTRA's; the
    recipe itself stays the one asked for (a comparison of objectives fine-tunes them alike)."""
    from megamlm.config import load_config
    from megamlm.glue.run import run_glue
    from megamlm.model.folder import write_model_folder
    from megamlm.model.reshard import full_state_dict
    from megamlm.objectives import get_objective
    from tests.variants import CONFIGS, TINY

    cfg = load_config([CONFIGS / "variants/baseline.yaml", CONFIGS / "objectives/electra.yaml"],
                      TINY + ["model.vocab_size=50265", "objective.generator_size=0.5"])
    write_model_folder(tmp_path / "electra", cfg, full_state_dict(get_objective(cfg).build_model(world)))
    for recipe in ("fairseq", "electra"):
        lines = []
        report = run_glue(str(tmp_path / "electra"), str(GLUE), ["RTE"], [1], str(tmp_path / recipe),
                          FinetuneOptions(recipe=recipe, epochs=1, batch_size=4), max_train=4, max_eval=4,
                          log=lines.append)
        assert report["options"]["recipe"] == recipe
        notes = [line for line in lines if "note:" in line]
        assert notes == ([] if recipe == "electra" else [
            "RTE: note: the folder was pretrained with objective.name=electra, whose paper fine-tunes as "
            "--recipe electra; this run: --recipe fairseq"])
