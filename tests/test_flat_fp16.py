"""fp16 on the flat engine: its dynamic loss scale follows DeepSpeed's rule (DeepSpeed's own
DynamicLossScaler as the oracle) on the device, an update is AdamW on the unscaled, clipped gradients,
an overflow is skipped and backs the scale off without a host read, and a run trains and resumes bit
for bit with its scale (DeepSpeed runs fp16 on GPUs only; the flat engine also on a CPU)."""

import pytest
import torch

from megamlm.train.loss_scale import DynamicLossScale
from tests.test_flat_engine import _setup
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
