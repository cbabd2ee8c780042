"""Bad input, as a careless or hostile user produces it: every mistake is one line naming the
culprit (file, key, value), a non-zero exit code and no traceback, checked before any work. Run with
the fault tests: `pytest -m faults` (or `make test-faults`)."""

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from megamlm.cli import main as cli
from megamlm.data.stream import ShardSet
from megamlm.data.tokenizer import Tokenizer
from megamlm.train.flops import mfu
from tests.fairseq_fixtures import fairseq_checkpoint
from tests.faults_common import (ROOT, WIKITEXT, fault_shards, finished_run, flip_byte, one_line,
                                 run_cli, snapshot, tiny)
from tests.multiproc import shell_environment

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return fault_shards(tmp_path_factory)


@pytest.fixture(scope="module")
def run(shards, tmp_path_factory):
    return finished_run(shards, tmp_path_factory)


# ------------------------------------------------------------------------------------------------
# Every bad input: one line naming the culprit, exit 2, no traceback
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bad_train_setups_are_one_line_before_any_work(shards, run, tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder should be")
    users = tmp_path / "users"
    users.mkdir()
    (users / "config.yaml").write_text("mine: true\n")
    samples = int(ShardSet(shards).block_counts(64, "complete").sum())
    assert samples >= 512  # "packed rows too few" below: more samples than its update takes
    cases = {
        "run dir under a file": (tiny(shards, blocker / "run"),
                                 f"cannot create train.run_dir {blocker}/run: {blocker} is a file, not a folder"),
        "user's config.yaml in the run dir": (tiny(shards, users), f"train.run_dir={users} holds config.yaml but "
                                              f"no megamlm run (no log.jsonl): megamlm would write there; choose "
                                              f"another train.run_dir"),
        "missing checkpoint": (tiny(shards, run, "train.steps=4") + ["--resume", "step00000099"],
                               f"no complete checkpoint step00000099 in {run}/checkpoints (complete ones: "
                               f"step00000002, step00000004; or --resume auto)"),
        "missing init_from": (tiny(shards, tmp_path / "r1", f"train.init_from={tmp_path}/nothing"),
                              f"train.init_from={tmp_path}/nothing: not a model folder (no config.yaml)"),
        "missing build_from input": (tiny(shards, tmp_path / "r3", f"data.shards={tmp_path}/new-shards",
                                          "data.build_from=[corpus/missing.txt]"),
                                     f"input not found: corpus/missing.txt (relative to the working directory "
                                     f"{ROOT})"),
        "shards too small": (tiny(shards, tmp_path / "r4", "train.global_batch_size=4096"),
                             f"{shards}: {samples} samples of length 64 do not fill one update of 4096 sequences "
                             f"(micro 4 x accumulation 1024 x DP 1)"),
        # enough samples for the launcher's count, too few packed rows: the rank's stream refuses it, after it
        # built its model and engine (train.run_dir/checkpoints was made then, and the fixed command refused)
        "packed rows too few": (tiny(shards, tmp_path / "r5", "data.packing=packed", "train.global_batch_size=2048"),
                                f"{shards}: {samples} samples of length 64 do not fill one update of 512 packed "
                                f"micro-batches of 256 tokens (micro 1 x accumulation 512 x DP 1)"),
        "flex on CPU": (tiny(shards, tmp_path / "r2", "model.attention_backend=flex", "model.attention_dropout=0"),
                        "model.attention_backend=flex needs a CUDA GPU (torch 2.13 has no FlexAttention "
                        "backward on CPU); use model.attention_backend=sdpa"),
        "resume behind the run": (tiny(shards, run, "train.steps=3") + ["--resume", "auto"],
                                  "train.steps=3 but step00000004 is at update 4: raise train.steps to continue "
                                  "the run"),
        # elastic resume takes another layout, not another global batch, model or an impossible TP
        "resume with another global batch": (
            tiny(shards, run, "train.steps=6", "train.global_batch_size=8") + ["--resume", "auto"],
            f"{run}/checkpoints/step00000004 was written with a global batch of 4 sequences (TP=1 DP=1 ZeRO-0, "
            f"micro 4 x accumulation 1), this run's is 8: set train.global_batch_size=4 to continue the run, "
            f"or pass --allow-batch-change to convert the data position in samples"),
        "resume another model": (
            tiny(shards, run, "train.steps=6", "model.ffn_hidden_size=256") + ["--resume", "auto"],
            f"{run}/checkpoints/step00000004 holds another model (model.ffn_hidden_size: checkpoint 128 vs run "
            f"256); resume with the run's config (--config {run}/config.yaml) or start a new run with "
            f"train.init_from"),
        "resume another model with ALiBi": (  # values as YAML writes them: null, not Python's None
            tiny(shards, run, "train.steps=6", "model.position=alibi") + ["--resume", "auto"],
            f"{run}/checkpoints/step00000004 holds another model (model.position: checkpoint learned vs run alibi; "
            f"model.alibi_mode: checkpoint null vs run offset); resume with the run's config (--config "
            f"{run}/config.yaml) or start a new run with train.init_from"),
        "resume at a TP degree that does not divide the heads": (
            tiny(shards, run, "train.steps=6", "parallel.tensor_parallel=3") + ["--resume", "auto"],
            "command line: parallel.tensor_parallel=3 does not divide model.num_attention_heads=4; allowed: "
            "1, 2, 4"),
    }
    before = snapshot(run)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = {name: subprocess.Popen([sys.executable, "-m", "megamlm", "train", *args], cwd=ROOT, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (args, _) in cases.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, (name, err[-2000:])
        prefix = "megamlm: train: " if name in ("run dir under a file", "user's config.yaml in the run dir",
                                                "missing checkpoint", "resume another model",
                                                "resume another model with ALiBi",
                                                "missing build_from input", "shards too small",
                                                "packed rows too few") \
            else "megamlm: config error: "
        assert one_line(err) == prefix + cases[name][1], name
    ours = ("log.jsonl", "tensorboard/")  # each attempt appends its own (megamlm's) log files
    assert {k: v for k, v in snapshot(run).items() if not k.startswith(ours)} == \
        {k: v for k, v in before.items() if not k.startswith(ours)}
    assert (users / "config.yaml").read_text() == "mine: true\n"
    # a run that failed before its first log line (here: in the data and in train.init_from) left no files,
    # so the same command runs once its input is fixed, without --resume or --overwrite
    assert not any((tmp_path / r).exists() for r in ("r1", "r3", "r4", "r5"))
    fixed = subprocess.run([sys.executable, "-m", "megamlm", "train", *tiny(shards, tmp_path / "r1", "train.steps=1")],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert fixed.returncode == 0 and "done: " in fixed.stdout, fixed.stderr[-2000:]


@pytest.mark.slow
def test_what_resuming_would_refuse_is_one_line_before_nproc_starts_any_rank(shards, run, tmp_path, capsys,
                                                                            tmp_path_factory):
    """A checkpoint of another model or global batch, a global batch the new layout cannot split, train.steps
    behind the run, a train.init_from of another architecture, shards of another dictionary or too small for
    one update: each rank refused it after it had imported torch and DeepSpeed and built its model (and read
    the folder's weights) (~50 s and a line per rank under --nproc 2 on 2 cores); the launching process now
    refuses it first (the shards' line is the one a rank's stream gives, tests/test_stream.py).
    `--check` says the same line, or what the run would do, and starts and writes nothing."""
    samples = int(ShardSet(shards).block_counts(64, "complete").sum())
    foreign = tmp_path_factory.mktemp("foreign") / "tokenizer"  # GPT-2's BPE, its dictionary's first two ids swapped
    shutil.copytree(ROOT / "megamlm/data/assets/gpt2", foreign)
    lines = (foreign / "dict.txt").read_text().splitlines(keepends=True)
    (foreign / "dict.txt").write_text("".join([lines[1], lines[0], *lines[2:]]))
    batch_line = (f"{run}/checkpoints/step00000004 was written with a global batch of 4 sequences (TP=1 DP=1 ZeRO-0, "
                  f"micro 4 x accumulation 1), this run's is 8: set train.global_batch_size=4 to continue the run, "
                  f"or pass --allow-batch-change to convert the data position in samples")
    cases = {  # overrides of the finished 4-update run's config -> (exit code, the one line)
        ("train.steps=6", "train.global_batch_size=8"): (2, "megamlm: config error: " + batch_line),
        ("train.steps=6", "train.micro_batch_size=2", "train.global_batch_size=6"): (
            2, "megamlm: config error: train.global_batch_size=6 is not divisible by train.micro_batch_size × "
               "data-parallel size = 2 × 2; choose a multiple of 4"),
        ("train.steps=6", "model.ffn_hidden_size=256"): (
            2, f"megamlm: train: {run}/checkpoints/step00000004 holds another model (model.ffn_hidden_size: "
               f"checkpoint 128 vs run 256); resume with the run's config (--config {run}/config.yaml) or start a "
               f"new run with train.init_from"),
        ("train.micro_batch_size=2", f"train.init_from={run}/final", "model.ffn_hidden_size=256",
         f"train.run_dir={tmp_path / 'from'}"): (
            2, f"megamlm: config error: train.init_from={run}/final holds a different architecture: "
               f"model.ffn_hidden_size: run 256 vs 128 (start from its config.yaml: --config {run}/final/config.yaml)"),
        ("train.steps=3", "train.micro_batch_size=2"): (
            2, "megamlm: config error: train.steps=3 but step00000004 is at update 4: raise train.steps to continue "
               "the run"),
        ("train.global_batch_size=2048", f"train.run_dir={tmp_path / 'small'}"): (
            2, f"megamlm: train: {shards}: {samples} samples of length 64 do not fill one update of 2048 sequences "
               f"(micro 4 x accumulation 256 x DP 2)"),
        (f"data.tokenizer={foreign}", f"train.run_dir={tmp_path / 'foreign'}"): (
            2, f"megamlm: train: {shards} was built with another dictionary (50265 symbols, sha256 "
               f"{json.loads((shards / 'manifest.json').read_text())['dictionary_sha256'][:12]}) than this model's "
               f"(sha256 {Tokenizer.load(str(foreign)).dictionary.sha256[:12]}); rebuild the shards with the "
               f"model's tokenizer"),
    }
    before = snapshot(run)
    env = shell_environment(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")  # no LOCAL_RANK of an earlier test's
    launched = {overrides: subprocess.Popen(
        [sys.executable, "-m", "megamlm", "train", "--nproc", "2", "--resume", "auto", *tiny(shards, run, *overrides)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for overrides in cases}
    for overrides, proc in launched.items():
        out, err = proc.communicate(timeout=300)
        assert (proc.returncode, out, one_line(err)) == (cases[overrides][0], "", cases[overrides][1]), overrides
        capsys.readouterr()
        assert cli(["train", "--check", "--nproc", "2", "--resume", "auto", *tiny(shards, run, *overrides)]) == 2
        assert one_line(capsys.readouterr().err) == cases[overrides][1], overrides
    # what the run would do: 2 ranks take the 4-sequence batch in micro-batches of 2, or accumulate 2 at --nodes 2
    would = {("--nproc", "2", "--resume", "auto", "train.micro_batch_size=2"):
             f"2 ranks: tensor parallel 1 x data parallel 2, accumulation 1; train.run_dir={run} resumes from "
             f"step00000004; data.shards={shards}",
             ("--nproc", "1", "--nodes", "2", "--rendezvous", "127.0.0.1:9", "--resume", "step00000002",
              "train.micro_batch_size=1", "train.global_batch_size=4"):
             f"2 ranks (2 machines x 1): tensor parallel 1 x data parallel 2, accumulation 2; train.run_dir={run} "
             f"resumes from step00000002; data.shards={shards}",
             ("--overwrite",): f"1 rank: tensor parallel 1 x data parallel 1, accumulation 1; train.run_dir={run} "
                               f"starts over (its run at update 4 is moved aside); data.shards={shards}",
             ("--resume", "auto", f"train.run_dir={tmp_path / 'new'}", f"data.shards={tmp_path / 'shards'}",
              f"data.build_from=[{WIKITEXT}/valid.txt]"):
             f"1 rank: tensor parallel 1 x data parallel 1, accumulation 1; train.run_dir={tmp_path / 'new'} starts "
             f"at update 0 (no checkpoint to resume); data.shards={tmp_path / 'shards'} (built first from "
             f"data.build_from)"}
    for args, line in would.items():
        options = [a for a in args if "=" not in a]
        capsys.readouterr()
        code = cli(["train", "--check", *options, *tiny(shards, run, "train.steps=6", *(a for a in args if "=" in a))])
        assert (code, capsys.readouterr().out) == (0, f"megamlm: train --check: nothing refused: {line}\n"), args
    # and what the run would warn of: shards of another build than data.build_from asks for
    assert cli(["train", "--check", *tiny(shards, tmp_path / "r", f"data.build_from=[{WIKITEXT}/valid.txt]")]) == 0
    warning = capsys.readouterr().out.splitlines()[1]
    head = f"megamlm: train --check: warning: data.shards={shards} holds a build of other choices than the config's: "
    tail = "; the run uses it as it is (to build anew, point data.shards at a new folder)"
    assert warning.startswith(head) and warning.endswith(tail), warning
    assert snapshot(run) == before
    assert list(tmp_path.iterdir()) == []


def test_bad_files_are_named_in_one_line(run, shards, tmp_path, capsys):
    binary = tmp_path / "binary.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    text = tmp_path / "notes.txt"
    text.write_text("hello, this is not a checkpoint\n")
    final = run / "final"
    dup = tmp_path / "dup.yaml"
    dup.write_text("model:\n  num_layers: 2\n  hidden_size: 64\n  num_layers: 4\n")

    class Code:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    plain_pickle = tmp_path / "plain.pkl"
    plain_pickle.write_bytes(pickle.dumps({"model": Code()}, protocol=2))
    a_list = tmp_path / "list.pt"
    torch.save([1, 2, 3], a_list)
    missing_keys = tmp_path / "missing"
    (missing_keys).mkdir()
    (missing_keys / "config.yaml").write_bytes((final / "config.yaml").read_bytes())
    weights = torch.load(final / "model.pt", weights_only=True)
    del weights["lm_head.bias"], weights["encoder.layers.0.mlp.linear_fc1.bias"]
    torch.save(weights, missing_keys / "model.pt")
    fairseq = tmp_path / "fairseq.pt"
    torch.save(fairseq_checkpoint("baseline"), fairseq)
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    glue = ROOT / "tests/data/glue"
    out = tmp_path / "o"
    transformers_folder = tmp_path / "roberta-base"
    transformers_folder.mkdir()
    (transformers_folder / "config.json").write_text("{}")
    unfinished = tmp_path / "unfinished-run"  # a run dir before its end: config.yaml and checkpoints, no final
    (unfinished / "checkpoints").mkdir(parents=True)
    (unfinished / "config.yaml").write_bytes((run / "config.yaml").read_bytes())
    checkpoints = run / "checkpoints"
    step = checkpoints / (checkpoints / "latest").read_text()
    cases = [
        (["config", "--config", binary], f"config error: config file {binary} is not UTF-8 text (byte 0x80 at "
                                         f"offset 128): a binary file?"),
        (["config", "--config", tmp_path], f"config error: config file {tmp_path} is a directory, not a file"),
        (["config", "--config", dup], f"config error: {dup}:4: not valid YAML (duplicate key 'num_layers' "
                                      f"(first on line 2))"),
        (["convert", "--from", "fairseq", "--to", "megamlm", binary, out],
         f"convert: {binary}: not a torch checkpoint (neither a zip archive nor a pickle; it starts with "
         f"{bytes(range(16))!r})"),
        (["convert", "--from", "fairseq", "--to", "megamlm", text, out],
         f"convert: {text}: not a torch checkpoint (neither a zip archive nor a pickle; it starts with "
         f"b'hello, this is n')"),
        (["convert", "--from", "fairseq", "--to", "megamlm", tmp_path, out],
         f"convert: {tmp_path} is a directory; expected a checkpoint file (.pt)"),
        (["convert", "--from", "fairseq", "--to", "megamlm", a_list, out],
         f"convert: {a_list}: expected a checkpoint dict, got list"),
        (["convert", "--from", "zero", "--to", "megamlm", tmp_path / "no-run", out],
         f"convert: {tmp_path}/no-run: no such folder; pass <run_dir>, <run_dir>/checkpoints or "
         f"<run_dir>/checkpoints/stepNNNNNNNN"),
        (["convert", "--from", "megamlm", "--to", "megamlm", missing_keys, out],
         "convert: the weights do not match the model: missing encoder.layers.0.mlp.linear_fc1.bias, "
         "lm_head.bias; unexpected none"),
        (["convert", "--from", "fairseq", "--to", "megamlm", "--dict", binary, fairseq, out],
         f"convert: dictionary {binary} is not UTF-8 text (byte 0x80 at offset 128): a binary file?"),
        (["fill-mask", final, "Paris is the <mask> of France.", "--topk", "60000"],
         "fill-mask: --topk 60000: must be between 1 and the vocabulary size 50265"),
        (["eval", "ppl", "--checkpoint", final, "--data", binary],
         f"eval: evaluation text {binary} is not UTF-8 text (byte 0x80 at offset 128): a binary file?"),
        (["eval", "extrapolation", "--checkpoint", final, "--data", shards, "--out", blocker / "x"],
         f"eval: cannot create --out {blocker}/x: {blocker} is a file, not a folder"),
        (["glue", "--checkpoint", final, "--data-dir", glue, "--tasks", "RTE", "--out", blocker / "g"],
         f"glue: cannot create --out {blocker}/g: {blocker} is a file, not a folder"),
        (["glue", "--checkpoint", transformers_folder, "--data-dir", glue, "--tasks", "RTE", "--out", out],
         f"glue: {transformers_folder}/config.yaml not found: not a megamlm model folder (training writes one to "
         f"<run_dir>/final; `megamlm convert` writes others); it holds a config.json: a transformers folder? "
         f"`megamlm convert --from hf {transformers_folder} --to megamlm OUT` reads it"),
        (["glue", "--checkpoint", run, "--data-dir", glue, "--tasks", "RTE", "--out", out],
         f"glue: {run} is a training run's folder, not a model folder: its model folder is {final}"),
        (["fill-mask", unfinished, "Paris is the <mask> of France."],
         f"fill-mask: {unfinished} is a training run's folder, not a model folder: the run has not finished (no "
         f"{unfinished}/final); `megamlm convert --from zero {unfinished} --to megamlm OUT` makes a model folder of "
         f"its latest checkpoint"),
        *[(["fill-mask", folder, "Paris is the <mask> of France."],
           f"fill-mask: {folder}/config.yaml not found: not a megamlm model folder (training writes one to "
           f"<run_dir>/final; `megamlm convert` writes others); it is {what}: `megamlm convert --from zero {folder} "
           f"--to megamlm OUT` makes a model folder of {of}")
          for folder, what, of in [(step, "a training checkpoint", "it"),
                                   (checkpoints, "a run's checkpoints folder", "its latest checkpoint")]],
        (["train", "--check", *tiny(shards, out, f"train.init_from={transformers_folder}")],
         f"config error: train.init_from={transformers_folder}: not a model folder (no config.yaml); it holds a "
         f"config.json: a transformers folder? `megamlm convert --from hf {transformers_folder} --to megamlm OUT` "
         f"reads it"),
        (["train", "--check", *tiny(shards, out, f"train.init_from={step}")],
         f"config error: train.init_from={step}: not a model folder (no config.yaml); it is a training checkpoint: "
         f"`megamlm convert --from zero {step} --to megamlm OUT` makes a model folder of it"),
        (["train", "--check", *tiny(shards, out, f"train.init_from={run}")],
         f"config error: train.init_from={run}: {run} is a training run's folder, not a model folder: its model "
         f"folder is {final}"),
        (["shards", "build", tmp_path, "--out", out], f"shards: input {tmp_path} is a directory; pass the files in it"),
        (["shards", "build", text, "--out", blocker], f"shards: output {blocker} is a file, not a folder"),
    ]
    for args, message in cases:
        assert run_cli(capsys, *args) == (2, f"megamlm: {message}"), args
    assert not out.exists()
    code, line = run_cli(capsys, "convert", "--from", "fairseq", "--to", "megamlm", plain_pickle, out)
    assert code == 2 and line.startswith(f"megamlm: convert: {plain_pickle}: refused to load: the pickle "
                                         f"references posix.system, which is not on the allow-list")
    bpe = tmp_path / "bpe"
    bpe.mkdir()
    (bpe / "dict.txt").write_text("a user's dictionary\n")
    code, line = run_cli(capsys, "shards", "train-bpe", WIKITEXT / "valid.txt", "--out", bpe, "--vocab-size", 300)
    assert (code, line) == (2, f"megamlm: shards: {bpe} already holds dict.txt; choose another --out (megamlm "
                               f"never overwrites files it did not write)")
    assert sorted(p.name for p in bpe.iterdir()) == ["dict.txt"]
    assert (bpe / "dict.txt").read_text() == "a user's dictionary\n"
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    code, line = run_cli(capsys, "shards", "build", empty, "--out", out)
    assert (code, line) == (2, f"megamlm: shards: no documents in {empty} (skipped lines: none); nothing to write")
    assert not out.exists()


def test_internal_errors_are_one_line_and_debug_shows_the_traceback(monkeypatch, capsys):
    import megamlm.cli

    def broken(cfg, args):
        raise ZeroDivisionError("a bug")

    monkeypatch.setitem(megamlm.cli.VERBS, "config", (broken, "", None))
    assert run_cli(capsys, "config") == (1, "megamlm: config: internal error: ZeroDivisionError: a bug "
                                            "(rerun with --debug for the traceback)")
    with pytest.raises(ZeroDivisionError):
        cli(["config", "--debug"])


def test_mfu_is_never_above_one():
    assert mfu(6e9, 1e3, 1e13, 1) == pytest.approx(0.6)
    assert mfu(6e9, 1e3, 1e12, 1) is None  # the peak was measured below what was achieved
    assert mfu(6e9, 1e3, float("nan"), 1) is None  # a GPU without a datasheet entry


def test_a_cpu_peak_timed_low_at_the_start_is_timed_again_once_where_the_mfu_passes_one(monkeypatch):
    """A CPU busy at the start read its matmul low and every log line said MFU n/a (session 71's first demo)."""
    from megamlm.train import flops

    timings = iter([1e12, 1e13, 1e11])  # busy at the start, idle at the first retime, busy again
    monkeypatch.setattr(flops, "measured_matmul_peak", lambda dtype: next(timings))
    peak = flops.PeakRate(torch.device("cpu"), "fp32", devices=1)
    assert str(peak) == "1.00 TFLOP/s (CPU matmul measured at start)"
    assert peak.mfu(6e8, 1e3) == pytest.approx(0.6) and peak.retimed is None
    assert peak.mfu(6e9, 1e3) == pytest.approx(0.6)  # 6 against the start's peak: timed again
    assert peak.retimed == "peak timed again: 10.00 TFLOP/s (the start's 1.00 read low: the CPU was busy then)"
    assert peak.mfu(6e9, 1e4) is None  # past 1 again: once a run, n/a as before
    assert peak.peak == 1e13 and next(timings) == 1e11
    elsewhere = flops.PeakRate(torch.device("cpu"), "fp32", devices=1, timed=False)  # ranks but 0: no timing
    assert elsewhere.mfu(6e9, 1e3) is None and str(elsewhere) == "nan TFLOP/s (rank 0's)"


def test_folders_and_checkpoints_from_before_records_still_load_and_damage_is_named(run, tmp_path, world, capsys):
    from megamlm.errors import CorruptFileError
    from megamlm.model.folder import read_model_folder
    from megamlm.train.checkpoint import Checkpoints

    legacy = tmp_path / "legacy"  # a model folder as sessions 1-4 wrote it: no megamlm-files.json
    legacy.mkdir()
    for name in ("config.yaml", "model.pt"):
        (legacy / name).write_bytes((run / "final" / name).read_bytes())
    want = read_model_folder(run / "final").full
    got = read_model_folder(legacy).full
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert cli(["convert", "--from", "megamlm", "--to", "megamlm", str(run / "final"), str(legacy),
                "--overwrite"]) == 0  # its layout is megamlm's: replaceable
    assert (legacy / "megamlm-files.json").exists()
    flip_byte(legacy / "model.pt")
    with pytest.raises(CorruptFileError, match=f"{legacy}/model.pt is corrupt: its sha256 differs"):
        read_model_folder(legacy)
    old = tmp_path / "old/checkpoints/step00000002"  # a checkpoint without hashes: resumable, unverified
    old.parent.mkdir(parents=True)
    (old).mkdir()
    meta = json.loads((run / "checkpoints/step00000002/megamlm.json").read_text())
    del meta["files"]
    (old / "megamlm.json").write_text(json.dumps(meta))
    (old / "complete").write_text("")
    assert Checkpoints(tmp_path / "old", keep_last=3).verify("step00000002") is None
    (old / "megamlm.json").write_text(json.dumps(meta) + " ")  # a hash in `complete` is checked
    (old / "complete").write_text(hashlib.sha256(json.dumps(meta).encode()).hexdigest())
    assert "differs from the hash in complete" in Checkpoints(tmp_path / "old", keep_last=3).verify("step00000002")
    code, line = run_cli(capsys, "fill-mask", legacy, "Paris is the <mask> of France.")
    assert (code, line) == (2, f"megamlm: fill-mask: {legacy}/model.pt is corrupt: its sha256 differs from "
                               f"the one recorded when it was written")


def test_the_launcher_resumes_the_checkpoint_the_ranks_resume_when_the_newest_is_damaged(shards, run, world,
                                                                                        tmp_path, capsys):
    """`--resume auto` before the ranks start (`--nproc`, `--check`, slurm/pretrain.sbatch) took the newest
    complete checkpoint: a damaged megamlm.json there was an internal error that kept the job from starting,
    and a truncated file a line naming the checkpoint the ranks then skip. It now skips what the ranks skip
    (`newest_intact` == `Checkpoints.newest_verified`), except damage only a file's sha256 shows (the ranks
    hash every file; the launcher reads sizes), and refuses a damaged named one with the ranks' line. An unhashed
    megamlm.json (as written before hashes) that is JSON but no checkpoint's record was a traceback on both."""
    from megamlm.train.checkpoint import Checkpoints
    from megamlm.train.checkpoint_folders import newest_intact

    copy = tmp_path / "run"
    shutil.copytree(run / "checkpoints", copy / "checkpoints")
    newest = copy / "checkpoints/step00000004"
    meta, weights = newest / "megamlm.json", newest / "mp_rank_00_model_states.pt"
    intact = {name: (newest / name).read_bytes() for name in ("megamlm.json", "mp_rank_00_model_states.pt", "complete")}
    unhashed = lambda text: (meta.write_text(text), (newest / "complete").write_text(""))  # noqa: E731 (as before hashes)
    damages = {"garbage": lambda: meta.write_text("garbage"), "truncated": lambda: weights.write_bytes(intact[
        weights.name][:1000]), "flipped": lambda: flip_byte(weights), "none": lambda: None,
        "a list": lambda: unhashed("[1, 2]"), "no config": lambda: unhashed('{"step": 4, "position": {}}')}
    lines = {"garbage": f"{meta} differs from the hash in complete",
             "truncated": f"{weights} is corrupt: 1000 bytes, {len(intact[weights.name])} when written",
             "a list": f"{meta} is not a checkpoint's record (not a JSON object)",
             "no config": f"{meta} is not a checkpoint's record (no config)"}
    for damage, make in damages.items():
        for name, data in intact.items():
            (newest / name).write_bytes(data)
        make()
        skipped = [f"checkpoint step00000004 is damaged: {lines[damage]}"] if damage in lines else []
        assert newest_intact(copy / "checkpoints") == ("step00000002" if skipped else "step00000004", skipped)
        verified = Checkpoints(copy, keep_last=3).newest_verified()
        assert verified[0] == ("step00000004" if damage == "none" else "step00000002"), damage
        if damage != "flipped":
            assert verified == newest_intact(copy / "checkpoints"), damage
        capsys.readouterr()
        assert cli(["train", "--check", "--resume", "auto", *tiny(shards, copy, "train.steps=6")]) == 0
        start = "resumes from " + ("step00000002" if skipped else "step00000004")
        assert f"train.run_dir={copy} {start}{''.join(f' ({line})' for line in skipped)}; " in \
            capsys.readouterr().out, damage
    (newest / "complete").write_bytes(intact["complete"])
    meta.write_text("garbage")
    assert cli(["train", "--check", "--resume", "step00000004", *tiny(shards, copy, "train.steps=6")]) == 2
    assert one_line(capsys.readouterr().err) == f"megamlm: train: --resume step00000004: {lines['garbage']}"
