"""train.overlap_grad_reduce on the flat engine (megamlm/train/flat.py), on two real gloo ranks: the
buckets' reduce-scatters start inside the backward, before it reaches the embedding, and the updates are
the one-collective engine's: the same losses bit for bit without clipping, the same norms with it, and
checkpoints that resume across the two layouts; at TP=2 x DP=2 (four ranks) too."""

import shutil

import pytest
import torch

from megamlm.objectives import get_objective
from megamlm.parallel import init_distributed, seed_everything
from megamlm.train.engine import build_engine
from tests.multiproc import run_on_ranks
from tests.test_host_sync import _batch, _tokenizer
from tests.test_train import _train, _zero_runs, config, logged, tiny_shards
from tests.variants import variant_config

# ~3.3M parameters in buckets of 200k elements (rounded to whole rows on both ranks): 18 reduce-scatters
OVERLAP = ["train.overlap_grad_reduce=true", "train.grad_bucket_size=200000"]
COMMON = ["train.engine=flat", "train.global_batch_size=16", "train.steps=4", "train.save_interval=2",
          "model.hidden_dropout=0", "model.attention_dropout=0"]
SETTINGS = {  # name: overrides; accumulation 2 on two ranks
    "fp32": ["optim.clip_grad=0"],
    "bf16-fp32-sums": ["optim.clip_grad=0", "train.precision=bf16", "train.fp32_grad_accumulation=true"],
    "bf16-clipped": ["optim.clip_grad=0.5", "train.precision=bf16"],
}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return tiny_shards(tmp_path_factory, "overlap")


def _buckets_launched_before_the_embedding(overrides):
    """One update's backward at DP=2 (no accumulation): how many buckets were in flight when the backward
    reached the word embedding (the largest parameter, the last gradient), and after it; of how many."""
    base = variant_config("baseline")
    cfg = variant_config("baseline", [f"model.vocab_size={len(_tokenizer(base).dictionary)}",
                                      "train.micro_batch_size=4", "train.global_batch_size=8", *overrides])
    ctx = init_distributed(cfg.parallel)
    objective = get_objective(cfg)
    seed_everything(1, ctx)
    engine, _, _ = build_engine(objective.build_model(ctx), cfg, ctx, cfg.train.engine_zero_stage(ctx.dp_size))
    embedding = max(engine.module.parameters(), key=torch.Tensor.numel)
    at_embedding = []
    embedding.register_hook(lambda grad: at_embedding.append(engine.launches.launched))
    engine.backward(objective.loss(engine, _batch(cfg, "padded")).loss_sum.sum())
    after = engine.launches.launched
    engine.step()
    return at_embedding, after, len(engine.buckets), engine.launches.launched


# TP=2: each shard holds about half the parameters, in buckets of half the size
@pytest.mark.parametrize("ranks, layout", [
    (2, []), (4, ["parallel.tensor_parallel=2", "train.grad_bucket_size=100000"])], ids=["dp2", "tp2-dp2"])
def test_the_reduce_scatters_start_while_the_backward_runs(ranks, layout):
    (at_embedding, after, buckets, reset), *_ = run_on_ranks(
        _buckets_launched_before_the_embedding, ranks, ["train.engine=flat", "train.precision=bf16", *OVERLAP, *layout])
    assert buckets > 10 and len(at_embedding) == 1
    # the layers' and the head's buckets were on their way; the embedding's waited for its gradient
    assert 0 < at_embedding[0] < buckets and after == buckets and reset == 0, (at_embedding, buckets)


@pytest.mark.slow
def test_overlapped_reduction_trains_the_one_collective_losses_and_resumes_across_them(shards, tmp_path):
    cfgs = {(name, overlap): config(shards, tmp_path / f"{name}-{overlap}", *COMMON, *extra,
                                    *(OVERLAP if overlap else []))
            for name, extra in SETTINGS.items() for overlap in (False, True)}
    runs = dict(zip(cfgs, run_on_ranks(_zero_runs, 2, list(cfgs.values()))[0]))
    for name in SETTINGS:
        plain, overlapped = runs[name, False]["losses"], runs[name, True]["losses"]
        assert len(plain) == 4 and plain[-1] < plain[0], name
        if name != "bf16-clipped":  # the reductions' sums are the same; so are the updates
            assert overlapped == plain, name
        else:  # the norm sums its rows in another order: the clip factors differ in the last bits
            norms = [logged(tmp_path / f"{name}-{o}", key="grad_norm") for o in (False, True)]
            assert max(abs(norms[1][s] - norms[0][s]) / norms[0][s] for s in norms[0]) < 1e-6
            assert max(abs(a - b) for a, b in zip(overlapped, plain)) < 1e-5

    # each layout's update-2 checkpoint resumed on the other: the files do not depend on the buckets
    resumed = {}
    for overlap in (False, True):
        run_dir = tmp_path / f"resumed-{overlap}"
        shutil.copytree(tmp_path / f"fp32-{not overlap}", run_dir)
        resumed[overlap] = config(shards, run_dir, *COMMON, *SETTINGS["fp32"], *(OVERLAP if overlap else []))
    results = run_on_ranks(_resume_at_2, 2, list(resumed.values()))[0]
    for losses in results:
        assert losses == runs["fp32", False]["losses"][2:]


def _resume_at_2(cfgs):
    return [_train(cfg, resume="step00000002")["losses"] for cfg in cfgs]


@pytest.mark.slow
def test_overlapped_and_16_bit_reductions_at_tp2_dp2_train_the_one_collective_losses(shards, tmp_path):
    """Four ranks, TP=2 x DP=2: the buckets reduce over the data-parallel group only, each TP shard's own
    buckets; overlapping them changes no sum (two terms), in fp32 or in 16 bits."""
    bf16 = ["optim.clip_grad=0", "train.precision=bf16"]
    settings = {"fp32": ["optim.clip_grad=0"], "bf16": bf16, "bf16-16bit": [*bf16, "train.grad_reduce_in_fp32=false"]}
    layout = ["parallel.tensor_parallel=2", "train.steps=3"]
    runs = [("fp32", False), ("fp32", True), ("bf16", False), ("bf16-16bit", False), ("bf16-16bit", True)]
    cfgs = {(name, overlap): config(shards, tmp_path / f"{name}-{overlap}", *COMMON, *layout, *settings[name],
                                    *(OVERLAP if overlap else []))
            for name, overlap in runs}
    runs = dict(zip(cfgs, run_on_ranks(_zero_runs, 4, list(cfgs.values()))[0]))
    for name in ("fp32", "bf16-16bit"):
        plain, overlapped = runs[name, False]["losses"], runs[name, True]["losses"]
        assert len(plain) == 3 and plain[-1] < plain[0], name
        assert overlapped == plain, name
    # the 16-bit sums really are 16-bit (other losses than bf16 with fp32 sums), and close to them
    summed32, summed16 = runs["bf16", False]["losses"], runs["bf16-16bit", False]["losses"]
    assert summed32 != summed16 and max(abs(a - b) for a, b in zip(summed32, summed16)) < 0.01, (summed32, summed16)
