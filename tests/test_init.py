"""Initialization schemes (model.init) against transformers' own initialization: every weight of a
ModernBERT-shaped model drawn with the distribution ModernBertForMaskedLM draws it with."""

import typing

import pytest
import torch

from megamlm.config import ModelConfig, load_config
from megamlm.convert.hf import hf_config_values, hf_to_megamlm
from megamlm.convert.hf_export import hf_format
from megamlm.model.init import INIT_SCHEMES
from megamlm.model.reshard import full_state_dict
from megamlm.objectives import MaskedLM
from tests.variants import CONFIGS


def _modernbert(init: str) -> ModelConfig:
    """ModernBERT's recipe at a size with enough draws per weight for their statistics (tiny: 4 layers,
    256 wide, 65,536 draws in the smallest matrix), full vocabulary."""
    return load_config([CONFIGS / "model/tiny.yaml", CONFIGS / "variants/modernbert.yaml"],
                       [f"model.init={init}"]).model


def _statistics(weights: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """(std, largest |draw|) of every matrix; norms, biases and other vectors have no spread to compare."""
    return {name: (w.std().item(), w.abs().max().item()) for name, w in weights.items() if w.dim() == 2}


@pytest.fixture(scope="module")
def transformers_draws():
    """ModernBertForMaskedLM built from the same config, as transformers initializes it, in our names."""
    m = _modernbert("modernbert")
    fmt = hf_format(m)
    torch.manual_seed(0)
    hf = fmt.build(hf_config_values(m, fmt, m.pad_token_id))
    return _statistics(hf_to_megamlm(hf.state_dict(), m, fmt))


def _differences(world, init: str, theirs: dict) -> dict[str, str]:
    ours = _statistics(full_state_dict(MaskedLM(_modernbert(init), world, seed=3)))
    assert set(ours) == set(theirs)
    out = {}
    for name, (std, largest) in ours.items():
        their_std, their_largest = theirs[name]
        if abs(std / their_std - 1) > 0.03 or abs(largest / their_largest - 1) > 0.03:
            out[name] = f"std {std:.5f} vs {their_std:.5f}, max {largest:.5f} vs {their_largest:.5f}"
    return out


def test_modernbert_init_draws_every_weight_as_transformers_does(world, transformers_draws):
    assert _differences(world, "modernbert", transformers_draws) == {}
    # the output projections are the ones scaled down: 0.02 / sqrt(2 · 4) cut at 2σ has std 0.0062
    attention_out = transformers_draws["encoder.layers.0.self_attention.linear_proj.weight"]
    assert 0.0060 < attention_out[0] < 0.0064 and attention_out[1] <= 2 * 0.02 / 8**0.5


def test_bert_init_differs_where_the_schemes_differ(world, transformers_draws):
    """The comparison above can fail: BERT's untruncated N(0, 0.02) differs in every matrix (its largest
    draws pass 2σ), most of all in the scaled projections."""
    differ = _differences(world, "bert", transformers_draws)
    assert len(differ) == len(transformers_draws), differ


def test_the_scheme_names_are_the_configs():
    assert set(INIT_SCHEMES) == set(typing.get_args(typing.get_type_hints(ModelConfig)["init"]))
