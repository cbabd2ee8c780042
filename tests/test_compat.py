"""What wave 1 wrote still works: a model folder and a training checkpoint written by commit 0601686
(tests/data/wave1-run, see its README) load into today's code and give the same numbers."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from megamlm.config import load_config
from tests.multiproc import run_on_ranks

WAVE1 = Path(__file__).parent / "data/wave1-run"


@pytest.fixture
def wave1(tmp_path):
    folder = tmp_path / "wave1"
    shutil.copytree(WAVE1, folder)
    return folder


def test_wave1_model_folder_gives_its_logits(wave1):
    import megamlm

    expected = torch.load(wave1 / "expected_logits.pt")
    model = megamlm.from_pretrained(wave1 / "run/final")
    with torch.no_grad():
        logits = model(expected["tokens"])
    torch.testing.assert_close(logits, expected["logits"], rtol=1e-5, atol=1e-5)


def _resume(folder: str):
    from megamlm.train.loop import train

    os.chdir(folder)  # the run's config holds paths relative to its folder
    return train(load_config(["run/config.yaml"]), resume="auto")["losses"]


def test_wave1_checkpoint_resumes_to_the_same_losses(wave1):
    expected = json.loads((wave1 / "expected.json").read_text())
    (losses,) = run_on_ranks(_resume, 1, str(wave1))
    assert losses == pytest.approx([expected["losses"][k] for k in ("3", "4")], rel=1e-5)
    log = [json.loads(line) for line in (wave1 / "run/log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log if e["event"] == "resume"] == [2]
