"""The `megamlm` command as a user runs it: the smoke main job, parameter counts, config errors."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def megamlm(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="2")
    return subprocess.run([sys.executable, "-m", "megamlm", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_smoke_main_job_reduces_the_loss():
    run = megamlm("smoke", "--config", "configs/demo.yaml", "train.steps=12", "optim.lr=2e-3")
    assert run.returncode == 0, run.stderr
    done = [line for line in run.stdout.splitlines() if line.startswith("done: loss")]
    first, last = (float(x) for x in done[0].split()[2:5:2])
    assert last < first - 1.0, run.stdout


def test_params_prints_the_roberta_base_count():
    run = megamlm("params", "--config", "configs/model/base.yaml")
    assert run.returncode == 0, run.stderr
    assert "124,696,665" in run.stdout  # HF RobertaForMaskedLM(roberta-base) minus token types


def test_config_error_is_one_line_without_traceback():
    run = megamlm("config", "--config", "configs/demo.yaml", "parallel.tensor_parallel=3")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "megamlm: config error: command line: parallel.tensor_parallel=3 does not divide "
        "model.num_attention_heads=4; allowed: 1, 2, 4"]


def test_config_prints_the_resolved_yaml():
    run = megamlm("config", "--config", "configs/model/base.yaml", "--config",
                  "configs/variants/zero-clap.yaml")
    assert run.returncode == 0, run.stderr
    assert "position: alibi" in run.stdout and "vocab_size: 50262" in run.stdout
    assert "num_layers: 12" in run.stdout
