"""optim.schedule=wsd (warmup-stable-decay, ModernBERT's trapezoid): transformers' get_wsd_schedule value for
value, its default and bad settings, and a real run that logs it and continues it with more updates."""

import typing

import pytest
import torch

from megamlm.config import ConfigError, OptimConfig, load_config
from megamlm.train.schedule import WSD_DECAY_SHAPES, lr_at
from tests.multiproc import run_on_ranks
from tests.test_train import _train, config, logged, shards  # noqa: F401 (fixture)


def _wsd(*overrides, steps=20):
    return load_config([], ["optim.schedule=wsd", "optim.lr=2e-3", "optim.min_lr=1e-4", "optim.warmup_steps=3",
                            f"train.steps={steps}", *overrides]).optim


def test_every_decay_shape_named_in_the_config_has_its_formula():
    assert set(WSD_DECAY_SHAPES) == set(typing.get_args(typing.get_type_hints(OptimConfig)["decay_shape"]))


@pytest.mark.parametrize("shape", sorted(WSD_DECAY_SHAPES))
def test_wsd_is_transformers_get_wsd_schedule(shape):
    """The same learning rate at every update, the warm-up from min_lr and the floor after the run
    included (transformers: min_lr_ratio = min_lr / lr; num_cycles 0.5, its default, is our half cosine)."""
    from transformers import get_wsd_schedule

    optim = _wsd("optim.decay_steps=6", f"optim.decay_shape={shape}")
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=optim.lr)
    theirs = get_wsd_schedule(optimizer, num_warmup_steps=3, num_decay_steps=6, num_training_steps=20,
                              min_lr_ratio=optim.min_lr / optim.lr, decay_type=shape)
    expected = []
    for _ in range(24):
        expected.append(theirs.get_last_lr()[0])
        optimizer.step()
        theirs.step()
    ours = [lr_at(t, optim, 20) for t in range(24)]
    assert ours == pytest.approx(expected, rel=1e-12, abs=0)
    assert ours[3:14] == [2e-3] * 11  # stable: the peak exactly
    assert ours[0] == 1e-4 and ours[20:] == [1e-4] * 4
    assert len(set(ours[14:21])) == 7  # every decay update lowers it


def test_the_decay_defaults_to_a_fifth_of_the_run_and_a_longer_run_moves_it():
    optim = _wsd(steps=100)
    assert optim.decay_steps is None and optim.wsd_decay_steps(100) == 20
    assert [lr_at(t, optim, 100) for t in (79, 80)] == [2e-3, 2e-3]  # p = 0 at the decay's first update
    assert lr_at(81, optim, 100) == pytest.approx(1e-4 + 1.9e-3 * (1 - 0.05 ** 0.5), rel=1e-12)
    assert lr_at(95, optim, 200) == 2e-3  # continued to 200 updates: still stable until 160


@pytest.mark.parametrize("overrides, message", [
    (["optim.decay_steps=18"], "optim.schedule=wsd: optim.warmup_steps=3 + optim.decay_steps=18 exceed "
                               "train.steps=20; lower them or raise train.steps"),
    (["optim.warmup_steps=17"], "optim.warmup_steps=17 + optim.decay_steps=null (4: a fifth of the run) exceed "
                                "train.steps=20"),
    (["optim.decay_steps=0"], "optim.decay_steps=0 must be >= 1"),
    (["optim.decay_shape=sqrt"], "optim.decay_shape='sqrt' is invalid; allowed: 1-sqrt | linear | cosine; "
                                 "did you mean '1-sqrt'?"),
])
def test_bad_wsd_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        _wsd(*overrides)
    assert str(err.value).startswith("command line: ") and message in str(err.value)


def test_other_schedules_ignore_the_wsd_keys():
    cosine = load_config([], ["optim.decay_steps=50", "train.steps=20", "optim.warmup_steps=10"]).optim
    assert lr_at(15, cosine, 20) == lr_at(15, load_config([], ["optim.warmup_steps=10"]).optim, 20)


def _train_then_continue(first, longer):
    _train(first)
    _train(longer, resume="auto")


def test_a_wsd_run_logs_its_schedule_and_continues_at_the_peak_with_more_updates(shards, tmp_path):  # noqa: F811
    """8 updates (warm-up 3, decay 2: updates 6-7), then resumed with train.steps=12: the decay moves to
    updates 10-11, so the continued updates 8 and 9 run at the peak (WSD's point: a run extends without
    starting its schedule over)."""
    wsd = ["optim.schedule=wsd", "optim.decay_steps=2", "train.save_interval=8"]
    first = config(shards, tmp_path / "run", *wsd)
    longer = config(shards, tmp_path / "run", *wsd, "train.steps=12")
    run_on_ranks(_train_then_continue, 1, first, longer)
    lrs = logged(tmp_path / "run", key="lr")
    # a log line after update s shows the rate of the next update, lr_at(s): the first run's, then the longer's
    assert lrs == {**{s: lr_at(s, first.optim, 8) for s in range(1, 9)},
                   **{s: lr_at(s, longer.optim, 12) for s in range(9, 13)}}
    peak, floor = longer.optim.lr, longer.optim.min_lr
    assert [lrs[s] for s in (6, 7, 8)] == [peak, pytest.approx(floor + (peak - floor) * (1 - 0.5 ** 0.5)), floor]
    assert [lrs[s] for s in (9, 10, 11, 12)] == [peak, peak, lrs[7], floor]
    # the resume says so: the run ended at the floor, and its next update runs at the peak again
    assert logged(tmp_path / "run", "resume", "message")[8].endswith(
        "changed since the checkpoint: train.steps 8 -> 12; the next update's learning rate 0.0001 -> 0.002")
