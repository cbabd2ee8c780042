"""Launch helpers: DeepSpeed hostfiles, the DeepSpeed JSON printed from a config, the GLUE array
script's refusal until GLUE exists, and shellcheck on every script in slurm/."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megamlm.cli import main as cli
from megamlm.config import load_config
from megamlm.launch import hostfile_text
from megamlm.train.engine import deepspeed_config

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


def test_deepspeed_json_is_printed_from_the_config(capsys):
    files = [str(ROOT / "configs/pile/base-alibi.yaml"), str(ROOT / "configs/deepspeed/zero3-bf16.yaml")]
    assert cli(["deepspeed-config", "--config", files[0], "--config", files[1], "--dp", "8"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == deepspeed_config(load_config(files), 8)
    assert printed["zero_optimization"]["stage"] == 3 and printed["gradient_accumulation_steps"] == 16


def test_glue_array_script_stops_with_a_clear_message_until_glue_exists():
    env = dict(os.environ, SLURM_ARRAY_TASK_ID="9", PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    run = subprocess.run(["bash", str(ROOT / "slurm/glue.sbatch"), "runs/a/final", "runs/b/final"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "megamlm glue is not available" in run.stderr and "MNLI on runs/b/final" in run.stderr


def test_shellcheck_passes_on_every_slurm_script():
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    scripts = sorted(str(p) for p in (ROOT / "slurm").iterdir() if p.suffix in (".sh", ".sbatch"))
    assert len(scripts) >= 3
    run = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout
