"""slurm/pretrain.sbatch on a real two-node SLURM cluster (slurmctld + 2 slurmd on loopback):
a DP=2 job over two nodes with one rendezvous host, preempted by USR1, requeued, resumed.

Needs root (daemons, /etc/hosts) and slurm-wlm + munge, which slurm/local-cluster.sh installs from
the Debian archive if missing; elsewhere the test is skipped with the reason."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megamlm.data.shards import BuildOptions, build_shards
from megamlm.data.tokenizer import Tokenizer
from tests.multiproc import shell_environment

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "slurm/local-cluster.sh"
STATE = "/tmp/megamlm-slurm-test"


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root to run slurmctld/slurmd and edit /etc/hosts"
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        return "slurm-wlm is not installed and apt-get is not available"
    return None


@pytest.fixture(scope="module")
def cluster():
    reason = _why_not()
    if reason:
        print(f"\nSKIP slurm tests: {reason}")
        pytest.skip(reason)
    env = shell_environment(MEGAMLM_SLURM_DIR=STATE)  # a user's (no LOCAL_RANK of an earlier test's ranks)
    start = subprocess.run([str(CLUSTER), "start"], env=env, capture_output=True, text=True, timeout=600)
    if start.returncode != 0:
        subprocess.run([str(CLUSTER), "stop"], env=env, timeout=60)
        pytest.fail(f"local SLURM cluster did not start:\n{start.stdout}\n{start.stderr}")
    yield dict(env, SLURM_CONF=f"{STATE}/slurm.conf")
    subprocess.run([str(CLUSTER), "stop"], env=env, timeout=60)


def _wait(predicate, timeout, what):
    """Wait for predicate(); on timeout fail with what() (evaluated then) and the daemons' logs."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(1)
    logs = "".join(f"\n--- {p}\n" + "\n".join(p.read_text().splitlines()[-15:])
                   for p in sorted(Path(STATE, "log").glob("*.log")))
    queue = subprocess.run(["squeue"], env=dict(os.environ, SLURM_CONF=f"{STATE}/slurm.conf"),
                           capture_output=True, text=True).stdout
    raise TimeoutError(f"{what()}\n--- squeue\n{queue}{logs}")


def _submit(cluster, tmp_path, nodes: str, *overrides, python: str = sys.executable,
            path: str | None = None) -> tuple[dict, str, Path, Path]:
    """sbatch the demo (2 layers, micro-batches of 8) on `nodes` with PYTHON=`python` (and PATH=`path`):
    (env, job id, its output file, the run's log.jsonl)."""
    shards = tmp_path / "shards"
    text = tmp_path / "corpus.txt"
    text.write_text((ROOT / "data/wikitext-103/valid.txt").read_text()[:200_000])
    build_shards(BuildOptions([str(text)], str(shards), seq_length=128, long_docs="split",
                              valid_fraction=0.05), Tokenizer.gpt2(), progress=False)
    run_dir = tmp_path / "run"
    env = dict(cluster, PYTHON=python, PYTHONPATH=str(ROOT), **({"PATH": path} if path else {}))
    submit = subprocess.run(
        ["sbatch", "--parsable", f"-N{nodes}", str(ROOT / "slurm/pretrain.sbatch"), str(ROOT / "configs/demo.yaml"),
         "model.num_layers=2", "train.micro_batch_size=8", "train.global_batch_size=16", "train.steps=24",
         "train.log_interval=1", "train.eval_interval=1000", "train.eval_batches=2", f"data.shards={shards}",
         f"train.run_dir={run_dir}", *overrides],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip()
    return env, job, tmp_path / f"megamlm-{job}.out", run_dir / "log.jsonl"


def _job_output(out: Path) -> str:
    return out.read_text() if out.exists() else "(no output file)"


def _events(log: Path, kind: str) -> list[dict]:
    if not log.exists():
        return []
    return [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == kind]


def _wrapper(path: Path, condition: str, marker: Path, command: str, then: str = "") -> Path:
    """An executable at `path` that, where the bash `condition` holds, touches `marker` and sleeps 15 s
    before it runs `command` with `then` and its arguments; elsewhere `command` with its arguments."""
    path.write_text(f"""#!/usr/bin/env bash
if {condition}; then touch {marker}; sleep 15; exec {command} {then} "$@"; fi
exec {command} "$@"
""")
    path.chmod(0o755)
    return path


def test_two_node_job_is_preempted_requeued_and_resumes(cluster, tmp_path):
    env, job, out, log = _submit(cluster, tmp_path, "2")

    def trained():
        if not log.exists():
            return []
        return [e["step"] for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "train"]

    _wait(lambda: len(trained()) >= 4, 300, lambda: f"job {job} made no progress:\n{_job_output(out)}")
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True, timeout=30)
    _wait(lambda: "done:" in _job_output(out), 420,
          lambda: f"job {job} did not finish after requeue:\n{_job_output(out)}")
    _wait(lambda: not subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True,
                                     text=True).stdout.strip(), 120, lambda: f"job {job} did not leave the queue")
    output = out.read_text()
    # two nodes, two tasks, one rendezvous host, DP=2
    assert "node n1: task 0 of 2" in output and "node n2: task 1 of 2" in output
    # (our script's "job ... rendezvous HOST" lines; torchrun's benign "failed to shutdown the
    # rendezvous" warning on a departed peer also contains the word)
    assert len({line.split("rendezvous ")[1].split(",")[0] for line in output.splitlines()
                if line.startswith("job ") and "rendezvous " in line}) == 1
    assert "TP=1 DP=2" in output
    # the batch step's check, once a start: what the run would do
    checks = [line.split("nothing refused: ")[1] for line in output.splitlines()
              if line.startswith("megamlm: train --check: nothing refused: ")]
    # and what the run would warn of: the test's shards are not a build of the demo config's data.build_from
    warned = [line for line in output.splitlines() if line.startswith("megamlm: train --check: warning: ")]
    assert len(warned) == 2 and all("holds a build of other choices than the config's: inputs" in w for w in warned)
    assert len(checks) == 2 and all(c.startswith("2 ranks (2 machines x 1): tensor parallel 1 x data parallel 2, "
                                                 "accumulation 1; ") for c in checks), checks
    assert "starts at update 0 (no checkpoint to resume)" in checks[0] and "resumes from step" in checks[1], checks
    # preempted once, requeued, resumed from the checkpoint (not from scratch)
    assert "USR1: time limit near" in output and f"requeueing job {job}" in output
    assert "(restart 1)" in output
    resumed = [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "resume"]
    assert len(resumed) == 1 and resumed[0]["step"] >= 4
    # the combined loss log has every update exactly once
    assert trained() == list(range(1, 25))


def test_a_job_requeued_onto_fewer_nodes_resumes_resharded(cluster, tmp_path):
    """8 nodes -> 4 in small: a 2-node job (DP=2) is preempted while node n2 is drained, so its
    requeued copy waits for 2 nodes; shrunk to 1 node it runs on n1 alone (DP=1, accumulation 2: the
    same global batch) and continues from the checkpoint, resharded."""
    env, job, out, log = _submit(cluster, tmp_path, "2")  # 16 sequences: micro 8 x 2 ranks, then x 2 accumulated

    def state():
        return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True,
                              text=True).stdout.strip()

    drain = ["scontrol", "update", "NodeName=n2"]
    try:
        _wait(lambda: len(_events(log, "train")) >= 4, 300, lambda: f"job {job} made no progress:\n{_job_output(out)}")
        subprocess.run([*drain, "State=DRAIN", "Reason=elastic-test"], env=env, check=True, timeout=30)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True, timeout=30)
        _wait(lambda: f"requeueing job {job}" in _job_output(out) and state() == "PENDING", 300,
              lambda: f"job {job} was not requeued ({state()}):\n{_job_output(out)}")
        shrink = ["scontrol", "update", f"JobId={job}", "NumNodes=1-1", "NumTasks=1"]
        subprocess.run(shrink, env=env, check=True, timeout=30)
        _wait(lambda: "done:" in _job_output(out), 420,
              lambda: f"job {job} did not finish after requeue:\n{_job_output(out)}")
    finally:
        subprocess.run([*drain, "State=RESUME"], env=env, timeout=30)
    output = out.read_text()
    assert "(restart 0): 2 nodes" in output and "(restart 1): 1 nodes" in output
    assert "TP=1 DP=2" in output and "TP=1 DP=1" in output
    (resumed,) = _events(log, "resume")
    assert resumed["message"].startswith(f"resumed update {resumed['step']} written at TP=1 DP=2 ZeRO-1 into "
                                         f"TP=1 DP=1 ZeRO-0"), resumed
    assert [e["step"] for e in _events(log, "train")] == list(range(1, 25))  # every update exactly once


def test_what_every_node_would_refuse_ends_the_job_in_one_line_before_any_node_starts(cluster, tmp_path):
    """A global batch of 24 does not split over 2 nodes' micro-batches of 8: each node's launcher refused it
    (the same line from every node); the batch step's `megamlm train --check` now does, once."""
    env, job, out, _ = _submit(cluster, tmp_path, "2", "train.global_batch_size=24")
    _wait(lambda: not subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True,
                                     text=True).stdout.strip(), 120, lambda: f"job {job} did not leave the queue")
    output = out.read_text()
    refused = ("megamlm: config error: train.global_batch_size=24 is not divisible by train.micro_batch_size × "
               "data-parallel size = 8 × 2; choose a multiple of 16")
    assert output.splitlines().count(refused) == 1 and "node n1" not in output, output
    shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    assert "JobState=FAILED" in shown and "ExitCode=2:0" in shown, shown  # ended, not requeued
    assert not (tmp_path / "run").exists()


def test_a_hostfile_written_in_an_allocation_lists_its_nodes(cluster, tmp_path):
    """`megamlm hostfile` (the DeepSpeed launcher's route, slurm/README.md) expands the allocation's
    SLURM_JOB_NODELIST (`n[1-2]`) with the real scontrol."""
    env = dict(cluster, PYTHONPATH=str(ROOT))
    run = subprocess.run(["salloc", "-N2", "--quiet", sys.executable, "-m", "megamlm", "hostfile", "--slots", "2"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stdout) == (0, "n1 slots=2\nn2 slots=2\n"), run.stderr


def test_a_job_preempted_before_its_training_starts_is_requeued_and_trains_from_the_start(cluster, tmp_path):
    """USR1 while the batch step's `megamlm train --check` runs (a slow start: here a PYTHON that sleeps
    before the first start's check): the handler runs when the check ends, nothing has been trained, so the
    job is requeued as it stands instead of starting a training that would only be stopped."""
    checking = tmp_path / "checking"
    slow_check = _wrapper(tmp_path / "slow-check-python",
                          '[[ " $* " == *" --check "* && "${SLURM_RESTART_COUNT:-0}" == 0 ]]', checking, sys.executable)
    env, job, out, log = _submit(cluster, tmp_path, "1", python=str(slow_check))

    _wait(checking.exists, 300, lambda: f"job {job} did not start its check:\n{_job_output(out)}")
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True, timeout=30)
    _wait(lambda: "done:" in _job_output(out), 420,
          lambda: f"job {job} did not finish after requeue:\n{_job_output(out)}")
    output = out.read_text()
    first, requeued = output.split("(restart 1)")
    assert "USR1: time limit near before the training started" in first, output
    assert f"nothing trained yet; requeueing job {job}" in first and "asking the training to checkpoint" not in first
    assert "node n1: task 0 of 1" in first  # the check ended the step normally, the nodes had started
    assert "USR1" not in requeued and "requeueing" not in requeued
    assert "starts at update 0 (no checkpoint to resume)" in requeued
    assert not _events(log, "resume")
    assert [e["step"] for e in _events(log, "train")] == list(range(1, 25))


def test_a_job_preempted_as_its_training_step_starts_still_stops_the_training_and_is_requeued(cluster, tmp_path):
    """USR1 after `srun ... megamlm train &` but before slurmctld has created the step (here an srun on PATH
    that waits 15 s first), and its SIGTERM due once the step exists but before its task has started (that
    srun's --prolog, which runs between the two, takes 5 s): a SIGTERM to the job's steps then reached no
    process, the first start trained to its end and only then was requeued (a suite saw the second window once,
    without a prolog). The script now waits for the training step and its task before it sends SIGTERM: the
    first start stops early, the requeued one trains the rest."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    starting = tmp_path / "starting"
    prolog = tmp_path / "prolog"
    prolog.write_text("#!/usr/bin/env bash\nsleep 5\n")
    prolog.chmod(0o755)
    _wrapper(bin_dir / "srun", '[[ " $* " == *" megamlm train "* && "${SLURM_RESTART_COUNT:-0}" == 0 ]]', starting,
             shutil.which("srun", path=cluster["PATH"]), then=f"--prolog={prolog}")
    env, job, out, log = _submit(cluster, tmp_path, "1", path=f"{bin_dir}:{cluster['PATH']}")

    _wait(starting.exists, 300, lambda: f"job {job} did not start its training step:\n{_job_output(out)}")
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True, timeout=30)
    _wait(lambda: "(restart 1)" in _job_output(out) and "done:" in _job_output(out), 420,
          lambda: f"job {job} did not finish after requeue:\n{_job_output(out)}")
    first, requeued = out.read_text().split("(restart 1)")
    assert "asking the training to checkpoint" in first and f"requeueing job {job}" in first, first
    assert "done:" not in first and "done:" in requeued, first  # stopped, not trained to its end
    assert "USR1" not in requeued and "requeueing" not in requeued
    assert [e["step"] for e in _events(log, "train")] == list(range(1, 25))  # every update exactly once
