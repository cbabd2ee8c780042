"""One data-parallel rank runs fp32 without ZeRO (issue 22): the same losses as the ZeRO-1 engine it
replaces (bit for bit without clipping), the same gradient norm logged and clipped, checkpoints that
resume on the engine that wrote them and convert, and bf16 on CPU."""

import json
from pathlib import Path

import pytest

from megamlm.config import ConfigError, load_config
from megamlm.model.names import WORD_EMBEDDINGS
from megamlm.train.engine import deepspeed_config
from tests.multiproc import run_on_ranks
from tests.test_train import _train, config, logged, tiny_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return tiny_shards(tmp_path_factory, "engine")


def test_fp32_on_one_rank_runs_without_zero_and_other_layouts_keep_the_stage():
    fp32 = load_config([], ["train.zero_stage=2"])
    assert fp32.train.engine_zero_stage(1) == 0 and deepspeed_config(fp32, 1)["zero_optimization"] == {"stage": 0}
    assert fp32.train.engine_zero_stage(2) == 2 and deepspeed_config(fp32, 2)["zero_optimization"] == {"stage": 2}
    bf16 = load_config([], ["train.zero_stage=1", "train.precision=bf16", "optim.clip_grad=1.0"])
    assert bf16.train.engine_zero_stage(1) == 1 and deepspeed_config(bf16, 1)["gradient_clipping"] == 1.0
    clipped = load_config([], ["optim.clip_grad=1.0"])
    assert deepspeed_config(clipped, 1)["gradient_clipping"] == 0.0  # the optimizer's pre-hook clips
    assert deepspeed_config(clipped, 2)["gradient_clipping"] == 1.0


def _zero1_file(tmp_path, clip: float):
    """The engine DP=1 fp32 runs used before: DeepSpeed ZeRO-1 (a user's JSON keeps its stage)."""
    path = tmp_path / f"zero1-{clip}.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_clipping": clip,
                                "zero_allow_untested_optimizer": True, "steps_per_print": 2**31 - 1}))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_stage0_equals_the_zero1_engine_in_losses_and_gradient_norms(shards, tmp_path, clip, capsys):
    common = ["train.global_batch_size=8", "train.steps=6", f"optim.clip_grad={clip}"]  # accumulation 2
    plain = _train(config(shards, tmp_path / "plain", *common))
    assert "ZeRO-0 fp32" in capsys.readouterr().out  # the start line says which engine runs
    zero1 = _train(config(shards, tmp_path / "zero1", *common, f"train.deepspeed_config={_zero1_file(tmp_path, clip)}"))
    norms, zero1_norms = logged(tmp_path / "plain", key="grad_norm"), logged(tmp_path / "zero1", key="grad_norm")
    assert len(norms) == 6 and all(n > 0 for n in norms.values())
    if clip == 0:
        assert plain["losses"] == zero1["losses"]  # bit for bit
    else:  # ZeRO divides by norm/clip, the hook multiplies by clip/norm: rounding differs, by a few ulps of the
        # fp32 loss sum (~1e-6 of the mean each): 1e-6 on the AMD EPYC of sessions 1-27, 2.0e-6 at update 6 on an
        # AVX-512 Xeon (session 28; the same at 1fa9020), the five updates before it bit for bit
        assert max(abs(a - b) for a, b in zip(plain["losses"], zero1["losses"])) < 5e-6
        assert min(norms.values()) > clip  # clipping was active at every update
    # ZeRO-1's own norm reads ~5e-5 higher than the L2 norm of the gradients both engines apply (the
    # losses above are bit-identical); the hook's is that L2 norm
    assert max(abs(norms[s] - zero1_norms[s]) / zero1_norms[s] for s in norms) < 1e-3


def _train_counting_flattened_gradients(cfg) -> int:
    """_train, counting DeepSpeed's flattenings of the gradients into one all-reduce buffer."""
    import deepspeed.runtime.engine as deepspeed_engine

    calls = []
    flatten = deepspeed_engine._flatten_dense_tensors  # the engine takes it as self.flatten when built

    def counted(tensors):
        calls.append(len(tensors))
        return flatten(tensors)

    deepspeed_engine._flatten_dense_tensors = counted
    _train(cfg)
    return len(calls)


def test_one_rank_does_not_all_reduce_its_gradients_over_itself(shards, tmp_path):
    """Stage 0 on one data-parallel rank: DeepSpeed would copy every gradient into one buffer, all-reduce it over
    a group of one and copy it back, each update (~4% of the CPU demo's update); the losses are those of ZeRO-1
    (test_stage0_equals_the_zero1_engine_in_losses_and_gradient_norms)."""
    cfg = config(shards, tmp_path / "run", "train.steps=3")
    assert run_on_ranks(_train_counting_flattened_gradients, 1, cfg) == [0]


def _train_and_deepspeeds_shared_memory_op(cfg):
    import os

    import deepspeed.comm.comm as deepspeed_comm

    os.environ["LOCAL_SIZE"] = "2"  # as the `deepspeed` launcher says it: all ranks on this machine
    return _train(cfg)["steps"], deepspeed_comm.cdb.shm_comm_op is None


def test_deepspeed_starts_without_compiling_its_inference_all_reduce(shards, tmp_path):
    """DeepSpeed's CPU backend would compile (a minute on a machine's first run) and load a shared-memory
    all-reduce that only DeepSpeed-Inference uses, and under its launcher (all ranks on one machine) leave each
    rank's 66 MiB buffer in /dev/shm (RAM) after the run (DeepSpeed 0.19.8 never unlinks it); two data-parallel
    ranks train through torch.distributed."""
    def buffers():
        return {p.name for p in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")}

    before = buffers()
    cfg = config(shards, tmp_path / "run", "train.steps=2")
    assert run_on_ranks(_train_and_deepspeeds_shared_memory_op, 2, cfg) == [(2, True), (2, True)]
    assert buffers() - before == set()


def test_without_clipping_only_updates_with_a_log_line_compute_the_norm(shards, tmp_path, monkeypatch):
    """optim.clip_grad=0 on the stage-0 fp32 path: the norm is only logged, so only the updates with a log line
    compute it (3, 6 and the last, 8), bit for bit what a run logging every update reads; also after a resume
    (the hook counts updates as the engine does, which the checkpoint restores)."""
    import torch

    _train(config(shards, tmp_path / "every", "optim.clip_grad=0"))  # a line after every update
    expected = logged(tmp_path / "every", key="grad_norm")
    norms = []  # the gradient norm's passes over the gradients
    foreach_norm = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda tensors: norms.append(1) or foreach_norm(tensors))
    some = ["optim.clip_grad=0", "train.log_interval=3"]
    _train(config(shards, tmp_path / "some", *some))
    assert len(norms) == 3
    assert logged(tmp_path / "some", key="grad_norm") == {step: expected[step] for step in (3, 6, 8)}
    _train(config(shards, tmp_path / "resumed", *some, "train.steps=4", "train.save_interval=4"))
    _train(config(shards, tmp_path / "resumed", *some), resume="auto")  # 4: the first part's last update
    assert logged(tmp_path / "resumed", key="grad_norm") == {step: expected[step] for step in (3, 4, 6, 8)}


@pytest.mark.slow
def test_checkpoints_resume_on_the_engine_that_wrote_them(shards, tmp_path, capsys):
    """A stage-0 checkpoint resumes and converts; a ZeRO-1 one written at DP=1 (before the stage-0
    rule) resumes on ZeRO-1 with the losses of its uninterrupted run; a user's JSON that asks for
    another stage gets the checkpoint resharded into it."""
    from megamlm.convert.zero import consolidate

    steps = ["train.steps=4", "train.save_interval=2"]
    straight = _train(config(shards, tmp_path / "straight", *steps))
    _train(config(shards, tmp_path / "resumed", "train.steps=2", "train.save_interval=2"))
    resumed = _train(config(shards, tmp_path / "resumed", *steps), resume="auto")
    assert resumed["losses"] == straight["losses"][2:]
    cfg, full, _ = consolidate(tmp_path / "straight")  # stage-0 files: the whole model in mp_rank_00
    assert cfg.train.zero_stage == 1 and full[WORD_EMBEDDINGS].shape[0] >= 50265
    zero1 = f"train.deepspeed_config={_zero1_file(tmp_path, 0.0)}"
    zero1_straight = _train(config(shards, tmp_path / "zero1", *steps, zero1))
    _train(config(shards, tmp_path / "old", *steps, zero1, "train.steps=2"))
    capsys.readouterr()
    old = _train(config(shards, tmp_path / "old", *steps), resume="auto")  # no JSON now
    assert "ZeRO-1 fp32" in capsys.readouterr().out
    assert old["losses"] == zero1_straight["losses"][2:]
    # a user's JSON that asks for another stage: the checkpoint is resharded into that engine
    stage2 = tmp_path / "stage2.json"
    stage2.write_text(json.dumps({"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}))
    _train(config(shards, tmp_path / "old2", *steps, zero1, "train.steps=2"))
    capsys.readouterr()
    moved = _train(config(shards, tmp_path / "old2", *steps, f"train.deepspeed_config={stage2}"), resume="auto")
    out = capsys.readouterr().out
    assert "ZeRO-2 fp32" in out and "resumed update 2 written at TP=1 DP=1 ZeRO-1 into TP=1 DP=1 ZeRO-2" in out
    # the first update after the resume is the uninterrupted run's (weights, dropout streams carried);
    # then DeepSpeed's stage-2 arithmetic differs from stage 1's (uninterrupted stage-1 and stage-2
    # runs at DP=1 differ by ~4e-3 at update 4, with or without dropout)
    assert moved["losses"][0] == zero1_straight["losses"][2]
    assert max(abs(a - b) for a, b in zip(moved["losses"], zero1_straight["losses"][2:])) < 1e-2


def test_bf16_trains_on_cpu(shards, tmp_path):
    """DeepSpeed casts parameters, not buffers, to bf16: the heads' fp32 column bias must follow."""
    run = _train(config(shards, tmp_path / "bf16", "train.precision=bf16", "train.steps=4"))
    assert len(run["losses"]) == 4 and run["losses"][-1] < run["losses"][0]


def test_bf16_without_the_nonfinite_scan_trains_the_same_losses(shards, tmp_path):
    """train.skip_nonfinite_updates=false turns off DeepSpeed's per-gradient inf/NaN scan (and its two
    waits for the device per update); with finite gradients the updates are the scanning run's."""
    scanned = _train(config(shards, tmp_path / "scan", "train.precision=bf16", "train.steps=4"))
    unscanned_cfg = config(shards, tmp_path / "noscan", "train.precision=bf16", "train.steps=4",
                           "train.skip_nonfinite_updates=false")
    assert deepspeed_config(unscanned_cfg, 1)["bf16"] == {"enabled": True, "check_grad_overflow": False}
    assert _train(unscanned_cfg)["losses"] == scanned["losses"]
    with pytest.raises(ConfigError, match="skip_nonfinite_updates=false needs train.precision=bf16"):
        config(shards, tmp_path / "fp16", "train.precision=fp16", "train.skip_nonfinite_updates=false")


@pytest.mark.slow
def test_zero1_without_the_contiguous_gradient_buffer_trains_the_same_losses(shards, tmp_path):
    """Stage 1 runs without DeepSpeed's contiguous gradient buffer (a bucket copy of every gradient in
    every micro-batch: host work on a GPU): bf16, DP=2, accumulation 2, the buffered engine's losses."""
    common = ["train.precision=bf16", "train.micro_batch_size=2", "train.global_batch_size=8", "train.steps=4"]
    default = config(shards, tmp_path / "default", *common)
    assert deepspeed_config(default, 2)["zero_optimization"] == {"stage": 1, "contiguous_gradients": False}
    buffered_file = tmp_path / "buffered.json"
    buffered_file.write_text(json.dumps({**deepspeed_config(default, 2), "zero_optimization": {"stage": 1}}))
    buffered = config(shards, tmp_path / "buffered", *common, f"train.deepspeed_config={buffered_file}")
    losses = [run_on_ranks(_train, 2, cfg)[0]["losses"] for cfg in (default, buffered)]
    assert len(losses[0]) == 4 and losses[0] == losses[1]


def test_deepspeeds_stop_at_the_fp16_scale_floor_is_told_as_a_diverged_run(monkeypatch):
    """DeepSpeed's own scaler raises its bare Exception at the floor; the fp16 engine's step says it as
    TrainingDiverged (the CLI: one line, exit 2). Other errors pass through unchanged."""
    import types

    from deepspeed.runtime.fp16 import loss_scaler
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from megamlm.train.engine import stopping_at_the_scale_floor
    from megamlm.train.guard import TrainingDiverged

    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda *args, **kwargs: 0)
    scaler = DynamicLossScaler(init_scale=16, scale_window=1000, min_scale=16, delayed_shift=1,
                               consecutive_hysteresis=False, raise_error_at_min_scale=True)
    engine = types.SimpleNamespace(global_steps=41)
    step = stopping_at_the_scale_floor(lambda: scaler.update_scale(True), engine)
    with pytest.raises(TrainingDiverged, match=r"^training diverged at update 42: its fp16 gradients overflowed "
                                               r"with DeepSpeed's loss scale at its minimum \(0\.0001\); resume from "
                                               r"an earlier checkpoint \(--resume TAG\), or train with "
                                               r"train.engine=flat") as diverged:
        step()
    assert isinstance(diverged.value, RuntimeError) and "already at minimum" in str(diverged.value.__cause__)

    def failing():
        raise ValueError("something else")

    with pytest.raises(ValueError, match="something else"):
        stopping_at_the_scale_floor(failing, engine)()
