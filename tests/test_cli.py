"""The `megamlm` command as a user runs it: the smoke main job, parameter counts, config errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def megamlm(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="2")
    return subprocess.run([sys.executable, "-m", "megamlm", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_main_job_trains_lowers_validation_perplexity_and_fills_masks(tmp_path):
    run = megamlm("train", "--config", "configs/demo.yaml", "train.steps=60", "train.eval_interval=1000",
                  f"train.run_dir={tmp_path / 'run'}", f"data.shards={tmp_path / 'shards'}",
                  "--fill-mask", "The capital of France is <mask>.", timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    done = [line for line in run.stdout.splitlines() if line.startswith("done:")][0]
    before, after = (float(x) for x in done.split("valid ppl ")[1].split(" |")[0].split(" -> "))
    assert after < before / 5, done
    fills = run.stdout.split("fill-mask: The capital of France is <mask>.")[1].strip().splitlines()
    assert len(fills) == 3 and all("The capital of France is" in line for line in fills)
    assert (tmp_path / "run/final/model.pt").exists()
    assert (tmp_path / "shards/manifest.json").exists()
    # the trained model exported to Hugging Face: same logits (checked by convert), fill-mask offline
    hf = tmp_path / "hf"
    run = megamlm("convert", "--from", "megamlm", "--to", "hf", str(tmp_path / "run/final"), str(hf))
    assert run.returncode == 0, run.stderr[-3000:]
    diff = float(run.stdout.split("parity vs transformers RobertaForMaskedLM: max |Δlogit| = ")[1].split()[0])
    assert diff < 1e-5
    code = ("from transformers import pipeline; import sys; "
            "r = pipeline('fill-mask', model=sys.argv[1], top_k=3)('The capital of France is <mask>.'); "
            "print(r[0]['token_str'] + '|' + r[0]['sequence'])")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    pipe = subprocess.run([sys.executable, "-c", code, str(hf)], env=env, capture_output=True, text=True, timeout=300)
    assert pipe.returncode == 0, pipe.stderr[-3000:]
    token, sequence = pipe.stdout.rstrip("\n").splitlines()[-1].split("|")
    # the same best token and sentence as megamlm's fill-mask ("  prob  'token'  sentence")
    assert repr(token) in fills[0] and fills[0].endswith(sequence), (pipe.stdout, fills[0])


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
