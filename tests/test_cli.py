"""The `megamlm` command as a user runs it: the smoke main job, parameter counts, config errors."""

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megamlm.errors import PEER_GONE_MARKS
from tests.multiproc import run_on_ranks, shell_environment

ROOT = Path(__file__).resolve().parents[1]


def megamlm(*args, timeout=300):
    env = shell_environment(PYTHONPATH=str(ROOT))  # OMP_NUM_THREADS: conftest.py
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
    assert "\r" not in run.stderr, run.stderr  # transformers' loading and writing bars are off
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
        f"model.num_attention_heads=4; allowed: 1, 2, 4 (model.num_attention_heads set in "
        f"{ROOT}/configs/model/tiny.yaml)"]


class _Writes(io.StringIO):
    """A stream that records each write call (one call: one write(2) on an unbuffered stdout)."""

    def __init__(self):
        super().__init__()
        self.calls, self.flushes = [], 0

    def write(self, text):
        self.calls.append(text)
        return super().write(text)

    def flush(self):
        self.flushes += 1


def test_a_line_is_one_write_so_processes_sharing_a_log_never_split_it():
    """CI's `glue --parallel 2` log read "RTE ... epoch 172/300 ... | 0sSTS-B: finished (1 of 3 tasks)": under
    PYTHONUNBUFFERED=1 `print` wrote the text and its newline in two calls, and the parent's line landed
    between a task process's two. `print_line` hands a line over in one call, flushed; with many processes
    writing lines at once into one pipe, each line arrives whole."""
    from megamlm.console import print_line

    stream = _Writes()
    print("a line", file=stream, flush=True)
    assert stream.calls == ["a line", "\n"]  # why the helper exists
    stream = _Writes()
    print_line("a line", stream)
    assert stream.calls == ["a line\n"] and stream.flushes == 1
    code = "import sys; from megamlm.console import print_line\n" \
           "for i in range(3000): print_line(f'{sys.argv[1]} {i} ' + 'x' * 60)"
    env = shell_environment(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    read, write = os.pipe()
    writers = [subprocess.Popen([sys.executable, "-c", code, name], stdout=write, env=env) for name in "ab"]
    os.close(write)
    with os.fdopen(read) as pipe:
        lines = pipe.read().splitlines()
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    assert len(lines) == 6000
    assert all(re.fullmatch(r"[ab] \d+ x{60}", line) for line in lines), [x for x in lines if "x" * 60 not in x][:3]
    for name in "ab":
        assert [int(line.split()[1]) for line in lines if line[0] == name] == list(range(3000))


def test_megamlms_warnings_are_one_line_and_other_packages_keep_pythons_format():
    """A warning megamlm raises is printed as its errors are (Python's format: the file, line and category,
    and a second line quoting the warn call); --debug shows where it came from."""
    option = 'model.flex_kernel_options="BLOCK_M=64"'
    run = megamlm("params", "--config", "configs/demo.yaml", option)
    assert run.returncode == 0, run.stderr
    assert run.stderr.strip().splitlines() == [
        "megamlm: params: warning: model.flex_kernel_options='BLOCK_M=64' applies to model.attention_backend=flex "
        "only; the sdpa backend ignores it"]
    assert "total" in run.stdout
    debug = megamlm("params", "--debug", "--config", "configs/demo.yaml", option)
    assert "megamlm/model/attention.py:" in debug.stderr and "UserWarning: model.flex_kernel_options" in debug.stderr

    import warnings

    from megamlm.errors import warnings_as_lines

    with warnings_as_lines("train"):
        theirs = warnings.formatwarning("deprecated", FutureWarning, "/usr/lib/python3/site-packages/x.py", 7)
        ours = warnings.formatwarning("no validation:\n  one line", UserWarning, str(ROOT / "megamlm/train/loop.py"), 9)
    assert theirs.startswith("/usr/lib/python3/site-packages/x.py:7: FutureWarning: deprecated")
    assert ours == "megamlm: train: warning: no validation: one line\n"
    cli = ROOT / "megamlm/cli/__init__.py"
    assert warnings.formatwarning("m", UserWarning, str(cli), 1, "") == f"{cli}:1: UserWarning: m\n"  # restored


def test_output_whose_reader_has_gone_ends_quietly_as_a_unix_tool_does(monkeypatch):
    """`megamlm config | head -1`: once the reader closes the pipe, the command ends with 128 + SIGPIPE and no
    "[Errno 32] Broken pipe" line (the read end is closed before the command has written anything)."""
    from megamlm.console import READER_GONE_EXIT, stdout_reader_gone

    run = subprocess.Popen([sys.executable, "-m", "megamlm", "config", "--config", "configs/demo.yaml", "--explain"],
                           cwd=ROOT, env=shell_environment(PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    run.stdout.close()
    assert (run.wait(timeout=120), run.stderr.read()) == (READER_GONE_EXIT, "")
    # a broken pipe of another kind (a worker's) is an error as before: only stdout's own reader counts
    read, write = os.pipe()
    with os.fdopen(write, "w") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        assert not stdout_reader_gone()
        os.close(read)
        assert stdout_reader_gone()
        monkeypatch.undo()


def test_config_prints_the_resolved_yaml():
    run = megamlm("config", "--config", "configs/model/base.yaml", "--config",
                  "configs/variants/zero-clap.yaml")
    assert run.returncode == 0, run.stderr
    assert "position: alibi" in run.stdout and "vocab_size: 50262" in run.stdout
    assert "num_layers: 12" in run.stdout


def test_an_option_is_its_whole_name_in_every_verb():
    """No prefix matching: `plan --gpus 16` would have planned 16 GPUs per node; no verb of the config
    takes glue's --save (it was accepted and ignored); the verbs' own parsers refuse prefixes too."""
    from megamlm.cli import build_parser

    for args in (["plan", "--gpus", "16"], ["train", "--save"], ["shards", "build", "x.txt", "--ou", "y"]):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(args)
        assert exit_.value.code == 2, args
    assert build_parser().parse_args(["plan", "--gpus-per-node", "16"]).gpus_per_node == 16


PLAN = ["plan", "--config", "configs/pile/base-zero-clap.yaml"]
GLUE = ["glue", "--checkpoint", "no-folder", "--data-dir", "no-data", "--tasks", "RTE"]
EVAL = ["eval", "ppl", "--checkpoint", "no-folder", "--data", "no-data"]
OUT_OF_RANGE = [  # before: a division by zero or IndexError ("internal error"), a negative wall time, or silence
    ([*PLAN, "--nodes", "0"], "config error: --nodes 0 must be >= 1"),
    ([*PLAN, "--gpus-per-node", "0"], "config error: --gpus-per-node 0 must be >= 1"),
    ([*PLAN, "--mfu", "0"], "config error: --mfu 0.0 must be in (0, 1]"),
    ([*PLAN, "--fill", "1.5"], "config error: --fill 1.5 must be in (0, 1]"),
    ([*PLAN, "--gpu-memory", "0"], "config error: --gpu-memory 0 must be > 0 (GiB per GPU)"),
    ([*GLUE, "--batch-size", "0"], "glue: --batch-size 0 must be >= 1"),
    ([*GLUE, "--max-length", "1"], "glue: --max-length 1 must be >= 6 (a pair's 4 special tokens and a token of "
                                   "each sentence)"),
    ([*GLUE, "--classifier-dropout", "2"], "glue: --classifier-dropout 2 must be in [0, 1)"),
    ([*GLUE, "--layerwise-lr-decay", "1.2"], "glue: --layerwise-lr-decay 1.2 must be in [0, 1] (0: the head alone "
                                             "trains; 1: one learning rate)"),
    ([*GLUE, "--weight-decay", "-1"], "glue: --weight-decay -1 must be >= 0"),
    ([*GLUE, "--max-train-samples", "0"], "glue: --max-train-samples 0 must be >= 1"),
    ([*GLUE, "--parallel", "0"], "glue: --parallel 0 must be >= 1"),
    ([*GLUE, "--seeds", "1,-2"], "glue: seed -2 must be >= 0"),
    ([*EVAL, "--seq-length", "1"], "eval: length 1 must be >= 2"),
    ([*EVAL, "--batch-size", "0"], "eval: --batch-size 0 must be >= 1"),
    (["shards", "build", "no-file", "--out", "no-out", "--workers", "0"], "shards: --workers 0 must be >= 1"),
    (["shards", "build", "no-file", "--out", "no-out", "--shard-tokens", "0"], "shards: --shard-tokens 0 must be >= 1"),
    (["convert", "--from", "megamlm", "--to", "fairseq", "no-folder", "no-out", "--tolerance", "-1"],
     "convert: --tolerance -1 must be >= 0 (the largest |Δ| allowed per unit of logit)"),
]


@pytest.mark.parametrize("args, message", OUT_OF_RANGE, ids=[" ".join(a[-2:]) for a, _ in OUT_OF_RANGE])
def test_a_number_out_of_range_is_one_line_before_any_work(args, message, capsys):
    """The paths named do not exist: the number is what is refused, first."""
    from tests.faults_common import run_cli

    assert run_cli(capsys, *args) == (2, f"megamlm: {message}")


def test_an_unknown_gpu_is_one_line_with_the_likely_one(capsys):
    from tests.faults_common import run_cli

    assert run_cli(capsys, *PLAN, "--gpu", "h100") == (
        2, "megamlm: config error: --gpu h100; known: H200, H100, A100, V100; did you mean 'H100'?")


@pytest.mark.parametrize("args, message", [
    ([*GLUE, "--seeds", "1,x"], "argument --seeds: '1,x': 'x' is not an integer (a comma-separated list of "
                                "integers, e.g. 1,2,3)"),
    (["eval", "extrapolation", "--checkpoint", "m", "--data", "d", "--lengths", "128,"],
     "argument --lengths: '128,': '' is not an integer (a comma-separated list of integers, e.g. 1,2,3)"),
    (["train", "--nproc", "0"], "train: --nproc 0 must be >= 1"),
    (["train", "--nodes", "0"], "train: --nodes 0 must be >= 1"),
    (["train", "--nodes", "2"], "train: --nodes 2 needs --rendezvous HOST:PORT (where the machines meet)"),
    (["train", "--nodes", "2", "--rendezvous", "head-node"], "train: --rendezvous head-node: expected HOST:PORT")])
def test_a_list_that_is_not_integers_is_argparses_one_line(args, message, capsys):
    from megamlm.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {message}")


TORCHRUNS_OWN_LINES = ("OMP_NUM_THREADS", "closing signal", "failed (exitcode", "torch/distributed")


@pytest.mark.slow
def test_ranks_that_fail_under_nproc_end_with_their_lines_and_one_more_not_torchruns_traceback(tmp_path):
    # rank 0 alone builds the shards and refuses a folder of a user's; rank 1 waits for it in a collective
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "notes.txt").write_text("a user's file")
    run = megamlm("train", "--nproc", "2", "--config", "configs/demo.yaml", f"data.shards={shards}",
                  f"train.run_dir={tmp_path / 'run'}")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]  # a run of one rank's code
    lines = run.stderr.strip().splitlines()
    refused = (f"megamlm: train: {shards} is not empty and holds no finished shard build (notes.txt); choose a new "
               f"or empty folder (megamlm never deletes files it did not write)")
    # rank 1 either saw rank 0's process end in its collective (its own line, exit 3; gloo says "closed" or "reset"
    # as the socket's end reaches it) or was stopped by torchrun
    peer_gone = {f"megamlm: train: stopped: another rank's process ended ({mark})" for mark in PEER_GONE_MARKS}
    assert lines.count(refused) == 1 and set(lines[:-1]) <= {refused, *peer_gone}, lines
    assert re.fullmatch(r"megamlm: train: [12] of 2 ranks failed, rank 0 first \(exit code 2\); what each said "
                        r"is above", lines[-1]), lines[-1]
    assert not any(own in run.stderr for own in TORCHRUNS_OWN_LINES), run.stderr


@pytest.mark.parametrize("overrides, message", [
    (["train.steps=0"], "config error: command line: train.steps=0 must be >= 1"),
    (["parallel.tensor_parallel=4"], "config error: parallel.tensor_parallel=4 does not divide the world size 2; "
                                     "launch a multiple of 4 processes"),
    (["parallel.backend=nccl"], "config error: parallel.backend=nccl needs CUDA GPUs; allowed here: gloo, auto"),
    (["model.vocab_size=100"], "config error: model.vocab_size=100 differs from the dictionary of data.tokenizer=gpt2 "
                               "(50265 symbols); set model.vocab_size=50265"),
    (["data.build_from=[missing.txt]", "data.shards=TMP/shards"], f"train: input not found: missing.txt (relative "
                                                                   f"to the working directory {ROOT})"),
    (["--resume", "step00000009"], "train: no complete checkpoint step00000009 in TMP/run/checkpoints (complete ones: "
                                   "none; or --resume auto)"),
    (["parallel.tensor_parallel=2", "--nproc", "1", "--nodes", "3", "--rendezvous", "127.0.0.1:9"],
     "config error: parallel.tensor_parallel=2 does not divide the world size 3; launch a multiple of 2 processes"),
    (["train.global_batch_size=48"], "config error: train.global_batch_size=48 is not divisible by "
                                     "train.micro_batch_size × data-parallel size = 16 × 2; choose a multiple of 32")])
def test_what_every_rank_would_refuse_is_one_line_before_nproc_starts_any(overrides, message, tmp_path):
    overrides, message = [o.replace("TMP", str(tmp_path)) for o in overrides], message.replace("TMP", str(tmp_path))
    run = megamlm("train", "--nproc", "2", "--config", "configs/demo.yaml", f"train.run_dir={tmp_path / 'run'}",
                  *overrides)
    assert (run.returncode, run.stdout, run.stderr) == (2, "", f"megamlm: {message}\n")
    assert not (tmp_path / "run").exists()


def test_a_config_from_a_shells_process_substitution_is_read_and_under_nproc_refused_in_one_line():
    """`--config <(...)` is /dev/fd/N, whose real path is "pipe:[...]" ("config file not found" named that);
    its includes are relative to the directory the command runs in. Under --nproc each rank would read the
    config again, from a pipe already read: one line."""
    def shell(command: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", f"{sys.executable} -m megamlm {command}"], cwd=ROOT,
                              env=shell_environment(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)

    piped = "<(printf 'include: [configs/demo.yaml]\\nmodel: {num_layers: 3}\\n')"
    read = shell(f"config --config {piped}")
    assert read.returncode == 0 and read.stderr == "", read.stderr
    assert read.stdout == shell("config --config configs/demo.yaml model.num_layers=3").stdout
    refused = shell(f"train --nproc 2 --config {piped}")
    assert refused.returncode == 2 and refused.stdout == "", refused.stderr
    assert re.fullmatch(r"megamlm: train: --config /dev/fd/\d+ is not a file \(a shell's <\(\.\.\.\)\?\): each "
                        r"of the ranks reads the config again; write it to a file\n", refused.stderr), refused.stderr


def test_a_launchers_variables_left_in_the_environment_are_refused_not_a_run_of_each_machine(tmp_path):
    """LOCAL_RANK makes `megamlm train` a rank; with WORLD_SIZE=1 each machine of --nodes 2 trained alone
    (two DP=1 runs wrote one run dir: a checkpoint's sha256 damaged)."""
    env = shell_environment(PYTHONPATH=str(ROOT), LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    run = subprocess.run([sys.executable, "-m", "megamlm", "train", "--nproc", "1", "--nodes", "2", "--rendezvous",
                          "127.0.0.1:9", "--config", "configs/demo.yaml", f"train.run_dir={tmp_path / 'run'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert (run.returncode, run.stderr) == (2, "megamlm: train: --nproc 1 --nodes 2 asks for 2 processes, but this "
                                               "process has a launcher's LOCAL_RANK=0 and WORLD_SIZE=1; unset the "
                                               "launcher's variables (RANK, WORLD_SIZE, LOCAL_RANK) or leave out "
                                               "--nproc and --nodes under a launcher\n")
    assert not (tmp_path / "run").exists()


def test_the_run_ends_with_the_first_rank_that_failed_on_its_own(tmp_path, monkeypatch, capsys):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from megamlm.cli.torchrun import PEER_GONE_EXIT, failed, first_failure

    def failure(rank, exitcode, timestamp, said=None):
        """torchrun's record of a failed rank; `said`: (line, code) the rank recorded with `failed` first."""
        error_file = tmp_path / f"error-{rank}-{exitcode}-{timestamp}.json"
        if said is not None:
            monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
            assert failed(*said) == said[1]
        stopped = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))
        if said is None:
            stopped.timestamp = timestamp
        return rank, stopped

    # rank 1's mistake; rank 0 lost it in a collective in the same second, or was stopped by torchrun's SIGTERM
    assert first_failure(dict([failure(0, PEER_GONE_EXIT, 100), failure(1, 2, 100)])) == (1, 2)
    assert first_failure(dict([failure(0, -15, 100), failure(1, 2, 101)])) == (1, 2)
    assert first_failure(dict([failure(0, 1, 101), failure(1, 2, 100)])) == (1, 2)  # the earlier
    assert first_failure(dict([failure(0, 1, 100), failure(1, 2, 100)])) == (0, 1)  # the same second: the lower rank
    assert first_failure(dict([failure(0, PEER_GONE_EXIT, 100), failure(1, -9, 100)])) == (0, PEER_GONE_EXIT)
    # rank 0 said its mistake and was stopped while exiting, after rank 1, which lost it, had exited
    mistake = failure(0, -15, 0, said=("megamlm: train: a user's mistake", 2))
    lost = failure(1, PEER_GONE_EXIT, 0, said=("megamlm: train: stopped: another rank's process ended", PEER_GONE_EXIT))
    assert first_failure(dict([mistake, lost])) == (0, 2)
    assert capsys.readouterr().err.splitlines() == ["megamlm: train: a user's mistake",
                                                    "megamlm: train: stopped: another rank's process ended"]


def _collective_after_the_peer_left() -> str | None:
    import torch.distributed as dist

    from megamlm.errors import peer_gone

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        dist.destroy_process_group()  # its connections close, as when its process ends
        return None
    time.sleep(1)
    try:
        dist.barrier()
    except RuntimeError as err:
        return peer_gone(err)
    return "the barrier passed"


def test_a_collective_that_lost_its_peer_is_told_apart_from_a_bug():
    from megamlm.errors import PEER_GONE_MARKS, peer_gone

    lost, left = run_on_ranks(_collective_after_the_peer_left, 2)
    assert lost in PEER_GONE_MARKS and left is None, lost
    assert peer_gone(RuntimeError("CUDA out of memory")) is None
    assert peer_gone(ValueError("Connection closed by peer")) is None  # a user's file saying it: not a collective
