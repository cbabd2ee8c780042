"""Per-rank streaming: DP x worker partition, identical TP peers, exact resume in a new process,
masking statistics, corrupt shards and foreign dictionaries."""

import contextlib
import io
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from megamlm.config import ParallelConfig
from megamlm.data.masking import Masker
from megamlm.data.shards import BuildOptions, ShardError, build_shards
from megamlm.data import loader
from megamlm.data.loader import LoaderWorkerError, loader_deaths_explained, make_loader, start_batches
from megamlm.data.stream import MaskedBatches, ShardSet, StreamPosition, advance
from megamlm.data.tokenizer import Dictionary, Tokenizer
from megamlm.parallel import init_distributed
from tests.multiproc import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("stream") / "shards"
    build_shards(BuildOptions([str(ROOT / "data/wikitext-103/valid.txt")], str(out), seq_length=128,
                              long_docs="split", shard_tokens=25_000, valid_fraction=0.0),
                                  Tokenizer.gpt2(), progress=False)
    return out


def masker(seed=1):
    gpt2 = Tokenizer.gpt2()
    return Masker(gpt2.dictionary.mask_id, gpt2.dictionary.ordinary_ids(), seed=seed)


def stream(folder, **kw):
    args = dict(seq_length=128, micro_batch=8, seed=3, shuffle_window=50)
    args.update(kw)
    return MaskedBatches(ShardSet(folder), masker(), **args)


def originals(batch):
    """The unmasked samples of a batch, keyed by their index in the epoch's global order."""
    tokens = batch.inputs.clone()
    tokens[batch.target_mask] = batch.targets
    return {int(i): tuple(row[row != 1].tolist()) for i, row in zip(batch.sample_ids, tokens)}


def _rank_epoch(folder, tensor_parallel, workers):
    ctx = init_distributed(ParallelConfig(tensor_parallel=tensor_parallel))
    # micro batch 1: no partial last batch, so the epoch is partitioned exactly
    s = stream(folder, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size, epochs=1, micro_batch=1)
    seen, batches = {}, []
    for batch in make_loader(s, workers=workers):
        seen.update(originals(batch))
        batches.append(batch)
    return {"seen": seen, "batches": batches[:5], "per_epoch": s.batches_per_epoch(),
            "left_out": s.left_out_per_epoch(), "dp": ctx.dp_size}


def _both_layouts(folder):
    return _rank_epoch(folder, 1, 2), _rank_epoch(folder, 2, 2)


@pytest.mark.slow
def test_data_parallel_ranks_partition_the_epoch_and_tp_peers_agree(shard_dir):
    single = stream(shard_dir, epochs=1, micro_batch=1)
    everything = {}
    for batch in make_loader(single):
        everything.update(originals(batch))
    (dp0, tp0), (dp1, tp1) = run_on_ranks(_both_layouts, 2, shard_dir)
    assert dp0["dp"] == 2 and tp0["dp"] == 1
    # DP=2 x 2 workers each: equal, disjoint halves whose union is the single-rank epoch, except
    # the N mod 2 samples at the end of the epoch's order, which are reported as left out; the
    # samples (and their masks) are the same as in the single-rank run
    assert dp0["per_epoch"] == dp1["per_epoch"] > 500
    assert not dp0["seen"].keys() & dp1["seen"].keys()
    union = {**dp0["seen"], **dp1["seen"]}
    left_out = sorted(everything.keys() - union.keys())
    assert len(left_out) == dp0["left_out"] and union.keys() <= everything.keys()
    assert len(left_out) < 2  # N mod (micro 1 x DP 2)
    assert all(everything[i] == sample for i, sample in union.items())
    # TP=2 (DP=1): both peers get the very same batches
    for a, b in zip(tp0["batches"], tp1["batches"]):
        for key in ("inputs", "target_mask", "targets", "sample_ids"):
            assert torch.equal(getattr(a, key), getattr(b, key))


def _resume_in_new_process(folder, position, count):
    s = stream(folder, position=StreamPosition(**json.loads(position)))
    loader = iter(make_loader(s, workers=2))
    return [next(loader) for _ in range(count)]


@pytest.mark.slow
def test_resume_continues_with_the_next_batch_across_epochs(tmp_path):
    small = tmp_path / "small"
    text = (ROOT / "data/wikitext-103/valid.txt").read_text()[:40_000]
    (tmp_path / "small.txt").write_text(text)
    build_shards(BuildOptions([str(tmp_path / "small.txt")], str(small), seq_length=128,
                              long_docs="split", shard_tokens=3_000, valid_fraction=0.0),
                                  Tokenizer.gpt2(), progress=False)
    s = stream(small)
    per_epoch = s.batches_per_epoch()
    assert 3 <= per_epoch <= 20
    k, m = per_epoch - 2, 6  # stop two batches before the end of epoch 0, resume into epoch 1
    straight = iter(make_loader(s, workers=2))
    straight = [next(straight) for _ in range(k + m)]
    position = StreamPosition()
    for batch in straight[:k]:
        position = advance(position, batch, per_epoch)
    resumed = run_on_ranks(_resume_in_new_process, 1, small, json.dumps(position.state_dict()), m)[0]
    assert [(b.epoch, b.batch) for b in resumed] == [(b.epoch, b.batch) for b in straight[k:]]
    assert {b.epoch for b in resumed} == {0, 1}
    for a, b in zip(straight[k:], resumed):
        for key in ("inputs", "target_mask", "targets", "sample_ids"):
            assert torch.equal(getattr(a, key), getattr(b, key))
    # a new epoch is reshuffled and remasked
    epoch1 = [b for b in straight if b.epoch == 1][0]
    assert not torch.equal(epoch1.sample_ids, straight[0].sample_ids)


class _WorkerProbe(torch.utils.data.IterableDataset):
    """In a loader worker: what sys.excepthook prints for a peer that hung up and for any other error,
    and whether the caller's worker_init_fn ran (ignore_stop_signals: SIGTERM ignored)."""

    def __iter__(self):
        printed = io.StringIO()
        with contextlib.redirect_stderr(printed):
            for err in (ConnectionResetError(104, "Connection reset by peer"), BrokenPipeError(32, "Broken pipe"),
                        ValueError("a worker's own error")):
                sys.excepthook(type(err), err, None)
        yield printed.getvalue(), signal.getsignal(signal.SIGTERM) == signal.SIG_IGN


def test_a_loader_worker_says_nothing_when_the_trainer_hangs_up_on_it():
    """A sibling worker killed (tests/test_train.py's OOM-killer test): torch raises in the trainer in the middle
    of taking a batch's file descriptors from this worker, whose resource-sharer thread then printed a
    ConnectionResetError traceback, at times after the trainer's one-line explanation (1 run in ~3 of a
    200-tensor batch loop). Other errors still print, and the caller's worker_init_fn still runs."""
    from megamlm.train.signals import ignore_stop_signals

    printed, stop_signals_ignored = next(iter(make_loader(_WorkerProbe(), workers=1,
                                                          worker_init_fn=ignore_stop_signals)))
    assert "ValueError: a worker's own error" in printed
    assert "ConnectionResetError" not in printed and "BrokenPipeError" not in printed, printed
    assert stop_signals_ignored


@pytest.mark.parametrize("death", ["DataLoader worker (pid 4242) is killed by signal: Killed.",
                                   "DataLoader worker (pid(s) 4242) exited unexpectedly"])
def test_either_of_torchs_words_for_a_killed_worker_gets_the_out_of_memory_advice(death):
    """Which of the two torch raises for one SIGKILLed worker is a race (its SIGCHLD handler, or the batch
    queue's read failing first); the advice is the same."""
    with pytest.raises(LoaderWorkerError) as raised, loader_deaths_explained(workers=3):
        raise RuntimeError(death)
    assert str(raised.value) == (
        f"a data loader worker died: {death} "
        + ("SIGKILL mostly comes from" if "Killed" in death else
           "A worker that exits without a Python error was most likely killed, mostly by")
        + " the kernel's out-of-memory killer: lower data.loader_workers (now 3) or give the job more host memory."
        " Continue from the last checkpoint with --resume auto")


def test_a_killed_worker_is_raised_by_the_iterator_alone_in_the_words_torchs_check_had_for_it(shard_dir):
    """torch's SIGCHLD handler raised a worker's death wherever the trainer was, and again at every later SIGCHLD:
    one during the first's handling replaced the one-line explanation with an internal error (a suite run's
    OOM-killer test, sessions 38 and 48). With `start_batches` the trainer goes on until its batches stop
    coming; the line still says the signal (torch's iterator only knows "exited unexpectedly")."""
    previous = signal.getsignal(signal.SIGCHLD)
    try:
        batches = start_batches(stream(shard_dir), workers=2)
        next(batches)
        worker = batches._workers[0].pid
        os.kill(worker, signal.SIGKILL)
        time.sleep(2)  # SIGCHLD comes, handled here: torch's handler raised it in this sleep
        with pytest.raises(LoaderWorkerError) as raised, loader_deaths_explained(workers=2):
            for _ in range(100):  # the batches the workers had made, then torch's check after 5 s of waiting
                next(batches)
    finally:
        signal.signal(signal.SIGCHLD, previous)
    assert str(raised.value).startswith(f"a data loader worker died: DataLoader worker (pid {worker}) is killed by "
                                        f"signal: Killed. SIGKILL mostly comes from the kernel's out-of-memory killer")
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert "exited unexpectedly" in str(raised.value.__cause__)


def test_a_batch_handover_cut_by_a_killed_worker_is_the_workers_death(shard_dir):
    """A batch's tensors come over a socket of the worker's: a worker killed during the handover cut it, and
    the trainer got "[Errno 104] Connection reset by peer" while torch still saw the worker alive (the OOM-killer
    test in a suite run, session 71). No SIGCHLD handler here, so only the check behind the error finds it."""
    previous = signal.getsignal(signal.SIGCHLD)
    try:
        batches = start_batches(stream(shard_dir), workers=2)
        next(batches)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        worker = batches._workers[0].pid
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":  # not yet dead
            assert time.monotonic() < deadline
            time.sleep(0.01)
        cut = ConnectionResetError(104, "Connection reset by peer")
        with pytest.raises(LoaderWorkerError) as raised, loader_deaths_explained(workers=2):
            raise cut
    finally:
        signal.signal(signal.SIGCHLD, previous)
    assert str(raised.value).startswith(f"a data loader worker died: DataLoader worker (pid {worker}) is killed by "
                                        f"signal: Killed. SIGKILL mostly comes from the kernel's out-of-memory killer")
    assert raised.value.__cause__ is cut


def test_a_connection_error_where_no_worker_died_is_raised_as_it_is(monkeypatch):
    monkeypatch.setattr(loader, "HANDOVER_DEATH_WAIT_S", 0.1)
    for error in (ConnectionResetError(104, "Connection reset by peer"), EOFError()):
        with pytest.raises(type(error)) as raised, loader_deaths_explained(workers=2):
            raise error
        assert raised.value is error


def test_batches_are_padded_to_a_multiple_of_8_and_start_with_bos(shard_dir):
    batch = next(iter(make_loader(stream(shard_dir))))
    assert batch.inputs.shape[1] % 8 == 0 and batch.inputs.shape[1] <= 128
    assert (batch.inputs[:, 0] == 0).sum() + batch.target_mask[:, 0].sum() >= 8
    assert batch.targets.numel() == batch.target_mask.sum()
    assert torch.equal(batch.target_index, batch.target_mask.flatten().nonzero().squeeze(1))
    assert not batch.target_mask[batch.inputs == 1].any()


def test_pinning_and_moving_a_batch_convert_what_the_model_reads_and_count_its_tokens_on_the_host(shard_dir,
                                                                                                  monkeypatch):
    """On a GPU torch's loader thread pins each batch (`Batch.pin_memory`) and the loop moves it (`Batch.to`):
    both convert the model's tensors, not the host's (sample_ids seed the masking, host_layout is where the
    model reads sizes without waiting for the device), and count the real tokens on the host. Pinning needs
    a GPU: here a copy stands for it."""
    batch = next(iter(make_loader(stream(shard_dir, packing="packed", tokens_per_micro_batch=256))))
    host = ("sample_ids",)
    model = [name for name in ("inputs", "original", "target_index", "targets", "documents", "segments")
             if getattr(batch, name) is not None]
    assert len(model) == 6  # packed: segments too
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda tensor: tensor.clone())
    for converted, moved in ((batch.pin_memory(), False), (batch.to(torch.device("meta")), True)):
        for name in model:
            tensor = getattr(converted, name)
            assert tensor is not getattr(batch, name)
            assert tensor.is_meta if moved else torch.equal(tensor, getattr(batch, name))
        assert all(getattr(converted, name) is getattr(batch, name) for name in host)
        assert converted.host_layout is batch.host_layout and not converted.host_layout[0].is_meta
        assert converted.real == batch.real_tokens() == int((batch.documents >= 0).sum()) > 0


def test_compiled_runs_get_one_batch_width_with_the_same_content(shard_dir):
    from megamlm.config import load_config
    from megamlm.train.run_data import _pad_multiple

    def widths_and_samples(pad_multiple):
        # one sample per batch: the width follows each sample's length
        batches = [b for _, b in zip(range(12), stream(shard_dir, micro_batch=1, pad_multiple=pad_multiple))]
        return {b.inputs.shape[1] for b in batches}, [originals(b) for b in batches]

    dynamic, samples = widths_and_samples(8)
    static, static_samples = widths_and_samples(128)
    assert len(dynamic) > 1 and static == {128}
    assert static_samples == samples  # padding only: same samples, same masks
    demo = ROOT / "configs/demo.yaml"
    assert _pad_multiple(load_config([demo])) == 8
    for override in ("train.compile=true", "model.attention_backend=flex"):
        assert _pad_multiple(load_config([demo], [override])) == 128


def test_masking_statistics_follow_the_reference():
    m = masker()
    rng = np.random.default_rng(0)
    total = targeted = masked = randomized = kept = 0
    ordinary = set(m.random_ids.tolist())
    for index in range(4000):
        tokens = rng.integers(4, 50260, size=int(rng.integers(20, 128)))
        inputs, target = m(tokens, epoch=0, index=index)
        total += len(tokens)
        targeted += target.sum()
        masked += (inputs[target] == m.mask_id).sum()
        same = inputs[target] == tokens[target]
        kept += same.sum()
        randomized += (~same & (inputs[target] != m.mask_id)).sum()
        assert set(inputs[target & (inputs != m.mask_id)].tolist()) <= ordinary
        assert np.array_equal(inputs[~target], tokens[~target])
    assert abs(targeted / total - 0.15) < 0.003
    assert targeted == masked + randomized + kept
    assert abs(masked / targeted - 0.8) < 0.01
    assert abs(randomized / targeted - 0.1) < 0.01 and abs(kept / targeted - 0.1) < 0.01


def test_mask_rate_uses_probabilistic_rounding_and_is_seeded():
    m = masker()
    counts = [m(np.arange(4, 14), epoch=0, index=i)[1].sum() for i in range(5000)]
    assert abs(np.mean(counts) - 1.5) < 0.05  # 15% of 10 tokens: 1 or 2, 1.5 on average
    tokens = np.arange(4, 104)
    first = m(tokens, 2, 7)
    assert all(np.array_equal(a, b) for a, b in zip(first, m(tokens, 2, 7)))
    assert not np.array_equal(first[1], m(tokens, 3, 7)[1])
    zero = Masker(50262, Tokenizer.gpt2(zero_clap=True).dictionary.ordinary_ids())
    inputs, target = zero(tokens, 0, 0)
    assert (inputs[target] == 50262).sum() > 0


def test_truncated_shard_is_skipped_and_garbage_is_replaced(shard_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(shard_dir, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    names = [s["name"] for s in manifest["splits"]["train"]["shards"]]
    with open(copy / names[0], "r+b") as f:
        f.truncate(5000)
    index = np.load(copy / names[1].replace(".tar", ".idx.npy"))
    with open(copy / names[1], "r+b") as f:  # garbage over every document of the second shard
        for offset, size, *_ in index:
            f.seek(offset)
            f.write(b"\x93NUMPY garbage" + b"\xff" * (size - 14))
    with pytest.warns(UserWarning, match=f"skipping shard .*{names[0]}: truncated"):
        shards = ShardSet(copy)
    assert shards.excluded == [str(copy / names[0])]
    s = MaskedBatches(shards, masker(), seq_length=128, micro_batch=8, seed=3, epochs=1)
    corrupt = 0
    with pytest.warns(UserWarning, match="unreadable"):
        for batch in make_loader(s):
            corrupt += batch.corrupt
            assert batch.inputs.shape[0] == 8
    assert corrupt > 0


def test_foreign_dictionary_and_unfinished_builds_are_refused(shard_dir, tmp_path):
    (tmp_path / "dict.txt").write_text("".join(f"{i} 1\n" for i in range(300)))
    foreign = Dictionary.load(tmp_path / "dict.txt")
    with pytest.raises(ShardError, match="built with another dictionary .* rebuild the shards"):
        ShardSet(shard_dir, dictionary_sha256=foreign.sha256)
    for zero_clap in (False, True):  # the zero-clap dictionary reads GPT-2 shards
        ShardSet(shard_dir, dictionary_sha256=Tokenizer.gpt2(zero_clap=zero_clap).dictionary.sha256)
    with pytest.raises(ShardError, match="manifest.json not found"):
        ShardSet(tmp_path)
    with pytest.raises(ShardError, match="has no 'valid' split; it has: train"):
        ShardSet(shard_dir, "valid")


def test_shards_too_small_for_one_update_are_refused_in_the_streams_unit(shard_dir):
    """An epoch must hold one whole update: of samples (padded), or of packed rows, which are fewer."""
    samples = int(ShardSet(shard_dir).block_counts(128, "complete").sum())
    fits = samples // 8  # micro-batches of 8 samples: this many updates' worth at DP 1, accumulation 1
    assert stream(shard_dir, accumulation=fits).batches_per_epoch() == fits
    accumulation = fits // 2 + 1  # at DP 2: an update of more samples than the epoch holds
    with pytest.raises(ShardError) as refused:
        stream(shard_dir, accumulation=accumulation, dp_size=2)
    assert str(refused.value) == (f"{shard_dir}: {samples} samples of length 128 do not fill one update of "
                                  f"{8 * accumulation * 2} sequences (micro 8 x accumulation {accumulation} x DP 2)")
    rows = len(stream(shard_dir, packing="packed").bins(0))
    assert rows < samples  # two samples or more in most rows of 8 x 128 tokens
    assert stream(shard_dir, packing="packed", accumulation=rows).batches_per_epoch() == rows
    with pytest.raises(ShardError) as refused:  # enough samples, too few rows
        stream(shard_dir, packing="packed", accumulation=rows + 1)
    assert str(refused.value) == (f"{shard_dir}: {samples} samples of length 128 do not fill one update of "
                                  f"{rows + 1} packed micro-batches of 1024 tokens (micro 1 x accumulation {rows + 1} "
                                  f"x DP 1)")
