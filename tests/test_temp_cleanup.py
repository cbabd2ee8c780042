"""The suite frees its disk as it goes: a passing test's tmp_path and a passing module's fixture folders are
removed when they end, a failure's are kept to look at. Kept, the training tests' checkpoints filled 11-18 GB
per run and CI's disk ran out mid-suite (ENOSPC in 45 tests' setup).

An inner pytest session runs with the retention settings of our pyproject.toml and our conftest's fixture.
"""
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MODULE = """
import pytest


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("{name}-shards")
    (folder / "shard-000000.tar").write_bytes(bytes(1000))
    return folder


def test_{name}_one(shards, tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(bytes(1000))


def test_{name}_two(shards, tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(bytes(1000))
    assert {second_passes}
"""


def test_passing_tests_and_modules_leave_nothing_and_a_failure_keeps_its_folders(tmp_path):
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "pytest.ini").write_text(textwrap.dedent(f"""\
        [pytest]
        tmp_path_retention_policy = {options["tmp_path_retention_policy"]}
        tmp_path_retention_count = {options["tmp_path_retention_count"]}
        """))
    (inner / "conftest.py").write_text("from tests.conftest import _remove_the_modules_temp_dirs  # noqa: F401\n")
    (inner / "test_green.py").write_text(MODULE.format(name="green", second_passes=True))
    (inner / "test_red.py").write_text(MODULE.format(name="red", second_passes=False))
    basetemp = tmp_path / "basetemp"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          f"--basetemp={basetemp}", str(inner)],
                         cwd=inner, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=300)
    assert "1 failed, 3 passed" in run.stdout, run.stdout + run.stderr
    left = {path.name for path in basetemp.iterdir() if path.is_dir() and not path.is_symlink()}
    assert left == {"red-shards0", "test_red_two0"}
    assert (basetemp / "test_red_two0" / "checkpoint.pt").stat().st_size == 1000
