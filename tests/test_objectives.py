"""Objectives come from a registry: the test-only `reconstruct-all` objective (one module,
tests/objective_for_tests.py) trains through the unchanged loop, validation and model folder."""

import pytest

import tests.objective_for_tests  # noqa: F401  (registers reconstruct-all)
from megamlm.config import ConfigError
from megamlm.objectives import OBJECTIVES, get_objective
from tests.multiproc import run_on_ranks
from tests.test_train import config, logged, tiny_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return tiny_shards(tmp_path_factory, "objectives")


def _train_and_reload(cfg):
    import megamlm
    from megamlm.train.loop import train

    summary = train(cfg)
    model = megamlm.from_pretrained(summary["model_dir"])
    return summary["valid_before"], type(model).__name__


def test_a_second_objective_trains_through_the_same_loop(shards, tmp_path):
    common = ["train.steps=3", "train.eval_batches=2"]
    mlm = config(shards, tmp_path / "mlm", *common)
    other = config(shards, tmp_path / "all", "objective.name=reconstruct-all", *common)
    (mlm_valid, _), = run_on_ranks(_train_and_reload, 1, mlm)
    (all_valid, reloaded), = run_on_ranks(_train_and_reload, 1, other)
    # the same validation samples: MLM scores its ~15% masked tokens, reconstruct-all every real token
    assert all_valid["tokens"] > 4 * mlm_valid["tokens"]
    accuracy = logged(tmp_path / "all", key="accuracy")
    assert sorted(accuracy) == [1, 2, 3] and all(0 <= a <= 1 for a in accuracy.values())
    with pytest.raises(KeyError):
        logged(tmp_path / "mlm", key="accuracy")  # MLM logs no such metric
    assert reloaded == "MaskedLM"  # the folder names its objective; from_pretrained builds its model


def test_an_unknown_objective_is_named_with_the_registered_ones(shards, tmp_path):
    assert {"mlm", "reconstruct-all"} <= set(OBJECTIVES)
    with pytest.raises(ConfigError, match=r"objective.name='t5' is not an objective; allowed: electra \| mlm \| "):
        get_objective(config(shards, tmp_path, "objective.name=t5"))
    with pytest.raises(ConfigError, match=r"objective.name='electr' is not an objective; .*; did you mean "
                                          r"'electra'\?$"):
        get_objective(config(shards, tmp_path, "objective.name=electr"))
