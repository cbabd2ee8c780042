"""benchmarks/gpu.sh before a GPU lease is spent on it: every step's commands run at toy size on the CPU
(GPU_SH_SMOKE=1), without that switch the commands are the full-size ones, and each training row's
full-size config loads.

A lease is 15 minutes of device time; a step that dies on a stale flag, a config that does not merge or
a run directory left by an earlier try costs its share of it (the smoke run found all three)."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multiproc import run_commands

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks/gpu.sh"
STEPS = re.search(r"STEPS=\$\{\*:-([^}]*)\}", SCRIPT.read_text()).group(1).split()
# what each kind of command prints when it worked: its table's last row, the training summary
DONE = {"train_throughput.py": "megamlm / ", "attention.py": "sdpa, no bias (reference)", "megamlm train": "done: ",
        "host_overhead.py": "megamlm, megatron linears", "row_normalize.py": "l2_normalize (megamlm)",
        "head_memory.py": "saved: the head's peak", "dropout_hash.py": "int32 lanes (kept_at_level)",
        "triton_check.py": "triton_check: every case within", "bias_activation.py": "megamlm triton ",
        "triton_candidates.py": "| dQ | ", "loader_handover.py": " thread -> trainer ",
        "cross_entropy.py": "equal megatron-core's, bit for bit"}


def _run(log_dir: Path, step: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), str(log_dir), step], cwd=ROOT, capture_output=True, text=True,
                          timeout=1200, env={**os.environ, "PYTHON": sys.executable, **env})


def _listed(log_dir: Path, *steps: str, **env) -> tuple[dict[str, list[str]], str]:
    """Each row's arguments (after `python`) as gpu.sh would run them, and its listing: PYTHON=printf
    writes them into the row's log, NUL-separated, quoting kept."""
    env = {**{k: v for k, v in os.environ.items() if k != "GPU_SH_SMOKE"}, "PYTHON": "printf %s\\0", **env}
    run = subprocess.run(["bash", str(SCRIPT), str(log_dir), *steps], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    names = re.findall(r"^=== (\S+): printf ", run.stdout, re.M)
    assert names, run.stdout
    return {name: (log_dir / f"{name}.log").read_text().split("\0")[:-1] for name in names}, run.stdout


def _assert_each_ran_or_needs_a_gpu(codes: dict[str, int], logs: Path, commands: dict[str, str]) -> None:
    for name, code in codes.items():
        log = (logs / f"{name}.log").read_text()
        # FlexAttention and varlen refuse a CPU in one line, after the config was read and checked
        assert code == 0 or "needs a CUDA GPU" in log, f"{name}: exit {code}\n{log[-3000:]}"
        if code == 0:
            done = next(text for kind, text in DONE.items() if kind in commands[name])
            assert done in log, log[-3000:]
            # a toy run that trained garbage still says done (bf16 on Triton's interpreter once gave
            # gradient norms of ~1e13): the tiny model's first updates have norms of 1-50
            norms = [float(n) for n in re.findall(r"\| grad norm ([^ ]+) \|", log)]
            assert all(n < 1e3 for n in norms), (name, norms)
    assert 0 in codes.values(), "no command of the step ran on the CPU"


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """Where the toy training rows build and share their shards (GPU_SH_SHARDS)."""
    return tmp_path_factory.mktemp("gpu-sh-shards")


@pytest.mark.slow
@pytest.mark.parametrize("step", STEPS)
def test_every_command_of_the_step_runs_at_toy_size(step, tmp_path, shards):
    """gpu.sh's toy commands (GPU_SH_SMOKE=1) as it lists them, run two at a time by tests/multiproc.py's fork
    server, which imported torch, megatron and megamlm once: those imports were most of a toy row's time, and
    the ~60 rows took 14 minutes of the suite."""
    commands, listing = _listed(tmp_path, step, GPU_SH_SMOKE="1", GPU_SH_SHARDS=str(shards))
    same = re.findall(r"^=== (\S+): same toy command as (\S+)$", listing, re.M)
    assert all(first in commands for _, first in same), listing
    # nothing goes into the checkout: its cache/ is the demo's (a toy build there once changed `make demo`'s losses)
    written = [a.split("=", 1)[1] for argv in commands.values() for a in argv
               if a.startswith(("data.shards=", "train.run_dir="))]
    assert all(Path(path).is_relative_to(shards) or Path(path).is_relative_to(tmp_path) for path in written), written
    toy = tmp_path / "toy"
    toy.mkdir()
    codes = run_commands(commands, str(toy))
    assert sorted(codes) == sorted(commands)
    _assert_each_ran_or_needs_a_gpu(codes, toy, {name: " ".join(argv) for name, argv in commands.items()})


@pytest.mark.slow
def test_the_script_itself_runs_a_steps_toy_commands_and_reports_each(tmp_path, shards):
    """gpu.sh's own runner (`timeout`, a log per row, a GPU-only row's refusal counted as checked, the exit
    code) on one step that has both kinds of row."""
    result = _run(tmp_path, "large", GPU_SH_SMOKE="1", GPU_SH_SHARDS=str(shards))
    assert result.returncode == 0, result.stdout + result.stderr
    codes = {name: 0 if end == "exit 0" else 1
             for name, end in re.findall(r"^=== (\S+): (exit \d+|needs a GPU)", result.stdout, re.M)}
    commands = dict(re.findall(rf"^=== (\S+): ({re.escape(sys.executable)} .*)$", result.stdout, re.M))
    assert sorted(codes.values()) == [0, 1], result.stdout
    _assert_each_ran_or_needs_a_gpu(codes, tmp_path, commands)


def test_without_the_smoke_switch_the_commands_are_full_size(tmp_path):
    """PYTHON=echo: the script prints its commands instead of running them."""
    env = {k: v for k, v in os.environ.items() if k != "GPU_SH_SMOKE"}
    result = subprocess.run(["bash", str(SCRIPT), str(tmp_path), "throughput", "loop", "triton"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60, env={**env, "PYTHON": "echo"})
    assert result.returncode == 0, result.stdout + result.stderr
    commands = dict(re.findall(r"^=== (\S+): (echo .*)$", result.stdout, re.M))
    assert "--model base --batch 8" in commands["base-baseline"]
    assert "tiny" not in " ".join(commands.values()) and "--rounds 1" not in " ".join(commands.values())
    loop = commands["loop-2048"]
    assert "data.seq_length=2048" in loop and "train.micro_batch_size=8" in loop and "train.steps=60" in loop
    assert "train.run_dir=runs/loop-2048" in loop and "model.num_layers" not in loop
    assert "data.shards=cache/gpu-wikitext-103-s2048" in loop  # not the demo's cache/wikitext-103-s128 build
    assert "--config configs/pile/large-zero-clap.yaml" in commands["loop-2048-large"]
    triton = commands["loop-2048-triton-flat"]  # the recipe's attention dropout kept: what the kernels are for
    assert "model.attention_backend=triton" in triton and "data.seq_length=2048" in triton
    assert "model.attention_dropout" not in triton and "--lengths 2048" in commands["triton-attention"]


def test_every_training_row_parses_and_its_config_loads_at_full_size(tmp_path):
    """The toy run's size overrides come last and win, so a config that fails only at full size (a key, a value
    out of range) passed it; here each row's command as the lease runs it goes through the CLI's
    parser and the config loader."""
    from megamlm.cli import build_parser
    from megamlm.config import load_config

    rows, _ = _listed(tmp_path, *STEPS)
    training = {name: argv[2:] for name, argv in rows.items() if argv[:3] == ["-m", "megamlm", "train"]}
    assert len(training) > 40, rows
    for name, argv in training.items():
        args = build_parser().parse_args(argv)
        cfg = load_config(args.config, args.overrides)
        assert cfg.data.seq_length in (2048, 8192) and cfg.train.run_dir == f"runs/{name}", name


def test_the_rows_of_the_fastest_settings_run_the_overlay_file_plan_assumes(tmp_path):
    """`megamlm plan` assumes FASTEST_LOOP_MFU for configs/gpu/fastest.yaml's settings: the rows that measure it
    run that file after the recipe, with nothing of it overridden but the micro-batch they are named for."""
    from megamlm.cli import build_parser
    from megamlm.config import load_config_and_origins

    rows, _ = _listed(tmp_path, "triton")
    _, overlay = load_config_and_origins([ROOT / "configs/gpu/fastest.yaml"])
    for name in ("packed-2048-triton-flat-micro16-ffn", "packed-2048-large-triton-flat-ffn"):
        args = build_parser().parse_args(rows[name][2:])
        assert args.config[-1] == "configs/gpu/fastest.yaml", (name, args.config)
        overridden = {override.partition("=")[0] for override in args.overrides} & set(overlay)
        assert overridden == {"train.micro_batch_size"}, (name, overridden)


def test_a_lease_runs_only_the_named_rows_and_skips_what_its_deadline_leaves_no_time_for(tmp_path):
    """GPU_SH_ONLY picks rows out of the steps (benchmarks/gpu_lease.sh: most wanted first);
    GPU_SH_DEADLINE skips a command with under 45 s left, so the call ends before the lease does."""
    env = {**{k: v for k, v in os.environ.items() if k != "GPU_SH_SMOKE"}, "PYTHON": "echo",
           "GPU_SH_ONLY": "loop-2048-noscan base-baseline"}
    run = subprocess.run(["bash", str(SCRIPT), str(tmp_path), "throughput", "loop"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.findall(r"^=== (\S+): echo", run.stdout, re.M) == ["base-baseline", "loop-2048-noscan"]
    assert "train.skip_nonfinite_updates=false" in (tmp_path / "loop-2048-noscan.log").read_text()
    late = subprocess.run(["bash", str(SCRIPT), str(tmp_path), "throughput"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**env, "GPU_SH_DEADLINE": str(int(time.time()) + 30)})
    assert late.returncode == 0, late.stdout + late.stderr
    assert re.findall(r"^=== (\S+): skipped", late.stdout, re.M) == ["base-baseline"]
    assert "skipped: base-baseline (GPU_SH_DEADLINE)" in late.stdout


def test_every_row_the_lease_names_is_a_command_of_its_step(tmp_path):
    """benchmarks/gpu_lease.sh's list: a misspelled row would be skipped without a word, its lease time
    spent on nothing. PYTHON=echo lists each step's commands."""
    lease = (ROOT / "benchmarks/gpu_lease.sh").read_text()
    rows = re.search(r"^ROWS=\(\n(.*?)^\)", lease, re.M | re.S).group(1)
    env = {**{k: v for k, v in os.environ.items() if k != "GPU_SH_SMOKE"}, "PYTHON": "echo"}
    for line in re.findall(r'"([^"]+)"', rows):
        step, *names = line.split()
        run = subprocess.run(["bash", str(SCRIPT), str(tmp_path), step], cwd=ROOT, capture_output=True, text=True,
                             timeout=60, env=env)
        commands = set(re.findall(r"^=== (\S+): echo", run.stdout, re.M))
        assert names and set(names) <= commands, (line, sorted(commands))


def _profile_summary(profile):
    """benchmarks/profile_summary.py's output on `profile`, and its kinds -> (ms per update, share %)."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks/profile_summary.py"), str(profile)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    share = {m.group(1).strip(): (float(m.group(2)), float(m.group(3)))
             for m in re.finditer(r"^  (\S.*?)\s+([0-9.]+)\s+([0-9.]+)%", run.stdout, re.M)}
    return run.stdout, share


def test_the_profile_summary_sums_a_leases_kernels_by_kind():
    """benchmarks/profile_summary.py on session 24's H200 profile of the flat, compiled loop (committed
    with the lease's logs): 107.0 ms of kernels per update (the table's footer over the log's 3
    updates), half of it cuDNN's attention, a fifth the matmuls, as BENCHMARKS.md reads it by hand."""
    profile = ROOT / "benchmarks/results/gpu-h200/lease3-loop-2048-flat-compiled.profile.txt"
    out, share = _profile_summary(profile)
    assert "107.0 ms of kernels per update (3 updates)" in out
    assert 48 < share["attention"][1] < 51 and 19 < share["matmul"][1] < 22, share
    assert abs(sum(ms for ms, _ in share.values()) - 107.0) < 0.5  # every kernel counted once


def test_the_profile_summary_counts_our_triton_kernels_as_attention():
    """Session 60's lease profiled model.attention_backend=triton's kernels under their first names
    (`_forward_kernel`, `_backward_keys_kernel`, `_backward_queries_kernel`): attention, not "other" —
    40% of the 151.5 ms of kernels per update at micro-batch 16, the matmuls 31%."""
    profile = ROOT / "benchmarks/results/gpu-h200/lease7-loop-2048-triton-flat-micro16.profile.txt"
    out, share = _profile_summary(profile)
    assert "151.5 ms of kernels per update (3 updates)" in out
    assert 39 < share["attention"][1] < 41 and 30 < share["matmul"][1] < 32 and share["other"][1] < 1, share


def _wheel(folder: Path, name: str, tag: str, text: str) -> None:
    """A wheel of one module, `name`.py holding `text`, for the tag (python-abi-platform)."""
    import base64
    import hashlib
    import zipfile

    info = f"{name}-1.0.dist-info"
    files = {f"{name}.py": text, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: {tag}\n"}

    def digest(body: str) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(body.encode()).digest()).rstrip(b"=").decode()

    record = "".join(f"{path},sha256={digest(body)},{len(body.encode())}\n" for path, body in files.items())
    record += f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{name}-1.0-{tag}.whl", "w") as wheel:
        for path, body in {**files, f"{info}/RECORD": record}.items():
            wheel.writestr(path, body)


def test_the_lease_installs_each_carried_package_once_with_the_wheel_for_the_machines_python(tmp_path):
    """benchmarks/gpu_wheels.sh carries a wheel per Python version of the packages that have them: the lease's
    `install_wheels` gives pip the package names, so it takes the one for the python3 it runs (all of them as
    files would be refused as one package twice); a package with no wheel for that Python is one line naming
    what to do. Wheels built here, for this interpreter's tag and another's; python3 is this interpreter."""
    from packaging.tags import sys_tags

    here = next(tag for tag in sys_tags() if tag.interpreter.startswith("cp") and tag.abi != "abi3")
    other = f"cp3{sys.version_info.minor + 1}"
    wheels, bin_dir = tmp_path / "wheels", tmp_path / "bin"
    wheels.mkdir()
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    for interpreter in (here.interpreter, other):
        _wheel(wheels, "binary", f"{interpreter}-{interpreter}-{here.platform}", f"BUILT_FOR = '{interpreter}'\n")
    _wheel(wheels, "pure", "py3-none-any", "PURE = True\n")
    _wheel(wheels, "elsewhere", f"{other}-{other}-{here.platform}", "\n")
    function = re.search(r"^install_wheels\(\) \{.*?^\}\n", (ROOT / "benchmarks/gpu_lease.sh").read_text(),
                         re.M | re.S).group(0)

    def install(folder: Path, target: Path) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", f'{function}install_wheels "$0" "$1"', str(folder), str(target)],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PIP_NO_INPUT": "1"})

    refused = install(wheels, tmp_path / "refused")
    assert refused.returncode == 1
    assert (f"gpu_lease.sh: {wheels} has no wheel of some package for Python {sys.version.split()[0]}: run "
            f"GPU_PYTHONS=<its version> bash benchmarks/gpu_wheels.sh on the development machine") in refused.stdout
    (wheels / f"elsewhere-1.0-{other}-{other}-{here.platform}.whl").unlink()
    site = tmp_path / "site"
    run = install(wheels, site)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (site / "binary.py").read_text() == f"BUILT_FOR = '{here.interpreter}'\n"
    assert (site / "pure.py").exists() and sorted(p.name for p in site.glob("*.dist-info")) == [
        "binary-1.0.dist-info", "pure-1.0.dist-info"]
