"""ALBERT's parts in training: one layer applied num_layers times gets the sum of the gradients of its
applications, and trains under ZeRO-3 and activation checkpointing as under ZeRO-0 (issue 18).
(TP=2 = TP=1 for the albert variant: tests/test_tensor_parallel.py; HF parity: test_hf_bert_albert.py.)"""

import pytest
import torch

from megamlm.model import names
from megamlm.model.reshard import full_state_dict, load_full_state_dict
from megamlm.objectives import MaskedLM
from tests.multiproc import run_on_ranks
from tests.test_model import batch
from tests.test_train import _zero_runs, config, shards  # noqa: F401 (fixture)
from tests.variants import variant_config

ALBERT = ["model.embedding_size=32", "model.share_layers=true", "model.token_types=2", "model.activation=gelu_tanh",
          "model.num_layers=3"]


def test_shared_layer_gradient_is_the_sum_over_its_applications(world):
    """An unshared model whose three layers are copies of the shared one computes the same logits,
    and the shared layer's gradient is the sum of the copies' gradients."""
    shared_cfg = variant_config("albert").model
    unshared_cfg = variant_config("albert", ["model.share_layers=false"]).model
    shared, unshared = MaskedLM(shared_cfg, world, seed=3), MaskedLM(unshared_cfg, world, seed=4)
    weights = full_state_dict(shared)
    layer0 = "encoder.layers.0."
    copies = {name.replace(layer0, f"encoder.layers.{i}."): tensor for name, tensor in weights.items()
              for i in range(shared_cfg.num_layers) if name.startswith(layer0)}
    load_full_state_dict(unshared, {**weights, **copies})
    assert sum(p.numel() for p in unshared.parameters()) - sum(p.numel() for p in shared.parameters()) == (
        2 * sum(t.numel() for n, t in weights.items() if n.startswith(layer0)))
    tokens, masked = batch(shared_cfg.vocab_size)
    tokens[:, 5] = 2  # a second segment (token type 1)
    grads = []
    for model in (shared, unshared):
        logits = model(tokens, masked)
        model.loss(logits, tokens[masked]).backward()
        grads.append(full_state_dict(model, grads=True))
    torch.testing.assert_close(shared(tokens, masked), unshared(tokens, masked), rtol=0, atol=1e-6)
    (mine, theirs), checked = grads, 0
    for name, grad in mine.items():
        if name.startswith(layer0):
            summed = sum(theirs[name.replace(layer0, f"encoder.layers.{i}.")] for i in range(3))
            torch.testing.assert_close(grad, summed, rtol=1e-5, atol=1e-7)
            checked += 1
        else:  # embedding (factorized), projection, head: the same parameters, the same gradient
            torch.testing.assert_close(grad, theirs[name], rtol=1e-5, atol=1e-7)
    assert checked == 12 and names.EMBEDDING_PROJECTION.format(kind="weight") in mine


@pytest.mark.slow
def test_albert_trains_under_zero3_and_activation_checkpointing_as_on_one_rank(shards, tmp_path):  # noqa: F811
    common = [*ALBERT, "train.global_batch_size=8", "model.hidden_dropout=0", "model.attention_dropout=0",
              "train.steps=8"]
    (reference,) = run_on_ranks(_zero_runs, 1, [config(shards, tmp_path / "dp1", *common)])[0]
    layouts = {"zero3": ["train.zero_stage=3"],
               "zero1+checkpointing": ["train.zero_stage=1", "train.activation_checkpointing=true"]}
    runs = [config(shards, tmp_path / name, *common, *extra) for name, extra in layouts.items()]
    results = run_on_ranks(_zero_runs, 2, runs)[0]
    assert reference["losses"][-1] < reference["losses"][0] - 0.1, reference["losses"]
    for name, result in zip(layouts, results):
        diff = max(abs(a - b) for a, b in zip(result["losses"], reference["losses"]))
        assert len(result["losses"]) == 8 and diff < 1e-4, f"{name}: losses differ from DP=1 by {diff}"
