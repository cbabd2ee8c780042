"""Faults, as a careless or hostile user produces them: nothing a user wrote is ever deleted or
changed, damaged checkpoints and shards are detected and never used. Signals end a run with a
checkpoint: tests/test_signals.py. Every mistake as one line: tests/test_bad_input.py. Run the three
alone: `pytest -m faults` (or `make test-faults`)."""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

from megamlm.cli import main as cli
from megamlm.data.masking import Masker
from megamlm.data.shards import ensure_shards
from megamlm.data.loader import make_loader
from megamlm.data.stream import CorruptShardError, MaskedBatches, ShardSet
from megamlm.data.tokenizer import Tokenizer
from tests.faults_common import (ROOT, WIKITEXT, fault_shards, file_size_limit, finished_run, flip_byte, megamlm,
                                 one_line, run_cli, snapshot, tiny, user_environment, users_folder)
from tests.multiproc import run_on_ranks
from tests.test_train import _train, config, logged

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return fault_shards(tmp_path_factory)


@pytest.fixture(scope="module")
def run(shards, tmp_path_factory):
    return finished_run(shards, tmp_path_factory)


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


def test_a_shard_folder_another_job_finished_meanwhile_is_used_not_refused(shards, tmp_path, monkeypatch, capsys):
    """Two jobs on one data.shards with data.build_from (two rows of gpu.sh's toy run, two rows of an array job)
    build it at once; the one to finish second met "already holds shards" at its swap and failed after the
    work. Now it uses the other's build (builds are deterministic), as if it had been there at its start."""
    import megamlm.data.shards as shard_module

    folder = tmp_path / "shards"
    cfg = config(shards, tmp_path / "r", f"data.shards={folder}", f"data.build_from=[{WIKITEXT}/valid.txt]")
    real_build, other_job = shard_module._build, []

    def the_other_job_finishes_first(options, tokenizer, out, progress):
        manifest = real_build(options, tokenizer, out, progress)
        if not other_job:  # the other job, start to finish (its own _build call goes straight through)
            other_job.append("running")
            other_job[0] = shard_module.build_shards(options, tokenizer, progress=False)
        return manifest

    monkeypatch.setattr(shard_module, "_build", the_other_job_finishes_first)
    assert ensure_shards(cfg.data, Tokenizer.gpt2(), progress=False) == folder
    assert other_job and json.loads((folder / "manifest.json").read_text()) == other_job[0]
    assert f"{folder}: built meanwhile by another process; using that build" in capsys.readouterr().out
    assert not list(tmp_path.glob(".shards.*"))  # both staging folders went away


def test_an_output_that_finds_no_room_is_one_line_and_leaves_nothing(run, tmp_path):
    """A shard build, a conversion and the tokenizer trainers whose files cannot grow past a limit (EFBIG, as a
    full disk's ENOSPC or a spent quota's EDQUOT): one line naming the folder, how far it got and what to do; no
    staging folder and no half-written file left (a half vocab.txt refused the rerun). The lines were the errno
    alone ("[Errno 28] No space left on device") or an internal error (tokenizers' "(os error 28)")."""
    shards_out, hf_out, bpe, wordpiece = (tmp_path / name for name in ("shards", "hf", "bpe", "wordpiece"))
    corpus = WIKITEXT / "valid.txt"
    for args, out, limit in [(["shards", "build", corpus, "--out", shards_out], shards_out, 2**20),
                             (["convert", "--from", "megamlm", "--to", "hf", run / "final", hf_out], hf_out, 2**20),
                             (["shards", "train-bpe", corpus, "--out", bpe, "--vocab-size", 5000], bpe, 2**16),
                             (["shards", "train-wordpiece", corpus, "--out", wordpiece], wordpiece, 2**16)]:
        failed = megamlm(*args, preexec_fn=file_size_limit(limit))
        assert failed.returncode == 2
        assert re.fullmatch(rf"megamlm: {args[0]}: writing {out} stopped after \d+\.\d MiB: File too large; nothing "
                            rf"of it is kept: make room \(free space on its device, a quota, `ulimit -f`\) or write "
                            rf"elsewhere, and run the command again", one_line(failed.stderr)), failed.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


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



@pytest.mark.slow
def test_a_run_killed_before_its_first_logged_update_is_started_over_by_the_same_command(shards, tmp_path):
    """A run that died in its setup or first update (killed; an out-of-memory first update) holds nothing to
    continue: the same command runs again and moves its files aside, where a run that logged an update is
    refused (the test above)."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "megamlm", "train",
                             *tiny(shards, run_dir, "train.steps=100000", "train.save_interval=100000",
                                   "train.log_interval=100000")],
                            cwd=ROOT, env=user_environment(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while time.time() < deadline and '"event": "start"' not in _text(run_dir / "log.jsonl"):
        time.sleep(0.1)
    proc.kill()  # as the out-of-memory killer: no handler runs, nothing is saved
    assert proc.wait(timeout=60) == -signal.SIGKILL, proc.stderr.read()[-3000:]
    proc.stderr.close()
    before = snapshot(run_dir)
    assert {json.loads(line)["step"] for line in _text(run_dir / "log.jsonl").splitlines()} == {0}
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    check = megamlm("train", "--check", *tiny(shards, run_dir, "train.steps=2"))
    assert check.returncode == 0 and "starts over (its run at update 0 is moved aside)" in check.stdout, check.stderr
    assert snapshot(run_dir) == before  # --check writes nothing
    rerun = megamlm("train", *tiny(shards, run_dir, "train.steps=2"))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    (moved,) = tmp_path.glob("run.replaced-*")
    assert snapshot(moved) == before  # the killed run's files, byte for byte
    assert (f"it trained nothing to continue (no update logged, no checkpoint): the run that was in {run_dir} is "
            f"now {moved}") in rerun.stdout
    assert sorted(logged(run_dir)) == [1, 2] and (run_dir / "final").is_dir()


def _text(path) -> str:
    return path.read_text() if path.is_file() else ""

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


def test_shards_inspect_verify_names_the_damage_before_a_run(shards, tmp_path, capsys):
    """`megamlm shards inspect --verify` reads every document back as training does: the intact folder is
    "no damage" (exit 0); damaged documents (a flipped byte each), a damaged index and a shard of the wrong
    size are named, with the counts (exit 1); the summary's numbers are the manifest's."""
    manifest = json.loads((shards / "manifest.json").read_text())
    assert cli(["shards", "inspect", str(shards), "--verify"]) == 0
    out = capsys.readouterr().out
    train, valid = (manifest["splits"][split] for split in ("train", "valid"))
    assert f"verified train: {train['documents']:,} documents read, no damage" in out
    row = next(line for line in out.splitlines() if line.startswith("train "))
    assert row.split()[1:4] == [f"{len(train['shards']):,}", f"{train['documents']:,}", f"{train['tokens']:,}"]
    samples = sum(shard["blocks"]["complete"] for shard in train["shards"])  # each <s> + its tokens, padded
    assert row.split()[-1] == f"{(train['tokens'] + samples) / (samples * manifest['seq_length']):.3f}"
    copy = tmp_path / "shards"
    copy.mkdir()
    for p in shards.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    tar = copy / "train-000000.tar"
    damaged = np.load(tar.with_suffix(".idx.npy"))[::4]
    for offset, size in damaged[:, :2]:
        flip_byte(tar, int(offset + size - 1))
    flip_byte(copy / "valid-000000.idx.npy")
    assert cli(["shards", "inspect", str(copy), "--verify"]) == 1
    out = capsys.readouterr().out
    assert (f"verified train: {train['documents']:,} documents read, {len(damaged):,} damaged documents in 1 "
            f"shard(s), 0 shard(s) left out") in out
    assert f"  {tar}: document 0 fails its checksum (damaged bytes)" in out
    assert f"  ... and {len(damaged) - 5} more in train-000000.tar" in out
    assert f"  {copy}/valid-000000.idx.npy: index differs from the manifest's sha256 (damaged)" in out
    with open(tar, "ab") as f:  # a shard of another size than the manifest's: training leaves it out
        f.write(b"x")
    assert cli(["shards", "inspect", str(copy)]) == 0
    assert len(train["shards"]) > 1 and f"train: training leaves out {tar}\n" in capsys.readouterr().out


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
