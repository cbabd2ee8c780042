"""Bad input and faults, as a careless or hostile user produces them: nothing a user wrote is ever
deleted or changed, damaged checkpoints and shards are detected, and every mistake is one line with
a non-zero exit code and no traceback. Run alone: `pytest -m faults` (or `make test-faults`)."""

import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from megamlm.cli import main as cli
from megamlm.data.masking import Masker
from megamlm.data.shards import ensure_shards
from megamlm.data.stream import CorruptShardError, MaskedBatches, ShardSet, make_loader
from megamlm.data.tokenizer import Tokenizer
from megamlm.train.flops import mfu
from tests.fairseq_fixtures import fairseq_checkpoint
from tests.multiproc import run_on_ranks
from tests.test_train import _train, config, logged, tiny_shards

pytestmark = pytest.mark.faults
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


def one_line(stderr: str) -> str:
    """The single line a refused command prints (no traceback, nothing else but a progress bar,
    which redraws itself with carriage returns)."""
    lines = [line for line in stderr.strip().split("\n") if line.strip() and "\r" not in line]
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


def megamlm(*args, timeout=300, **popen):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "megamlm", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, **popen)


def tiny(shards, run_dir, *overrides):
    return [f"--config={ROOT / 'configs/variants/baseline.yaml'}", "model.num_layers=2", "model.hidden_size=64",
            "model.num_attention_heads=4", "model.ffn_hidden_size=128", "model.max_positions=64",
            f"data.shards={shards}", "data.seq_length=64", "train.micro_batch_size=4", f"train.run_dir={run_dir}",
            "train.log_interval=1", "train.eval_interval=1000", "train.eval_batches=2", *overrides]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return tiny_shards(tmp_path_factory, "faults")


@pytest.fixture(scope="module")
def run(shards, tmp_path_factory):
    """A finished 4-update run: checkpoints at 2 and 4, final/."""
    run_dir = tmp_path_factory.mktemp("faults") / "run"
    run_on_ranks(_train, 1, config(shards, run_dir, "train.steps=4", "train.save_interval=2"))
    return run_dir


# ------------------------------------------------------------------------------------------------
# Data loss: nothing megamlm did not write is ever deleted or overwritten
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_shard_build_refuses_inputs_inside_its_folder_and_leaves_it_untouched(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    for name in ("valid.txt", "test.txt"):
        (d / name).write_text((WIKITEXT / name).read_text()[:20_000])
    (d / "README.mine").write_text("precious\n")
    before = snapshot(d)
    run = megamlm("train", "--config", "configs/demo.yaml", "train.steps=6", f"data.shards={d}",
                  f"data.build_from=[{d}/valid.txt,{d}/test.txt]", f"train.run_dir={tmp_path / 'x'}")
    assert run.returncode == 2
    assert one_line(run.stderr) == (f"megamlm: train: input {d}/valid.txt is inside the output folder {d}: "
                                    f"the shards need a folder of their own (e.g. {d}-shards)")
    assert snapshot(d) == before


def test_shard_folder_without_manifest_is_refused_not_rebuilt(shards, tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    for p in shards.iterdir():  # a build whose manifest.json was deleted, plus a user's notes
        if p.name != "manifest.json":
            (folder / p.name).write_bytes(p.read_bytes())
    (folder / "NOTES.txt").write_text("mine\n")
    before = snapshot(folder)
    cfg = config(shards, tmp_path / "r", f"data.shards={folder}", f"data.build_from=[{WIKITEXT}/valid.txt]")
    with pytest.raises(ValueError, match=r"is not empty and holds no finished shard build \(NOTES.txt, "
                                         r"train-000000.idx.npy, .*; choose a new or empty folder"):
        ensure_shards(cfg.data, Tokenizer.gpt2(), progress=False)
    assert snapshot(folder) == before
    assert not list(tmp_path.glob(".shards.building-*"))  # the staging folder went away


def test_convert_never_replaces_a_users_folder_and_replaces_its_own_only_when_asked(run, tmp_path, capsys):
    final = run / "final"
    for target in ("megamlm", "hf"):
        out = tmp_path / f"users-{target}"
        before = users_folder(out)
        for extra in ([], ["--overwrite"]):
            code, line = run_cli(capsys, "convert", "--from", "megamlm", "--to", target, final, out, *extra)
            assert code == 2
            assert line == (f"megamlm: convert: output folder {out} holds files megamlm did not write "
                            f"(results.txt, sub/); choose an empty or new folder (megamlm never deletes "
                            f"files it did not write)")
            assert snapshot(out) == before
    ours = tmp_path / "ours"
    assert cli(["convert", "--from", "megamlm", "--to", "megamlm", str(final), str(ours)]) == 0
    before = snapshot(ours)
    code, line = run_cli(capsys, "convert", "--from", "megamlm", "--to", "megamlm", final, ours, "--tp", "2")
    assert code == 2 and line.startswith(f"megamlm: convert: output folder {ours} already holds a megamlm "
                                         f"model folder, written ") and line.endswith("pass --overwrite to replace it")
    assert snapshot(ours) == before
    assert cli(["convert", "--from", "megamlm", "--to", "megamlm", str(final), str(ours), "--tp", "2",
                "--overwrite"]) == 0
    assert sorted(p.name for p in ours.iterdir()) == ["config.yaml", "megamlm-files.json",
                                                      "model-tp00-of-02.pt", "model-tp01-of-02.pt"]
    (ours / "results.txt").write_text("added by the user\n")  # now it holds a user's file too
    code, line = run_cli(capsys, "convert", "--from", "megamlm", "--to", "megamlm", final, ours, "--overwrite")
    assert code == 2 and "holds files megamlm did not write (results.txt)" in line
    file_out = tmp_path / "model.pt"
    file_out.write_bytes(b"a user's file")
    code, line = run_cli(capsys, "convert", "--from", "megamlm", "--to", "fairseq", final, file_out)
    assert (code, line) == (2, f"megamlm: convert: output {file_out} exists; pass --overwrite to replace it")
    assert file_out.read_bytes() == b"a user's file"
    code, line = run_cli(capsys, "convert", "--from", "megamlm", "--to", "fairseq", final, tmp_path)
    assert (code, line) == (2, f"megamlm: convert: output {tmp_path} is a directory; --to fairseq writes a "
                               f"file (e.g. {tmp_path}/checkpoint.pt)")


@pytest.mark.slow
def test_train_refuses_a_run_dir_holding_a_run_and_overwrite_moves_it_aside(run, shards, tmp_path):
    copy = tmp_path / "run"
    copy.mkdir()
    for p in run.rglob("*"):  # an independent copy: this test moves it
        target = copy / p.relative_to(run)
        target.mkdir(exist_ok=True) if p.is_dir() else target.write_bytes(p.read_bytes())
    before = snapshot(copy)
    refused = megamlm("train", *tiny(shards, copy, "train.steps=2"))
    assert refused.returncode == 2
    assert one_line(refused.stderr) == (
        f"megamlm: train: train.run_dir={copy} holds a run at update 4; pass --resume auto to continue it, "
        f"--overwrite to start over (the old run is moved aside), or choose another train.run_dir")
    assert snapshot(copy) == before
    fresh = megamlm("train", *tiny(shards, copy, "train.steps=2", "train.save_interval=1"), "--overwrite")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    (moved,) = tmp_path.glob("run.replaced-*")
    assert snapshot(moved) == before  # the old run, byte for byte
    assert sorted(p.name for p in (copy / "checkpoints").glob("step*")) == ["step00000001", "step00000002"]
    assert (copy / "checkpoints/latest").read_text() == "step00000002"
    assert sorted(logged(copy)) == [1, 2]


def test_model_folders_are_created_with_the_users_umask(run, tmp_path):
    from megamlm.convert.pipeline import convert

    old = os.umask(0o027)
    try:
        convert("megamlm", "megamlm", run / "final", tmp_path / "m", log=lambda *a: None)
    finally:
        os.umask(old)
    assert (tmp_path / "m").stat().st_mode & 0o777 == 0o750
    assert (tmp_path / "m/model.pt").stat().st_mode & 0o777 == 0o640


# ------------------------------------------------------------------------------------------------
# Integrity: damaged checkpoints and shards are detected, never used
# ------------------------------------------------------------------------------------------------


def flip_byte(path: Path, offset: int | None = None) -> None:
    """One byte inverted in the middle (the file keeps its size)."""
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _straight_then_resume(cfg_straight, cfg_killed):
    return _train(cfg_straight), _train(cfg_killed, resume="auto")


@pytest.mark.slow
def test_resume_skips_a_damaged_checkpoint_and_reproduces_the_uninterrupted_losses(shards, tmp_path, capsys):
    steps = ["train.steps=6", "train.save_interval=2", "model.hidden_dropout=0.1"]
    killed = config(shards, tmp_path / "killed", *steps)
    with pytest.raises(RuntimeError, match="died without a result"):
        run_on_ranks(_train, 1, killed, None, 5)  # killed during update 5; checkpoints 2 and 4
    damaged = tmp_path / "killed/checkpoints/step00000004/mp_rank_00_model_states.pt"
    flip_byte(damaged)
    code, line = run_cli(capsys, "convert", "--from", "zero", "--to", "megamlm", tmp_path / "killed",
                         tmp_path / "out")
    assert (code, line) == (2, f"megamlm: convert: {damaged} is corrupt: its sha256 differs from the one "
                               f"recorded when it was written")
    straight = config(shards, tmp_path / "straight", *steps)
    full, resumed = run_on_ranks(_straight_then_resume, 1, straight, killed)[0]
    assert resumed["losses"] == full["losses"][2:]  # from update 2, bit for bit
    events = [json.loads(line) for line in (tmp_path / "killed/log.jsonl").read_text().splitlines()]
    warnings = [e["message"] for e in events if e["event"] == "warning"]
    assert warnings[0] == (f"checkpoint step00000004 is damaged: {damaged} is corrupt: its sha256 differs "
                           f"from the one recorded when it was written")
    assert warnings[1].startswith("checkpoints newer than step00000002 moved to ")  # the damaged one, kept
    assert logged(tmp_path / "killed", "resume", "step") == {2: 2}
    assert [e["step"] for e in events if e["event"] == "train"] == [1, 2, 3, 4, 5, 6]  # each update once
    flip_byte(tmp_path / "killed/checkpoints/step00000006/mp_rank_00_model_states.pt")
    explicit = megamlm("train", *tiny(shards, tmp_path / "killed", *steps[:2]), "--resume", "step00000006")
    assert explicit.returncode == 2
    assert one_line(explicit.stderr) == (
        f"megamlm: train: --resume step00000006: {tmp_path}/killed/checkpoints/step00000006/"
        f"mp_rank_00_model_states.pt is corrupt: its sha256 differs from the one recorded when it was written")


@pytest.mark.slow
def test_damaged_documents_are_skipped_counted_and_logged(shards, tmp_path):
    copy = tmp_path / "shards"
    copy.mkdir()
    for p in shards.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    for tar in copy.glob("train-*.tar"):  # a byte of every 4th document's tokens inverted
        index = np.load(tar.with_suffix(".idx.npy"))
        for offset, size in index[::4, :2]:
            flip_byte(tar, int(offset + size - 1))
    summary = run_on_ranks(_train, 1, config(copy, tmp_path / "r", "train.steps=3"))[0]
    events = [json.loads(line) for line in (tmp_path / "r/log.jsonl").read_text().splitlines()]
    counts = [e["corrupt_samples"] for e in events if e["event"] == "train"]
    assert counts[-1] > 0 and counts == sorted(counts)
    final = [e for e in events if e["event"] == "summary"][0]
    assert final["corrupt_samples"] == counts[-1]
    assert summary["steps"] == 3


def test_token_ids_outside_the_dictionary_are_corruption_never_model_input(shards, tmp_path):
    copy = tmp_path / "shards"
    copy.mkdir()
    for p in shards.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    index_path = copy / "train-000000.idx.npy"
    index = np.load(index_path)
    offset, size = index[0, :2]
    with open(copy / "train-000000.tar", "r+b") as f:  # id 65000 with a matching checksum: only the
        f.seek(offset + size - 2)                          # range check can catch it
        f.write(np.array([65000], dtype=np.uint16).tobytes())
        f.seek(offset)
        index[0, 3] = zlib.crc32(f.read(size))
    np.save(index_path, index)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["index_sha256"] = hashlib.sha256(index_path.read_bytes()).hexdigest()
    (copy / "manifest.json").write_text(json.dumps(manifest))
    shard_set = ShardSet(copy)
    with pytest.raises(CorruptShardError, match=f"{copy}/train-000000.tar: document 0 holds token id 65000, "
                                                f"outside the dictionary of 50265 symbols"):
        shard_set.read_tokens(0, 0, int(index[0, 2]))
    dictionary = Tokenizer.gpt2().dictionary
    stream = MaskedBatches(shard_set, Masker(dictionary.mask_id, dictionary.ordinary_ids()),
                           seq_length=64, micro_batch=4, seed=1, epochs=2)
    corrupt = 0
    with pytest.warns(UserWarning, match="holds token id 65000"):
        for batch in make_loader(stream):
            corrupt += batch.corrupt
            assert int(batch.inputs.max()) < len(dictionary)
    assert corrupt >= 1


def test_damaged_manifest_and_index_name_the_file(shards, tmp_path, capsys, run):
    copy = tmp_path / "shards"
    copy.mkdir()
    for p in shards.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    manifest = copy / "manifest.json"
    manifest.write_text(manifest.read_text()[:100])
    code, line = run_cli(capsys, "eval", "ppl", "--checkpoint", run / "final", "--data", copy, "--seq-length", 64)
    assert code == 2 and line.startswith(f"megamlm: eval: {manifest} is corrupt (JSONDecodeError")
    assert line.endswith("rebuild the shards (`megamlm shards build`)")
    manifest.write_bytes((shards / "manifest.json").read_bytes())
    (index,) = copy.glob("valid-*.idx.npy")
    index.write_bytes(index.read_bytes()[:100])
    code, line = run_cli(capsys, "eval", "ppl", "--checkpoint", run / "final", "--data", copy, "--seq-length", 64)
    assert (code, line) == (2, f"megamlm: eval: {index}: index differs from the manifest's sha256 (damaged)")


def test_truncated_zstd_input_is_an_error_not_a_shorter_corpus(tmp_path, capsys):
    import zstandard

    lines = b"".join(json.dumps({"text": f"document {i} " * 20}).encode() + b"\n" for i in range(2000))
    packed = zstandard.ZstdCompressor().compress(lines)
    src = tmp_path / "part.jsonl.zst"
    src.write_bytes(packed[: len(packed) // 2])
    code, line = run_cli(capsys, "shards", "build", src, "--out", tmp_path / "out", "--valid-fraction", 0)
    assert (code, line) == (2, f"megamlm: shards: {src}: truncated zstd file (it ends inside a compressed "
                               f"frame); re-download or re-compress it")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))
    src.write_bytes(packed + zstandard.ZstdCompressor().compress(lines))  # two whole frames: all 4,000
    assert cli(["shards", "build", str(src), "--out", str(tmp_path / "out"), "--valid-fraction", "0"]) == 0
    assert json.loads((tmp_path / "out/manifest.json").read_text())["splits"]["train"]["documents"] == 4000


# ------------------------------------------------------------------------------------------------
# Signals
# ------------------------------------------------------------------------------------------------


def _start_training(shards, run_dir):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "megamlm", "train", *tiny(shards, run_dir, "train.steps=100000",
                                                                             "train.save_interval=100000")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and not ((run_dir / "log.jsonl").exists() and len(logged(run_dir)) >= 2):
        time.sleep(0.2)
    assert len(logged(run_dir)) >= 2, proc.communicate(timeout=5)
    return proc


@pytest.mark.slow
def test_ctrl_c_finishes_the_update_saves_and_exits_130(shards, tmp_path):
    proc = _start_training(shards, tmp_path / "run")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "signal received: saved update" in out and "(SIGINT)" in out and "Traceback" not in err
    saved = (tmp_path / "run/checkpoints/latest").read_text()
    assert (tmp_path / f"run/checkpoints/{saved}/complete").exists()
    assert int(saved.removeprefix("step")) == max(logged(tmp_path / "run"))


def test_a_second_ctrl_c_aborts_at_once_with_one_line(monkeypatch, capsys):
    import megamlm.cli
    from megamlm.train.signals import Preemption

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        preemption = Preemption()
        os.kill(os.getpid(), signal.SIGINT)  # the first: a flag, the loop goes on
        assert preemption.signal == "SIGINT"
        with pytest.raises(KeyboardInterrupt):  # the second: at once
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)

    def interrupted(cfg, args):
        raise KeyboardInterrupt

    monkeypatch.setitem(megamlm.cli.VERBS, "train", (interrupted, "", None))
    assert run_cli(capsys, "train") == (130, "megamlm: train: interrupted")


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
                                                "missing checkpoint", "resume another model") \
            else "megamlm: config error: "
        assert one_line(err) == prefix + cases[name][1], name
    ours = ("log.jsonl", "tensorboard/")  # each attempt appends its own (megamlm's) log files
    assert {k: v for k, v in snapshot(run).items() if not k.startswith(ours)} == \
        {k: v for k, v in before.items() if not k.startswith(ours)}
    assert (users / "config.yaml").read_text() == "mine: true\n"


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
