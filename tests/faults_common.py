"""What the fault tests share (tests/test_faults.py, tests/test_signals.py, tests/test_bad_input.py): a
tiny run and its shards, the CLI in this process and in a subprocess, and the checks that a refusal is
one line and that a folder is unchanged."""

import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

from megamlm.cli import main as cli
from tests.multiproc import run_on_ranks, shell_environment
from tests.test_train import _train, config, tiny_shards

ROOT = Path(__file__).resolve().parents[1]
WIKITEXT = ROOT / "data/wikitext-103"


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file's bytes and every folder under `folder` (to assert nothing changed)."""
    return {str(p.relative_to(folder)) + ("/" if p.is_dir() else ""): (b"" if p.is_dir() else p.read_bytes())
            for p in sorted(Path(folder).rglob("*"))}


def users_folder(folder: Path) -> dict[str, bytes]:
    (folder / "sub").mkdir(parents=True)
    (folder / "results.txt").write_text("my results\n")
    (folder / "sub/notes.md").write_text("notes\n")
    return snapshot(folder)


PROGRESS_LINE = re.compile(r"^[\w ]+: .*\[\d+:\d\d")
"""A line of tqdm's (megamlm/data/progress.py: into a pipe, `tokenizing: 768 docs [00:00, 3891.15 docs/s]`)."""


def one_line(stderr: str) -> str:
    """The single line a refused command prints (no traceback, nothing else but progress lines: stderr is
    a pipe or capsys here, never a terminal)."""
    lines = [line for line in stderr.strip().split("\n") if line.strip() and not PROGRESS_LINE.match(line)]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def run_cli(capsys, *args) -> tuple[int, str]:
    """`megamlm ARGS` in this process: (exit code, its one stderr line)."""
    import torch.distributed as dist

    from megamlm.config import ParallelConfig
    from megamlm.parallel import init_distributed

    capsys.readouterr()
    code = cli([str(a) for a in args])
    if not dist.is_initialized():  # a verb owns its process and ends the group; later tests share it
        init_distributed(ParallelConfig())
    return code, one_line(capsys.readouterr().err)


def user_environment() -> dict[str, str]:
    """What `megamlm` started from a test sees: a user's shell (multiproc.shell_environment), one thread."""
    return shell_environment(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def file_size_limit(limit: int):
    """For a subprocess: writes past `limit` bytes fail (EFBIG), as writes on a full disk or over a quota do."""
    def limit_writes():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel ends the process at the limit
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return limit_writes


def megamlm(*args, timeout=300, **popen):
    env = user_environment()
    return subprocess.run([sys.executable, "-m", "megamlm", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, **popen)


def tiny(shards, run_dir, *overrides):
    return [f"--config={ROOT / 'configs/variants/baseline.yaml'}", "model.num_layers=2", "model.hidden_size=64",
            "model.num_attention_heads=4", "model.ffn_hidden_size=128", "model.max_positions=64",
            f"data.shards={shards}", "data.seq_length=64", "train.micro_batch_size=4", f"train.run_dir={run_dir}",
            "train.log_interval=1", "train.eval_interval=1000", "train.eval_batches=2", *overrides]


def fault_shards(tmp_path_factory) -> Path:
    return tiny_shards(tmp_path_factory, "faults")


def finished_run(shards: Path, tmp_path_factory) -> Path:
    """A finished 4-update run: checkpoints at 2 and 4, final/."""
    run_dir = tmp_path_factory.mktemp("faults") / "run"
    run_on_ranks(_train, 1, config(shards, run_dir, "train.steps=4", "train.save_interval=2"))
    return run_dir


def flip_byte(path: Path, offset: int | None = None) -> None:
    """One byte inverted in the middle (the file keeps its size)."""
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
