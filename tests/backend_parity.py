"""An implementation choice against the reference one — an attention backend against sdpa
(tests/test_alibi_flash.py, tests/test_triton_attention.py), model.bias_activation=triton against torch
(tests/test_bias_activation.py): the same model's loss and gradients, and the same training losses at
TP=1, TP=2 and compiled."""

import torch

from megamlm.data.batch import collate
from megamlm.objectives import MaskedLM
from tests.multiproc import run_on_ranks
from tests.test_packing import _no_corruption, _samples
from tests.test_train import _train, config
from tests.variants import variant_config


def assert_model_gives_sdpas_loss_and_gradients(world, backend: str, variant: str = "zero-clap") -> None:
    """The zero-clap variant (ALiBi offset, CLAP) unless named: padded and packed batches."""
    assert_model_gives_the_references_loss_and_gradients(world, f"model.attention_backend={backend}",
                                                         "model.attention_backend=sdpa", variant)


def assert_model_gives_the_references_loss_and_gradients(world, ours: str | tuple[str, ...], reference: str,
                                                         variant: str = "zero-clap",
                                                         of_scale: float | None = None) -> None:
    """The model of `variant` with the override `ours` (or several) against the one with `reference` (same
    weights): padded and packed batches. Each value within rtol 1e-4, atol 1e-6; or, with `of_scale`, each tensor
    within of_scale times its largest |value| (where ours rounds differently in the forward too, so that
    every gradient differs by rounding at its own scale)."""
    samples = [(s, i) for i, s in enumerate(_samples(1100))]
    batches = [collate(samples, _no_corruption, 0, 16, pad_id=1),
               collate(samples, _no_corruption, 0, 56, pad_id=1, packed=True)]
    models = {setting: MaskedLM(variant_config(variant, [setting] if isinstance(setting, str) else list(setting)).model,
                                world, seed=3)
              for setting in (reference, ours)}
    for batch in batches:
        results = {}
        for setting, model in models.items():
            model.zero_grad()
            loss = model(batch.inputs, batch.target_index, batch.documents, batch.segments,
                         targets=batch.targets).float().mean()
            loss.backward()
            results[setting] = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
        for got, expected in zip(results[ours], results[reference]):
            if of_scale is None:
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
            else:
                assert (got - expected).abs().max() <= of_scale * expected.abs().max(), (got, expected)


def _losses_of_runs(cfgs):
    return [_train(cfg)["losses"] for cfg in cfgs]


def assert_loop_trains_sdpas_losses(shards, tmp_path, backend: str) -> None:
    """4 updates of ALiBi offset without attention dropout: sdpa's losses at TP=1 and TP=2, and compiled
    (Inductor draws its own hidden-dropout masks: off in both)."""
    assert_loop_trains_the_references_losses(shards, tmp_path, f"model.attention_backend={backend}",
                                             "model.attention_backend=sdpa")


def assert_loop_trains_the_references_losses(shards, tmp_path, ours: str, reference: str) -> None:
    """4 updates of ALiBi offset without attention dropout with the override `ours`: the losses of the
    override `reference` at TP=1 and TP=2, and compiled (Inductor draws its own hidden-dropout masks: off
    in both)."""
    common = ["model.position=alibi", "model.alibi_mode=offset", "model.attention_dropout=0", "train.steps=4"]
    cfgs = {name: config(shards, tmp_path / name, *common, setting, *extra)
            for name, setting, extra in (("reference", reference, []), ("ours", ours, []),
                                         ("compiled", ours, ["train.compile=true", "model.hidden_dropout=0"]),
                                         ("reference-no-dropout", reference, ["model.hidden_dropout=0"]),
                                         ("ours-tp2", ours, ["parallel.tensor_parallel=2"]))}
    reference_losses, ours_losses, compiled, reference_no_dropout = run_on_ranks(
        _losses_of_runs, 1, [cfgs[name] for name in ("reference", "ours", "compiled", "reference-no-dropout")])[0]
    tp2 = run_on_ranks(_losses_of_runs, 2, [cfgs["ours-tp2"]])[0][0]
    assert len(ours_losses) == 4 and ours_losses[-1] < ours_losses[0]
    torch.testing.assert_close(ours_losses, reference_losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(tp2, ours_losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(compiled, reference_no_dropout, rtol=1e-4, atol=0)
