"""Checkpoints on disk: what one takes (`checkpoint_bytes`, which `megamlm plan` prints and a run checks its
free space against) against the folders real runs write in each engine, precision and ZeRO layout; a run
that lacks the space warns; a save that cannot write removes its unfinished folder and says how to go on."""

import json
import os
import re
import shutil

import pytest

from megamlm.plan import parameter_count
from megamlm.train.checkpoint import SaveError, checkpoint_bytes
from tests.faults_common import file_size_limit, megamlm, one_line, snapshot, tiny
from tests.multiproc import run_on_ranks
from tests.test_train import _train, config, tiny_shards

# (world size, overrides, bytes per parameter the layout writes)
LAYOUTS = [
    (1, ["train.precision=fp32"], 12),  # DeepSpeed stage 0: fp32 weights + moments
    (1, ["train.precision=bf16", "train.zero_stage=1"], 14),  # + bf16 weights beside ZeRO's fp32 copy
    (1, ["train.precision=fp32", "objective.name=electra"], 12),  # two models: the objective's count
    (2, ["train.precision=fp32", "train.zero_stage=1"], 16),  # fp32 weights + ZeRO's own fp32 copy
    (2, ["train.precision=bf16", "train.zero_stage=3"], 12),  # ZeRO-3: no weights in the model files
    (2, ["train.precision=bf16", "train.engine=flat"], 12),  # the flat engine: stage-0 layout
    (2, ["train.precision=bf16", "train.zero_stage=2", "parallel.tensor_parallel=2"], 14),
]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return tiny_shards(tmp_path_factory, "checkpoint-size")


def _runs(cfgs):
    return [_train(cfg) for cfg in cfgs]


@pytest.mark.slow
def test_checkpoint_bytes_is_every_layouts_folder_within_2_percent(shards, tmp_path):
    cfgs = {}
    for world in (1, 2):
        runs = [(i, config(shards, tmp_path / f"layout{i}", "train.steps=2", *overrides))
                for i, (w, overrides, _) in enumerate(LAYOUTS) if w == world]
        run_on_ranks(_runs, world, [cfg for _, cfg in runs])
        cfgs.update(runs)
    for i, (world, overrides, per_parameter) in enumerate(LAYOUTS):
        cfg = cfgs[i]
        folder = tmp_path / f"layout{i}/checkpoints/step00000002"
        written = sum(f.stat().st_size for f in folder.iterdir())
        dp = world // cfg.parallel.tensor_parallel
        predicted = checkpoint_bytes(cfg, parameter_count(cfg), dp)
        assert predicted == per_parameter * parameter_count(cfg)
        assert abs(written / predicted - 1) < 0.02, (overrides, written, predicted)


@pytest.mark.slow
def test_a_run_whose_checkpoints_will_not_fit_says_so_in_its_log_and_trains(shards, tmp_path):
    cfg = config(shards, tmp_path / "run", "train.steps=1", "train.keep_last=10000000")  # ~400 TB
    run_on_ranks(_runs, 1, [cfg])
    events = [json.loads(line) for line in (tmp_path / "run/log.jsonl").read_text().splitlines()]
    (warning,) = [e["message"] for e in events if e["event"] == "warning"]
    assert f"{tmp_path / 'run/checkpoints'} has " in warning and " GiB free" in warning
    assert "(10000000 kept (train.keep_last) + 1 being written, ~0.04 GiB each)" in warning
    assert [e["step"] for e in events if e["event"] == "summary"] == [1]


@pytest.mark.slow
@pytest.mark.faults
def test_a_save_that_cannot_write_removes_its_folder_keeps_the_complete_ones_and_says_how_to_go_on(shards, tmp_path):
    run_dir = tmp_path / "run"
    first = megamlm("train", *tiny(shards, run_dir, "train.steps=2", "train.save_interval=2"))
    assert first.returncode == 0, first.stderr[-3000:]
    before = snapshot(run_dir / "checkpoints")
    # resumed, the next checkpoint's model file (~40 MB) stops at 20 MB
    resumed = megamlm("train", "--resume", "auto", *tiny(shards, run_dir, "train.steps=4", "train.save_interval=2"),
                      preexec_fn=file_size_limit(20 * 2**20))
    assert resumed.returncode == 2
    line = one_line(resumed.stderr)
    assert re.fullmatch(rf"megamlm: train: saving checkpoint step00000004 failed \(RuntimeError: .+\); its "
                        rf"unfinished folder is removed, {run_dir}/checkpoints has \d+\.\d\d GiB free; a checkpoint "
                        rf"of this run takes 0\.04 GiB; --resume auto continues from step00000002", line), line
    assert snapshot(run_dir / "checkpoints") == before  # step 2 as it was, `latest` naming it



def _train_with_one_rank_writing_at_most(cfg, limit: int, rank: int) -> str:
    """What a rank's run ends with when rank `rank` alone cannot write past `limit` bytes (its node's disk)."""
    if int(os.environ["RANK"]) == rank:
        file_size_limit(limit)()
    try:
        _train(cfg)
    except SaveError as err:
        return str(err)
    return "trained"


@pytest.mark.slow
@pytest.mark.faults
def test_a_save_that_one_rank_cannot_write_ends_every_rank_with_its_line_and_no_checkpoint(shards, tmp_path):
    run_dir = tmp_path / "run"
    cfg = config(shards, run_dir, "train.steps=2", "train.save_interval=2", "train.precision=bf16",
                 "train.zero_stage=1")
    # rank 1's ZeRO file (~20 MB) stops at 3 MB; rank 0 writes all of its own
    rank0, rank1 = run_on_ranks(_train_with_one_rank_writing_at_most, 2, cfg, 3 * 2**20, 1)
    assert rank1.startswith("saving checkpoint step00000002 failed (RuntimeError: "), rank1
    # rank 0 lost rank 1 in a collective, or (still writing) its folder, which rank 1 removed as it failed
    assert rank0.startswith(("saving checkpoint step00000002 failed (another rank's process ended: Connection ",
                             "saving checkpoint step00000002 failed (another rank's writing failed first and removed "
                             "the unfinished folder)")), rank0
    for line in (rank0, rank1):
        assert line.endswith("; no complete checkpoint yet: a new run starts over"), line
    left = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert not any(name.startswith("step") or name == "latest" for name in left), left  # DeepSpeed's scripts stay


def test_a_rank_whose_folder_the_failing_rank_removed_says_so_not_no_such_file(world, tmp_path):
    """The race that the two-rank test above can lose either way, made to happen: while this rank writes its
    files, the rank whose writing failed removes the unfinished folder (`_failed_save`); this rank's next open
    fails with ENOENT, which said "RuntimeError: ... open file failed: No such file or directory"."""
    from megamlm.config import load_config
    from megamlm.train.checkpoint import Checkpoints, TrainState

    class EngineOfALaterRank:
        def save_checkpoint(self, root, tag, save_latest):
            folder = os.path.join(root, tag)
            os.makedirs(folder)  # as DeepSpeed does, then writes its first file ...
            with open(os.path.join(folder, "mp_rank_00_model_states.pt"), "wb") as out:
                out.write(b"weights")
            shutil.rmtree(folder)  # ... when the failing rank removes the folder
            with open(os.path.join(folder, "zero_pp_rank_0_mp_rank_00_optim_states.pt"), "wb"):
                pass

    with pytest.raises(SaveError) as raised:
        Checkpoints(tmp_path, keep_last=2).save(EngineOfALaterRank(), TrainState(step=4), load_config([]))
    assert re.fullmatch(re.escape(
        f"saving checkpoint step00000004 failed (another rank's writing failed first and removed the unfinished "
        f"folder); its unfinished folder is removed, {tmp_path}/checkpoints has ") + r"[0-9.]+" + re.escape(
        " GiB free; no complete checkpoint yet: a new run starts over"), str(raised.value)), str(raised.value)
    assert list((tmp_path / "checkpoints").iterdir()) == []
