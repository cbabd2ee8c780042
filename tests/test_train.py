"""Training on real gloo ranks: exact resume after SIGKILL, ZeRO stages vs DP=1, TP=2 vs TP=1,
preemption by SIGTERM, spike / NaN rollback, schedule values, DeepSpeed JSON generation."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from megamlm.config import ConfigError, load_config
from megamlm.data.shards import BuildOptions, build_shards
from megamlm.data.tokenizer import Tokenizer
from megamlm.train.engine import deepspeed_config
from megamlm.train.schedule import lr_at
from megamlm.train.profiling import PHASES, UpdateProfiler, host_phase_ms
from tests.multiproc import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def tiny_shards(tmp_path_factory, name: str) -> Path:
    """Shards of 300k characters of WikiText at length 64, with a valid split (the tiny runs' data)."""
    folder = tmp_path_factory.mktemp(name) / "shards"
    text = tmp_path_factory.getbasetemp() / f"{name}-corpus.txt"
    text.write_text((ROOT / "data/wikitext-103/valid.txt").read_text()[:300_000])
    build_shards(BuildOptions([str(text)], str(folder), seq_length=64, long_docs="split",
                              valid_fraction=0.1, shard_tokens=8_000), Tokenizer.gpt2(), progress=False)
    return folder


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return tiny_shards(tmp_path_factory, "train")


def tiny_job(shards) -> list[str]:
    """Overrides of a two-layer, 64-wide model on `shards`, 4 samples of 64 tokens per micro-batch."""
    return ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=128",
            "model.max_positions=64", f"data.shards={shards}", "data.seq_length=64", "train.micro_batch_size=4"]


def config(shards, run_dir, *overrides, variant="baseline"):
    base = [*tiny_job(shards), "data.shuffle_window=64", f"train.run_dir={run_dir}",
            "optim.lr=2e-3", "optim.min_lr=1e-4", "optim.warmup_steps=3",
            "train.log_interval=1", "train.eval_interval=1000", "train.eval_batches=2",
            "train.save_interval=1000", "train.steps=8"]
    return load_config([CONFIGS / f"variants/{variant}.yaml"], base + list(overrides))


def logged(run_dir, event="train", key="loss"):
    lines = (Path(run_dir) / "log.jsonl").read_text().splitlines()
    return {e["step"]: e[key] for e in map(json.loads, lines) if e["event"] == event}


def _train(cfg, resume=None, kill_at=None, hook=None):
    from megamlm.train.loop import train

    def loss_hook(step, loss):
        if kill_at is not None and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup at all, as a node failure
        return hook(step, loss) if hook else loss

    summary = train(cfg, resume=resume, loss_hook=loss_hook)
    return {k: summary[k] for k in ("losses", "rollbacks", "steps") if k in summary}


def _straight_then_resume(cfg_straight, cfg_killed):
    # one process group for both runs: train() re-initializes only the TP x DP groups
    return _train(cfg_straight), _train(cfg_killed, resume="auto")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["parallel.tensor_parallel=1", "train.zero_stage=1"],  # DP=2, ZeRO-1
    ["parallel.tensor_parallel=2", "train.zero_stage=1"],  # TP=2
], ids=["dp2-zero1", "tp2"])
def test_resume_after_sigkill_reproduces_the_uninterrupted_losses(shards, tmp_path, layout):
    steps = ["train.steps=10", "train.save_interval=5", "model.hidden_dropout=0.1",
             "model.attention_dropout=0.1"]
    killed = config(shards, tmp_path / "killed", *layout, *steps)
    with pytest.raises(RuntimeError, match="died without a result"):
        run_on_ranks(_train, 2, killed, None, 7)  # killed during update 7; last checkpoint: 5
    assert (tmp_path / "killed/checkpoints/latest").read_text() == "step00000005"
    straight = config(shards, tmp_path / "straight", *layout, *steps)
    (full, resumed), _ = run_on_ranks(_straight_then_resume, 2, straight, killed)
    assert len(full["losses"]) == 10 and len(resumed["losses"]) == 5
    assert resumed["losses"] == full["losses"][5:]  # bit for bit
    assert logged(tmp_path / "killed", "resume", "step") == {5: 5}


def _zero_runs(cfgs):
    return [_train(cfg) for cfg in cfgs]


@pytest.mark.slow
def test_zero_stages_on_two_ranks_match_one_rank_with_the_same_global_batch(shards, tmp_path):
    common = ["train.global_batch_size=8", "model.hidden_dropout=0", "model.attention_dropout=0"]
    (reference,) = run_on_ranks(_zero_runs, 1, [config(shards, tmp_path / "dp1", *common)])[0]
    stages = [config(shards, tmp_path / f"z{z}", *common, f"train.zero_stage={z}") for z in range(4)]
    results = run_on_ranks(_zero_runs, 2, stages)[0]
    assert len(reference["losses"]) == 8 and reference["losses"][-1] < reference["losses"][0] - 0.2
    for stage, result in enumerate(results):
        diff = max(abs(a - b) for a, b in zip(result["losses"], reference["losses"]))
        assert diff < 1e-4, f"ZeRO-{stage}: losses differ from DP=1 by {diff}"


@pytest.mark.slow
def test_tp2_training_matches_tp1_with_the_same_grad_norm(shards, tmp_path):
    common = ["train.steps=20", "optim.clip_grad=1.0", "model.attention_dropout=0"]
    one = run_on_ranks(_zero_runs, 1, [config(shards, tmp_path / "tp1", *common)])[0][0]
    two = run_on_ranks(_zero_runs, 2, [config(shards, tmp_path / "tp2", *common,
                                                "parallel.tensor_parallel=2")])[0][0]
    assert max(abs(a - b) for a, b in zip(one["losses"], two["losses"])) < 1e-4
    norms_one, norms_two = logged(tmp_path / "tp1", key="grad_norm"), logged(tmp_path / "tp2", key="grad_norm")
    assert len(norms_one) == 20 and all(n > 0 for n in norms_one.values())
    assert max(abs(norms_one[s] - norms_two[s]) / norms_one[s] for s in norms_one) < 1e-4


class InjectOnce:
    """A loss hook (picklable for the rank processes): NaN at update 5, then a 10x spike at updates
    10 and 11; each fires once, so the rerun after a rollback is clean."""

    def __init__(self):
        self.fired = set()

    def __call__(self, step, loss):
        if step == 5 and "nan" not in self.fired:
            self.fired.add("nan")
            return float("nan")
        if step in (10, 11) and step not in self.fired:
            self.fired.add(step)
            return loss * 10
        return loss


@pytest.mark.slow
def test_compiled_training_gives_the_eager_losses_and_reports_the_compile_time(shards, tmp_path):
    """train.compile=true (and train.compile_mode): the loop's losses are the eager loop's (dropout
    off: Inductor draws its own masks), and the first update's time, compilation included, is logged
    once."""
    no_dropout = ("train.steps=3", "model.hidden_dropout=0", "model.attention_dropout=0")
    eager = run_on_ranks(_train, 1, config(shards, tmp_path / "eager", *no_dropout))[0]
    # reduce-overhead (CUDA graphs on a GPU) compiles as the default mode on CPU
    compiled = run_on_ranks(_train, 1, config(shards, tmp_path / "compiled", *no_dropout, "train.compile=true",
                                              "train.compile_mode=reduce-overhead"))[0]
    assert len(compiled["losses"]) == 3
    torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-4, atol=0)
    first = logged(tmp_path / "compiled", "compile", "first_update_s")
    assert list(first) == [1] and first[1] > 0
    assert logged(tmp_path / "eager", "compile", "first_update_s") == {}


def _train_counting_graphs(cfg):
    """_train, and how many graphs torch.compile made in this process."""
    from torch._dynamo.utils import counters

    return _train(cfg), counters["stats"]["unique_graphs"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["baseline", "zero-clap"])
def test_a_compiled_head_gives_the_eager_losses_with_one_graph_for_every_batch(shards, tmp_path, variant):
    """train.compile_head: the RoBERTa and CLAP heads with their loss, compiled once although every batch
    masks another number of positions (one graph with gradients, one for validation)."""
    eager = run_on_ranks(_train, 1, config(shards, tmp_path / "eager", "train.steps=4", variant=variant))[0]
    compiled, graphs = run_on_ranks(_train_counting_graphs, 1, config(
        shards, tmp_path / "compiled", "train.steps=4", "train.compile_head=true", variant=variant))[0]
    torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-5, atol=0)
    assert graphs == 2


def test_a_changed_backward_formula_is_not_served_from_torchs_compile_cache():
    """A custom op's backward formula is traced into the compiled backward graph but is not in
    AOTAutograd's cache key (pytorch#144344): compiled through the loop's entry point (`compile_head`),
    a second compilation after the formula changed must use the new formula, not the cached one."""
    import types
    import uuid

    from megamlm.train.layers import compile_head

    @torch.library.custom_op(f"megamlm_tests::double_{uuid.uuid4().hex}", mutates_args=())
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    double.register_fake(torch.empty_like)
    x = torch.randn(8, requires_grad=True)
    for factor in (2.0, 3.0):  # the true gradient's 2, then a changed (wrong, but telling) formula's 3
        double.register_autograd(lambda ctx, grad, factor=factor: grad * factor)
        torch._dynamo.reset()  # Dynamo's in-memory cache: what remains is the on-disk one
        model = types.SimpleNamespace(loss_sum=lambda x: double(x.sin()).sum())
        compile_head(model)
        (grad,) = torch.autograd.grad(model.loss_sum(x), x)
        torch.testing.assert_close(grad, factor * x.detach().cos())


def test_compile_head_is_refused_where_it_does_not_apply():
    for override, named in (("parallel.tensor_parallel=2", "parallel.tensor_parallel=2"),
                            ("model.head_loss=fused", "model.head_loss=fused"),
                            ("train.zero_stage=3", "train.zero_stage=3"), ("objective.name=electra", "objective.name")):
        with pytest.raises(ConfigError, match=f"train.compile_head=true .*{named}.* needs train.compile_head=false"):
            load_config([CONFIGS / "variants/baseline.yaml"], ["train.compile_head=true", override])


def test_every_compile_mode_is_torchs_and_the_loop_knows_which_record_cuda_graphs():
    """train.compile_mode's values are torch.compile's modes (torch refuses others), and the loop marks
    a CUDA-graph step per micro-batch for each mode that records graphs, max-autotune included (its
    replays would otherwise overwrite the previous micro-batch's outputs, as session 24's lease saw)."""
    import typing

    from megamlm.config import TrainConfig
    from megamlm.train.layers import records_cuda_graphs

    modes = typing.get_args(typing.get_type_hints(TrainConfig)["compile_mode"])
    assert {mode for mode in modes if records_cuda_graphs(mode)} == {"reduce-overhead", "max-autotune"}
    assert {"default", "max-autotune-no-cudagraphs"} <= set(modes)
    with pytest.raises(RuntimeError, match="Unrecognized mode"):
        records_cuda_graphs("reduce_overhead")


@pytest.mark.slow
def test_profiled_updates_keep_the_losses_and_leave_an_operator_table(shards, tmp_path):
    """train.profile_updates: after two warm-up updates the next ones are recorded (here all the run
    has left: 3 of 5), the table is written and the event logged; the losses are the unprofiled run's."""
    plain = run_on_ranks(_train, 1, config(shards, tmp_path / "plain", "train.steps=5"))[0]
    profiled = run_on_ranks(_train, 1, config(shards, tmp_path / "profiled", "train.steps=5",
                                              "train.profile_updates=10"))[0]
    assert profiled["losses"] == plain["losses"]
    assert logged(tmp_path / "profiled", "profile", "updates") == {5: 3}
    assert logged(tmp_path / "profiled", "profile", "update_s")[5] > 0
    assert logged(tmp_path / "profiled", "profile", "device_busy") == {5: None}  # CPU: no device time
    host = logged(tmp_path / "profiled", "profile", "host_ms")[5]  # the loop's phases, ms per update
    assert set(host) == set(PHASES) and all(ms > 0 for ms in host.values()), host
    assert host["forward"] + host["backward"] < 1e3 * logged(tmp_path / "profiled", "profile", "update_s")[5]
    table = (tmp_path / "profiled" / "profile.txt").read_text()
    assert "aten::addmm" in table or "aten::mm" in table
    assert not (tmp_path / "plain" / "profile.txt").exists()


def test_the_hosts_phase_times_are_its_own_where_a_gpu_lists_each_phase_twice():
    """On a GPU torch's profiler lists a phase that queued kernels twice: the host's range, and its kernels'
    (a gpu_user_annotation, CUDA, no host time), in either order; lease 8's report took the kernels' range
    and said the forward, backward and engine step took the host 0.0 ms (its operator table: 73.8 and
    98.9 ms per update for the first two)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def listed(name, device, cpu_us):
        return SimpleNamespace(key=f"megamlm: {name}", device_type=device, cpu_time_total=cpu_us)

    averages = [listed("backward", DeviceType.CPU, 296_563.0), listed("forward", DeviceType.CUDA, 0.0),
                listed("forward", DeviceType.CPU, 221_326.0), listed("backward", DeviceType.CUDA, 0.0),
                listed("data", DeviceType.CPU, 26_499.5), SimpleNamespace(key="aten::mm", device_type=DeviceType.CPU,
                                                                         cpu_time_total=61_407.0)]
    assert host_phase_ms(averages, 3) == pytest.approx({"backward": 98.854, "forward": 73.775, "data": 8.833},
                                                        abs=1e-3)


def test_torchs_warning_that_a_cycle_clears_the_profile_is_not_shown(tmp_path, monkeypatch):
    """torch 2.11 warns at every profiler start that a cycle's end clears the events (pytorch#180348; in every
    GPU lease's profiled loop log); the loop records one cycle. Other warnings still show."""
    from torch.profiler import profile

    prepare_trace = profile.prepare_trace

    def prepare_trace_as_torch_2_11(self):
        prepare_trace(self)
        warnings.warn("Warning: Profiler clears events at the end of each cycle.Only events from the current "
                      "cycle will be reported.To keep events across cycles, set acc_events=True.", UserWarning)
        warnings.warn("another profiler warning", UserWarning)

    monkeypatch.setattr(profile, "prepare_trace", prepare_trace_as_torch_2_11)
    profiler = UpdateProfiler(1, 0, 10, torch.device("cpu"), tmp_path / "profile.txt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profiler.update_done(2, log=None)  # the second warm-up update done: the recording starts
    profiler.profiler.stop()
    assert [str(w.message) for w in caught] == ["another profiler warning"]


def diverge_after_3(step, loss):
    return float("inf") if step > 3 else loss


def test_nan_and_spike_trigger_rollbacks_and_training_completes(shards, tmp_path):
    cfg = config(shards, tmp_path / "spiky", "train.steps=14", "train.save_interval=3",
                 "train.spike_patience=2", "train.spike_factor=2.0")
    result = run_on_ranks(_train, 1, cfg, None, None, InjectOnce())[0]
    assert result["rollbacks"] == 2 and result["steps"] == 14
    events = [json.loads(line) for line in (tmp_path / "spiky/log.jsonl").read_text().splitlines()]
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert [e["step"] for e in rollbacks] == [5, 11]
    assert (tmp_path / "spiky/final/model.pt").exists()


def test_training_gives_up_after_max_rollbacks(shards, tmp_path):
    cfg = config(shards, tmp_path / "diverge", "train.save_interval=2", "train.max_rollbacks=1")
    with pytest.raises(RuntimeError, match="gave up after 1 rollbacks"):
        run_on_ranks(_train, 1, cfg, None, None, diverge_after_3)


def _slow_down(owner, name: str, seconds: float = 3.0) -> None:
    """owner.name, a function, made `seconds` slower for the rest of this process."""
    function = getattr(owner, name)

    def slower(*args, **kwargs):
        time.sleep(seconds)
        return function(*args, **kwargs)

    setattr(owner, name, slower)


def _train_with_a_slow_save(cfg):
    """_train with every checkpoint save 3 s longer (a slow file system)."""
    from megamlm.train.checkpoint import Checkpoints

    _slow_down(Checkpoints, "save")
    return _train(cfg)


def test_evaluations_and_checkpoints_are_not_counted_in_the_logged_throughput(shards, tmp_path):
    """tokens/s (and MFU) of a log line are the updates' own: the window of updates 5-6 follows update 4's
    evaluation and 3-second save (counted in it, its rate would be ~50x lower), 7-8 follows nothing."""
    cfg = config(shards, tmp_path / "run", "train.log_interval=2", "train.save_interval=4", "train.eval_interval=4")
    run_on_ranks(_train_with_a_slow_save, 1, cfg)
    rates = logged(tmp_path / "run", key="tokens_per_s")
    assert rates[6] > rates[8] / 10, rates


def _train_with_a_slow_rollback(cfg):
    """_train with a NaN loss at update 5 and a rollback 3 s longer (a slow checkpoint load)."""
    from megamlm.train import loop

    _slow_down(loop, "roll_back")
    return _train(cfg, hook=InjectOnce())


def test_a_rollback_is_not_counted_in_the_logged_throughput(shards, tmp_path):
    """Update 5's NaN rolls back to update 4's checkpoint: the line of update 6 reports the updates 5-6
    done again, without the 3-second reload or the discarded work (counted, it would be ~50x lower)."""
    cfg = config(shards, tmp_path / "run", "train.log_interval=2", "train.save_interval=2")
    assert run_on_ranks(_train_with_a_slow_rollback, 1, cfg)[0]["rollbacks"] == 1
    rates = logged(tmp_path / "run", key="tokens_per_s")
    assert rates[6] > rates[8] / 10, rates


@pytest.mark.slow
def test_the_main_job_ab_benchmark_runs_a_revision_beside_the_tree(shards):
    """benchmarks/main_job_ab.py at toy size: HEAD beside the working tree, one profiled update each; exit 0 when
    the losses are the same (a clean checkout's), 1 when an uncommitted change moved them; its worktree of HEAD
    is removed afterwards."""
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout
    run = subprocess.run([sys.executable, "benchmarks/main_job_ab.py", "--config", "configs/variants/baseline.yaml",
                          "--rounds", "1", "--updates", "1", "--set", *tiny_job(shards)], cwd=ROOT,
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=600)
    same = run.stdout.rstrip().endswith("last losses the same to the last digit")
    assert run.returncode == (0 if same else 1) and (same or run.stdout.rstrip().endswith("DIFFER")), \
        run.stdout + run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| 1 |")]
    assert [row.split(" | ")[1] for row in rows] == ["base", "tree"]
    assert all(0 < float(row.split(" | ")[2]) < 300 for row in rows)  # seconds from the launch to the loop's start
    assert subprocess.run(["git", "worktree", "list"], cwd=ROOT, capture_output=True, text=True).stdout == worktrees


def _cli_run(shards, run_dir, *overrides):
    """`megamlm train`'s arguments for a tiny run in `run_dir` (no step count) and its environment."""
    args = ["--config", str(CONFIGS / "variants/baseline.yaml"), *tiny_job(shards), f"train.run_dir={run_dir}",
            "train.log_interval=1", "train.eval_interval=1000", "train.save_interval=1000", *overrides]
    return args, dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def _start_and_wait_for_3_updates(args, env, run_dir, **popen):
    """A run of 100,000 updates in a subprocess, once it has logged 3 of them."""
    proc = subprocess.Popen([sys.executable, "-m", "megamlm", "train", *args, "train.steps=100000"], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
    log = run_dir / "log.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (log.exists() and len(logged(run_dir)) >= 3):
        time.sleep(0.2)
    assert len(logged(run_dir)) >= 3, proc.communicate(timeout=5)[0]
    return proc


@pytest.mark.slow
def test_sigterm_saves_a_complete_checkpoint_exits_0_and_resume_continues(shards, tmp_path):
    run_dir = tmp_path / "preempt"
    args, env = _cli_run(shards, run_dir)
    proc = _start_and_wait_for_3_updates(args, env, run_dir)
    sent_at_step = max(logged(run_dir))
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    saved = int((run_dir / "checkpoints/latest").read_text().removeprefix("step"))
    assert saved - sent_at_step <= 2 and (run_dir / f"checkpoints/step{saved:08d}/complete").exists()
    assert "signal received: saved update" in output
    resume = subprocess.run([sys.executable, "-m", "megamlm", "train", *args,
                             f"train.steps={saved + 2}", "--resume", "auto"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert resume.returncode == 0, resume.stdout + resume.stderr
    assert f"resumed from {run_dir}/checkpoints/step{saved:08d} at update {saved}" in resume.stdout
    assert max(logged(run_dir)) == saved + 2


@pytest.mark.slow
@pytest.mark.parametrize("sig, exit_code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_to_the_whole_job_with_loader_workers_still_saves(shards, tmp_path, sig, exit_code):
    """SLURM (scancel, the time limit), `timeout` and a terminal's Ctrl-C signal every process of the job,
    the data loader's workers too. Before, a worker died of it and the trainer failed with "DataLoader
    worker ... is killed by signal" instead of saving."""
    run_dir = tmp_path / "group"
    args, env = _cli_run(shards, run_dir, "data.loader_workers=2")
    proc = _start_and_wait_for_3_updates(args, env, run_dir, start_new_session=True)
    os.killpg(proc.pid, sig)  # its own process group: the trainer and its loader workers
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == exit_code, output
    saved = int((run_dir / "checkpoints/latest").read_text().removeprefix("step"))
    assert (run_dir / f"checkpoints/step{saved:08d}/complete").exists()
    assert f"signal received: saved update {saved} ({sig.name})" in output


@pytest.mark.slow
def test_a_loader_worker_killed_by_the_oom_killer_stops_the_run_with_one_line(shards, tmp_path):
    """torch raises "DataLoader worker (pid N) is killed by signal: Killed." wherever the trainer is; the CLI
    printed it as an internal error. Now it says what killed it, what to change, and how to go on."""
    run_dir = tmp_path / "oom"
    args, env = _cli_run(shards, run_dir, "data.loader_workers=2")
    proc = _start_and_wait_for_3_updates(args, env, run_dir)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    own = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    workers = [int(pid) for pid in children if Path(f"/proc/{pid}/cmdline").read_bytes() == own]
    assert len(workers) == 2, children
    os.kill(workers[0], signal.SIGKILL)  # as the kernel's out-of-memory killer does
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, output
    last = output.strip().splitlines()[-1]
    # torch's "(pid N) is killed by signal: Killed." or, when the trainer was reading the batch queue, "(pid(s) N)
    # exited unexpectedly": a race (1 run in ~16 on a loaded machine)
    assert re.match(rf"megamlm: train: a data loader worker died: DataLoader worker \(pid(\(s\))? {workers[0]}\)",
                    last), last
    assert "out-of-memory killer: lower data.loader_workers (now 2)" in last, last
    assert last.endswith("with --resume auto"), last


def test_interrupted_checkpoint_is_never_chosen(world, tmp_path):
    from megamlm.train.checkpoint import Checkpoints

    ckpts = Checkpoints(tmp_path, keep_last=2)
    for step, complete in ((100, True), (200, True), (300, False)):
        folder = ckpts.root / f"step{step:08d}"
        folder.mkdir(parents=True)  # the first makes the checkpoint folder, as a save does
        if complete:
            (folder / "complete").write_text("")
    (ckpts.root / "latest").write_text("step00000300")  # pointer to a half-written one
    assert ckpts.newest() == "step00000200"
    (ckpts.root / "latest").unlink()
    assert ckpts.newest() == "step00000200"


def _resumed_with(cfgs):
    """A 2-update run, then each of `cfgs` resuming it from update 2 (a copy of the run dir each)."""
    import torch.distributed as dist

    first, *resumed = cfgs
    _train(first)
    for cfg in resumed:
        if dist.get_rank() == 0:
            shutil.copytree(first.train.run_dir, cfg.train.run_dir)
        dist.barrier()
        _train(cfg, resume="auto")


def _param_groups(folder: Path) -> list[dict]:
    """AdamW's parameter groups (less their parameters) wherever a checkpoint's files hold them."""
    found = []

    def visit(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "param_groups":
                    found.extend({k: v for k, v in group.items() if k != "params"} for group in value)
                else:
                    visit(value)

    for path in sorted(folder.glob("*.pt")):
        visit(torch.load(path, map_location="cpu", weights_only=False))
    return found


@pytest.mark.parametrize("engine, ranks", [("deepspeed", 1), ("deepspeed", 2), ("flat", 1)],
                         ids=["deepspeed-stage0", "deepspeed-zero1-dp2", "flat"])
def test_a_resumed_run_takes_its_changed_adamw_settings_and_says_so(shards, tmp_path, engine, ranks):
    """Resuming with other optim.betas / eps / weight_decay: the resume line lists what changed since the
    checkpoint, and AdamW steps with the new values (DeepSpeed's load had put the written ones back: the
    updates after it were those of the old settings, as if nothing had changed)."""
    common = [f"train.engine={engine}", "train.save_interval=2"]
    changed = ["optim.betas=[0.9,0.95]", "optim.eps=1e-8", "optim.weight_decay=0.1"]
    cfgs = [config(shards, tmp_path / "first", *common, "train.steps=2"),
            config(shards, tmp_path / "same", *common, "train.steps=4"),
            config(shards, tmp_path / "changed", *common, "train.steps=4", *changed)]
    run_on_ranks(_resumed_with, ranks, cfgs)
    assert logged(tmp_path / "changed", "resume", "changed")[2] == {
        "optim.betas": [[0.9, 0.98], [0.9, 0.95]], "optim.eps": [1e-6, 1e-8], "optim.weight_decay": [0.01, 0.1],
        "train.run_dir": [str(tmp_path / "first"), str(tmp_path / "changed")], "train.steps": [2, 4]}
    # the line names the values as a config file writes them (YAML reads 1e-6 as a string, 1.0e-06 as a float)
    assert "optim.betas [0.9, 0.98] -> [0.9, 0.95], optim.eps 1.0e-06 -> 1.0e-08, optim.weight_decay 0.01 -> 0.1" \
        in logged(tmp_path / "changed", "resume", "message")[2]
    assert logged(tmp_path / "same", "resume", "changed")[2] == {
        "train.run_dir": [str(tmp_path / "first"), str(tmp_path / "same")], "train.steps": [2, 4]}
    groups = _param_groups(tmp_path / "changed/checkpoints/step00000004")
    assert groups and all({key: group[key] for key in ("betas", "eps", "weight_decay")} ==
                          {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1} for group in groups), groups
    same, other = logged(tmp_path / "same"), logged(tmp_path / "changed")
    assert same[3] == other[3] and same[4] != other[4]  # update 3 stepped with the new settings


@pytest.mark.slow
def test_a_resumed_run_with_another_seed_says_what_the_seed_changes(shards, tmp_path):
    """train.seed on resume (same layout): the training stream and dropout are the checkpoint's (the same
    losses as an unchanged resume) while validation draws new masks; the resume line says both."""
    cfgs = [config(shards, tmp_path / "first", "train.save_interval=2", "train.steps=2"),
            config(shards, tmp_path / "same", "train.save_interval=2", "train.steps=4", "train.eval_interval=2"),
            config(shards, tmp_path / "reseeded", "train.save_interval=2", "train.steps=4", "train.eval_interval=2",
                   "train.seed=7")]
    run_on_ranks(_resumed_with, 1, cfgs)
    same, reseeded = logged(tmp_path / "same"), logged(tmp_path / "reseeded")
    assert same[3] == reseeded[3] and same[4] == reseeded[4]
    assert logged(tmp_path / "same", "valid")[2] != logged(tmp_path / "reseeded", "valid")[2]
    line = logged(tmp_path / "reseeded", "resume", "message")[2]
    assert "train.seed 1 -> 7 (the training data order continues the checkpoint's, dropout too on the same " \
           "layout; validation draws new masks" in line, line


def _train_reading_late(cfg, hook=None):
    """_train, recording for each loss read (update, how many updates were queued by then)."""
    from megamlm.train import loop

    queued, reads = [0], []

    class Counted(loop.Finished):
        def __init__(self, *args):
            super().__init__(*args)
            queued[0] = self.step

    loop.Finished = Counted

    def record(step, loss):
        reads.append((step, queued[0]))
        return hook(step, loss) if hook else loss

    return _train(cfg, hook=record), reads


LATE = ["train.log_interval=100"]  # every update but the first and the last read after the next is queued


def test_an_updates_loss_is_read_once_the_next_update_is_queued_and_the_run_is_the_same(shards, tmp_path):
    """Between log lines, evaluations and checkpoints the loop reads an update's loss (a wait for the
    device) only once the next update's work is queued, so the GPU does not wait for the host between
    updates. The losses are those of reading each update at once; a rollback goes back as before."""
    at_once, reads_at_once = run_on_ranks(_train_reading_late, 1, config(shards, tmp_path / "at-once"))[0]
    late, reads_late = run_on_ranks(_train_reading_late, 1, config(shards, tmp_path / "late", *LATE))[0]
    assert reads_at_once == [(s, s) for s in range(1, 9)]
    assert reads_late == [(1, 1)] + [(s, s + 1) for s in range(2, 8)] + [(8, 8)]
    assert late["losses"] == at_once["losses"]
    assert sorted(logged(tmp_path / "late")) == [8]

    spiky = ["train.steps=14", "train.save_interval=3", "train.spike_patience=2", "train.spike_factor=2.0"]
    runs = {name: run_on_ranks(_train_reading_late, 1, config(shards, tmp_path / name, *spiky, *extra),
                               InjectOnce())[0]
            for name, extra in (("spiky-at-once", []), ("spiky-late", LATE))}
    # the NaN at update 5 is read while update 6 runs (then discarded), the spike at 11 while 12 runs
    assert (5, 6) in runs["spiky-late"][1] and (11, 12) in runs["spiky-late"][1]
    assert runs["spiky-late"][0] == runs["spiky-at-once"][0]  # losses, rollbacks, steps
    for name in runs:
        assert sorted(logged(tmp_path / name, "rollback", "rollbacks")) == [5, 11]


class SigtermAt:
    """A loss hook: SIGTERM to this process when update `step`'s loss is read."""

    def __init__(self, step):
        self.step = step

    def __call__(self, step, loss):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss


def _train_until_stopped(cfg, hook):
    from megamlm.train.loop import train

    return train(cfg, loss_hook=hook)


def test_a_signal_read_late_still_saves_a_complete_checkpoint_within_three_updates(shards, tmp_path):
    """The stop flag travels with the loss: a signal while update 4's loss is read (update 5 queued)
    reaches every rank with update 6's flag, and update 7, read at once, is saved."""
    summary = run_on_ranks(_train_until_stopped, 1, config(shards, tmp_path / "stopped", *LATE), SigtermAt(4))[0]
    assert summary["preempted"] and summary["signal"] == "SIGTERM" and summary["step"] == 7
    assert len(summary["losses"]) == 7
    assert (tmp_path / "stopped/checkpoints/step00000007/complete").exists()


def test_schedule_follows_the_reference_formula():
    cfg = load_config([], ["optim.lr=6e-4", "optim.min_lr=6e-5", "optim.warmup_steps=10000",
                           "optim.period_steps=146390"]).optim
    total = 133082
    formula = lambda t: 6e-5 + 0.5 * (6e-4 - 6e-5) * (1 + math.cos(math.pi * (t - 10000) / 146390))  # noqa: E731
    assert lr_at(0, cfg, total) == pytest.approx(6e-5)
    assert lr_at(5000, cfg, total) == pytest.approx(6e-5 + 0.5 * (6e-4 - 6e-5))
    assert lr_at(10000, cfg, total) == pytest.approx(6e-4)
    for t in (10000, 70000, 133081):
        assert lr_at(t, cfg, total) == pytest.approx(formula(t), rel=1e-12)
    assert lr_at(133081, cfg, total) == pytest.approx(9.3e-5, rel=0.02)  # the reference's end lr
    default_period = load_config([], ["optim.warmup_steps=10"]).optim
    half = default_period.min_lr + 0.5 * (default_period.lr - default_period.min_lr)
    assert lr_at(10 + 55, default_period, 100) == pytest.approx(half)  # period = 1.1 x 100 steps
    poly = load_config([], ["optim.schedule=polynomial", "optim.lr=1e-5", "optim.min_lr=0",
                            "optim.warmup_steps=122"]).optim
    assert lr_at(61, poly, 2036) == pytest.approx(0.5e-5)
    assert lr_at(122, poly, 2036) == pytest.approx(1e-5)
    assert lr_at(2036, poly, 2036) == pytest.approx(0.0)


def test_deepspeed_json_is_generated_from_the_config(tmp_path):
    cfg = load_config([], ["train.micro_batch_size=4", "train.global_batch_size=32", "train.zero_stage=2",
                           "train.precision=bf16", "optim.clip_grad=1.0"])
    ds = deepspeed_config(cfg, dp_size=2)
    batch = (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"])
    assert batch == (4, 4, 32)
    assert ds["zero_optimization"] == {"stage": 2} and ds["bf16"] == {"enabled": True}
    assert ds["gradient_clipping"] == 1.0
    with pytest.raises(ConfigError, match="global_batch_size=32 is not divisible by .* 4 × 3"):
        deepspeed_config(cfg, dp_size=3)
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 3}}))
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu=8 disagrees"):
        deepspeed_config(load_config([], [f"train.deepspeed_config={user}", "train.micro_batch_size=4"]), 1)
