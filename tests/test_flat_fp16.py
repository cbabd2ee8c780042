"""fp16 on the flat engine: its dynamic loss scale follows DeepSpeed's rule (DeepSpeed's own
DynamicLossScaler as the oracle) on the device, an update is AdamW on the unscaled, clipped gradients,
an overflow is skipped and backs the scale off without a host read, an overflow at the scale's floor
rolls the run back (where DeepSpeed stops it), and a run trains and resumes bit for bit with its scale
(DeepSpeed runs fp16 on GPUs only; the flat engine also on a CPU)."""

import json
import math

import pytest
import torch

from megamlm.train import loss_scale
from megamlm.train.loss_scale import DynamicLossScale
from tests.test_flat_engine import _setup
from tests.faults_common import run_cli
from tests.multiproc import run_on_ranks
from tests.test_host_sync import HostReads
from tests.test_train import _train, config, logged, tiny_shards


def test_the_loss_scale_follows_deepspeeds_rule(monkeypatch):
    """Hysteresis 2, a window of 3 and a floor of 16, so that every branch runs within 60 updates."""
    from deepspeed.runtime.fp16 import loss_scaler
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda *args, **kwargs: 0)  # it logs on rank 0

    ours = DynamicLossScale(torch.device("cpu"), initial_scale_power=7, loss_scale_window=3, hysteresis=2,
                            min_loss_scale=16)
    theirs = DynamicLossScaler(init_scale=2.0**7, scale_window=3, min_scale=16, delayed_shift=2,
                               consecutive_hysteresis=False, raise_error_at_min_scale=False)
    flags = [i % 7 == 3 or i % 11 == 5 or 30 <= i < 36 for i in range(60)]
    trajectory = []
    for overflow in flags:
        ours.update(torch.tensor(float(overflow)))
        theirs.update_scale(overflow)
        trajectory.append(theirs.cur_scale)
        assert (ours.scale.item(), int(ours.hysteresis.item())) == (theirs.cur_scale, theirs.cur_hysteresis)
    assert min(trajectory) == 16 and max(trajectory) > 128  # the floor and growth were both reached
    assert ours.state_dict()["cur_iter"] == theirs.cur_iter == 60


def test_an_overflow_at_the_floor_is_flagged_where_deepspeed_raises(monkeypatch):
    """DeepSpeed's scaler raises on an overflow that would halve a scale already at its floor; ours flags
    the same updates (and both go on alike when DeepSpeed is told not to raise)."""
    from deepspeed.runtime.fp16 import loss_scaler
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda *args, **kwargs: 0)
    ours = DynamicLossScale(torch.device("cpu"), initial_scale_power=7, loss_scale_window=3, hysteresis=2,
                            min_loss_scale=16)
    theirs = DynamicLossScaler(init_scale=2.0**7, scale_window=3, min_scale=16, delayed_shift=2,
                               consecutive_hysteresis=False, raise_error_at_min_scale=True)
    flags = [True] * 6 + [False] * 4 + [True] * 4 + [False] * 2
    raised = []
    for overflow in flags:
        ours.update(torch.tensor(float(overflow)))
        try:
            theirs.update_scale(overflow)
            raised.append(False)
        except Exception as err:  # DeepSpeed raises a bare Exception, its state untouched
            assert "minimum" in str(err)
            raised.append(True)
            theirs.raise_error_at_min_scale = False
            theirs.update_scale(overflow)
            theirs.raise_error_at_min_scale = True
        assert bool(ours.floor_overflow.item()) == raised[-1]
        assert (ours.scale.item(), int(ours.hysteresis.item())) == (theirs.cur_scale, theirs.cur_hysteresis)
    # the floor is reached after hysteresis and three halvings, and again after the scale grew back
    assert [i for i, r in enumerate(raised) if r] == [4, 5, 12, 13]


def test_an_fp16_update_is_adamw_on_the_unscaled_clipped_gradients(world):
    _, objective, engine, _, batches = _setup(world, "fp16")
    assert all(p.dtype == torch.float16 for p in engine.module.parameters())
    scale = engine.scaler.scale.item()
    for batch in batches:
        engine.backward(objective.loss(engine, batch).loss_sum.sum())
    # the update by hand from what the backward left: both micro-batches' gradients, scaled, in fp16
    unscaled = engine.grads.double()[engine.start:engine.end] / scale
    norm = unscaled.norm().item()
    factor = max(1.0, (norm + 1e-6) / 0.5)
    assert factor > 1.5 and scale == 128  # clipping active; the scale starts at 2^7
    reference = engine.master.detach().clone().requires_grad_()
    reference.grad = (unscaled / factor).float()
    group = engine.optimizer.param_groups[0]
    torch.optim.AdamW([reference], lr=group["lr"], betas=group["betas"], eps=group["eps"],
                      weight_decay=group["weight_decay"], foreach=False).step()
    engine.step()  # the first micro-batch's call: not yet an update
    engine.step()
    assert abs(engine.get_global_grad_norm().item() - norm) / norm < 1e-6
    assert (engine.master - reference.detach()).abs().max().item() < 1e-6
    assert torch.equal(engine.weights[engine.start:engine.end], engine.master.to(torch.float16))
    assert engine.skipped_steps == 0 and engine.scaler.scale.item() == scale


def test_an_fp16_overflow_is_skipped_and_backs_the_scale_off_without_a_host_read(world):
    _, objective, engine, _, batches = _setup(world, "fp16")
    before = engine.master.clone()
    for overflow in range(2):
        for batch in batches:
            engine.backward(objective.loss(engine, batch).loss_sum.sum())
        next(iter(engine.module.parameters())).grad[0] = float("inf")
        engine.settle_skip()  # the previous update's skip flag: its host copy (pinned memory on a GPU)
        reads = HostReads()
        with reads:
            engine.step()
            engine.step()
        assert not reads.counts, reads.counts
        # the first overflow uses up the hysteresis (2 -> 1), the second halves the scale
        assert (engine.scaler.scale.item(), engine.scaler.hysteresis.item()) == ((128.0, 1.0), (64.0, 1.0))[overflow]
    assert torch.equal(engine.master, before) and engine.skipped_steps == 2


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return tiny_shards(tmp_path_factory, "flat-fp16")


@pytest.mark.slow
def test_an_fp16_run_trains_and_resumes_bit_for_bit_with_its_loss_scale(shards, tmp_path):
    common = ["train.precision=fp16", "train.engine=flat", "train.global_batch_size=8", "train.save_interval=3",
              "optim.clip_grad=1.0"]
    straight = _train(config(shards, tmp_path / "straight", *common, "train.steps=6"))
    _train(config(shards, tmp_path / "resumed", *common, "train.steps=3"))
    resumed = _train(config(shards, tmp_path / "resumed", *common, "train.steps=6"), resume="auto")
    losses = straight["losses"]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert resumed["losses"] == losses[3:]
    assert logged(tmp_path / "straight", key="loss_scale")[6] == 128.0  # logged from the flat engine
    saved = torch.load(tmp_path / "straight/checkpoints/step00000003/mp_rank_00_model_states.pt", weights_only=False)
    assert saved["loss_scaler"] == {"cur_scale": 128.0, "cur_hysteresis": 2, "cur_iter": 3, "last_overflow_iter": -1}


def _overflowing_updates(monkeypatch, count: int):
    """The flat engine's steps from update 3 on see an inf gradient, `count` updates in all; the loss
    scale's floor is 32, so the fourth overflow in a row (128: hysteresis, 64, 32, then the floor)
    is one at the floor."""
    from megamlm.train.flat import FlatEngine

    monkeypatch.setitem(loss_scale.FP16_LOSS_SCALING, "min_loss_scale", 32)
    step, left = FlatEngine.step, [count]

    def step_with_infs(engine):
        last_call = engine.micro_steps % engine.accumulation == engine.accumulation - 1
        if last_call and engine.global_steps >= 2 and left[0]:
            left[0] -= 1
            next(iter(engine.module.parameters())).grad.view(-1)[0] = float("inf")
        step(engine)

    monkeypatch.setattr(FlatEngine, "step", step_with_infs)


def test_an_overflow_at_the_loss_scales_floor_rolls_the_run_back(shards, tmp_path, monkeypatch, capsys):
    """Updates 3-6 overflow: the losses stay finite, and update 6 overflows at the floor. The loop rolls
    back to update 4's checkpoint (scale 64) and trains on; without a checkpoint it stops, saying why."""
    common = ["train.precision=fp16", "train.engine=flat", "train.global_batch_size=8"]
    _overflowing_updates(monkeypatch, 4)
    run = _train(config(shards, tmp_path / "run", *common, "train.steps=8", "train.save_interval=2"))
    assert run["rollbacks"] == 1 and run["steps"] == 8 and all(math.isfinite(loss) for loss in run["losses"])
    printed = capsys.readouterr().out
    assert ("update 6: the gradients of update 6 overflowed fp16 with the loss scale at its minimum (32) -> "
            "rolled back to step00000004") in printed
    events = [json.loads(line) for line in (tmp_path / "run/log.jsonl").read_text().splitlines()]
    scales = [(e["step"], e["loss_scale"]) for e in events if e["event"] == "train"]
    assert [e["step"] for e in events if e["event"] == "rollback"] == [6]
    # 2^7, hysteresis, halved twice (update 6, at the floor, is rolled back before its line); then
    # update 4's checkpoint (64) and no overflow
    assert scales == [(1, 128.0), (2, 128.0), (3, 128.0), (4, 64.0), (5, 32.0),
                      (5, 64.0), (6, 64.0), (7, 64.0), (8, 64.0)]

    # without a checkpoint: the run stops, and `megamlm train` says why in one line (not as an internal error)
    import megamlm.train.loop

    _overflowing_updates(monkeypatch, 4)
    unsaved = config(shards, tmp_path / "unsaved", *common, "train.steps=8")
    train = megamlm.train.loop.train
    monkeypatch.setattr(megamlm.train.loop, "train", lambda cfg, **options: train(unsaved))
    assert run_cli(capsys, "train") == (2, "megamlm: train: training diverged at update 6: the gradients of update "
                                           "6 overflowed fp16 with the loss scale at its minimum (32); no checkpoint "
                                           "to roll back to (lower train.save_interval)")

def _train_with_overflows(cfg, count: int):
    """_train with `_overflowing_updates` (on a rank of its own: run_on_ranks)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _overflowing_updates(monkeypatch, count)
        return _train(cfg)


@pytest.mark.slow
def test_an_overflow_at_the_floor_rolls_back_every_data_parallel_rank_alike(shards, tmp_path):
    """DP=2: the overflow flag is the norm's, reduced over DP, so both ranks roll back at update 6 to
    update 4's checkpoint together and train on to the same losses."""
    cfg = config(shards, tmp_path / "dp2", "train.precision=fp16", "train.engine=flat", "train.global_batch_size=8",
                 "train.steps=8", "train.save_interval=2")
    ranks = run_on_ranks(_train_with_overflows, 2, cfg, 4)
    assert [r["rollbacks"] for r in ranks] == [1, 1] and ranks[0]["losses"] == ranks[1]["losses"]
    assert [e["step"] for e in map(json.loads, (tmp_path / "dp2/log.jsonl").read_text().splitlines())
            if e["event"] == "rollback"] == [6]
