"""An attention backend against sdpa: the same model's loss and gradients, and the same training losses
at TP=1, TP=2 and compiled (tests/test_alibi_flash.py, tests/test_triton_attention.py)."""

import torch

from megamlm.data.batch import collate
from megamlm.objectives import MaskedLM
from tests.multiproc import run_on_ranks
from tests.test_packing import _no_corruption, _samples
from tests.test_train import _train, config
from tests.variants import variant_config


def assert_model_gives_sdpas_loss_and_gradients(world, backend: str, variant: str = "zero-clap") -> None:
    """The zero-clap variant (ALiBi offset, CLAP) unless named: padded and packed batches."""
    samples = [(s, i) for i, s in enumerate(_samples(1100))]
    batches = [collate(samples, _no_corruption, 0, 16, pad_id=1),
               collate(samples, _no_corruption, 0, 56, pad_id=1, packed=True)]
    models = {name: MaskedLM(variant_config(variant, [f"model.attention_backend={name}"]).model, world, seed=3)
              for name in ("sdpa", backend)}
    for batch in batches:
        results = {}
        for name, model in models.items():
            model.zero_grad()
            loss = model(batch.inputs, batch.target_index, batch.documents, batch.segments,
                         targets=batch.targets).float().mean()
            loss.backward()
            results[name] = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
        for ours, theirs in zip(results[backend], results["sdpa"]):
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)


def _losses_of_runs(cfgs):
    return [_train(cfg)["losses"] for cfg in cfgs]


def assert_loop_trains_sdpas_losses(shards, tmp_path, backend: str) -> None:
    """4 updates of ALiBi offset without attention dropout: sdpa's losses at TP=1 and TP=2, and compiled
    (Inductor draws its own hidden-dropout masks: off in both)."""
    common = ["model.position=alibi", "model.alibi_mode=offset", "model.attention_dropout=0", "train.steps=4"]
    cfgs = {name: config(shards, tmp_path / name, *common, f"model.attention_backend={name_backend}", *extra)
            for name, name_backend, extra in (("sdpa", "sdpa", []), ("ours", backend, []),
                                              ("compiled", backend, ["train.compile=true", "model.hidden_dropout=0"]),
                                              ("sdpa-no-dropout", "sdpa", ["model.hidden_dropout=0"]),
                                              ("ours-tp2", backend, ["parallel.tensor_parallel=2"]))}
    sdpa, ours, compiled, sdpa_no_dropout = run_on_ranks(
        _losses_of_runs, 1, [cfgs[name] for name in ("sdpa", "ours", "compiled", "sdpa-no-dropout")])[0]
    tp2 = run_on_ranks(_losses_of_runs, 2, [cfgs["ours-tp2"]])[0][0]
    assert len(ours) == 4 and ours[-1] < ours[0]
    torch.testing.assert_close(ours, sdpa, rtol=1e-5, atol=0)
    torch.testing.assert_close(tp2, ours, rtol=1e-5, atol=0)
    torch.testing.assert_close(compiled, sdpa_no_dropout, rtol=1e-4, atol=0)
