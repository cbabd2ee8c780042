"""train.grad_reduce_in_fp32=false on the flat engine (megamlm/train/flat.py), on two real gloo ranks: the
16-bit gradient buffer is reduced as it is, each rank's share halved first, and only this rank's part of
the sum is copied to fp32. benchmarks/reduce16.py's ring reduction (how the error grows with DP) against
gloo's."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from benchmarks.reduce16 import ring_reduce_scatter
from megamlm.config import ParallelConfig
from megamlm.objectives import get_objective
from megamlm.plan import make_plan
from megamlm.parallel import init_distributed, seed_everything
from megamlm.train.engine import build_engine
from megamlm.train.flat import _reduce_scatter
from tests.multiproc import run_on_ranks
from tests.test_host_sync import _batch, _tokenizer
from tests.variants import variant_config

REDUCTIONS = {"fp32": [], "16-bit": ["train.grad_reduce_in_fp32=false"],
              "16-bit, overlapped": ["train.grad_reduce_in_fp32=false", "train.overlap_grad_reduce=true",
                                     "train.grad_bucket_size=200000"]}


def _one_update(precision):
    """Per reduction: this rank's fp32 gradients after one update at DP=2 (no clipping), the norm, the fp32
    gradient memory, and (16-bit) the expected sum: every rank's 16-bit gradients halved and added in 16 bits."""
    base = variant_config("baseline")
    results = {}
    for name, extra in REDUCTIONS.items():
        cfg = variant_config("baseline", [f"model.vocab_size={len(_tokenizer(base).dictionary)}", "train.engine=flat",
                                          f"train.precision={precision}", "train.micro_batch_size=4",
                                          "train.global_batch_size=8", "optim.clip_grad=0", *extra])
        ctx = init_distributed(cfg.parallel)
        objective = get_objective(cfg)
        seed_everything(1, ctx)
        engine, _, _ = build_engine(objective.build_model(ctx), cfg, ctx, cfg.train.engine_zero_stage(ctx.dp_size))
        weight = 1 + 0.3 * ctx.dp_rank  # other gradients on each rank (the batch is the same)
        engine.backward(objective.loss(engine, _batch(cfg, "packed")).loss_sum.sum() * weight)
        ranks = [torch.empty_like(engine.grads) for _ in range(ctx.dp_size)]
        dist.all_gather(ranks, engine.grads.clone())
        scale = 1.0 if engine.scaler is None else engine.scaler.scale.item()
        engine.step()
        expected = sum(grads / ctx.dp_size for grads in ranks)  # in 16 bits, as gloo adds two ranks
        held = torch.full((engine.grads.numel(),), float("nan"))  # this rank's parts, where they are in the buffer
        for (first, end), master in zip(engine.parts, engine.masters):
            held[first:end] = master.grad
        # parameter by parameter, in model order (the layouts place them differently)
        mine = torch.cat([engine.param_view(held, p).flatten() for p in engine.module.parameters()])
        results[name] = {"grads": [m.grad.clone() for m in engine.masters], "norm": engine.norm.item(), "mine": mine,
                         "fp32 bytes": engine.grads32.numel() * 4, "total": engine.grads.numel(),
                         "planned": make_plan(cfg, 1, 2, "A100", 0.35).memory["gradients"],
                         "held": sum(t.numel() * t.element_size() for t in (engine.grads, engine.grads32)),
                         "expected": [expected[first:end].float() / scale for first, end in engine.parts]}
    return results


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16_bit_reduction_sums_the_16_bit_shares_and_copies_only_this_ranks_part(precision):
    for results in run_on_ranks(_one_update, 2, precision):
        fp32, reduced, overlapped = (results[name] for name in REDUCTIONS)
        # the sum of the halved 16-bit shares, rounded to 16 bits, exactly (the clip is off; fp16: unscaled)
        assert all(torch.equal(a, b) for a, b in zip(reduced["grads"], reduced["expected"]))
        # buckets change which elements a rank holds (its part of each bucket), not their values: each is the
        # same two-term sum
        both = ~overlapped["mine"].isnan() & ~reduced["mine"].isnan()
        assert both.sum() > 1000 and torch.equal(overlapped["mine"][both], reduced["mine"][both])
        # fp32's sum of the same gradients, to 16-bit rounding; not equal (the reduction is really 16-bit)
        a, b = torch.cat(reduced["grads"]), torch.cat(fp32["grads"])
        assert not torch.equal(a, b) and torch.allclose(a, b, rtol=2 ** -7, atol=1e-6)
        assert reduced["norm"] == pytest.approx(fp32["norm"], rel=1e-3)
        # memory: an fp32 copy of this rank's half of the buffer, not of the whole
        assert fp32["fp32 bytes"] == 4 * fp32["total"] and reduced["fp32 bytes"] == 4 * reduced["total"] // 2
        for held in (fp32, reduced):  # `megamlm plan` counts it (without the buffers' padding)
            assert held["planned"] == pytest.approx(held["held"], rel=0.05)
        assert 3 * reduced["held"] == 2 * fp32["held"]  # bf16 grads + fp32 copy: 2 + 4 -> 2 + 4 / 2 bytes


def _gloo_means(dtype):
    """This rank's shares of a 16-bit and an fp32 mean over gloo (the flat engine's two reductions), the
    result on every rank, and every rank's share (the same generator on every rank)."""
    ctx = init_distributed(ParallelConfig())
    generator = torch.Generator().manual_seed(5)
    # magnitudes over six decades, so that the sums round at every addition
    shares = [(torch.randn(3000, generator=generator) * 10.0 ** torch.randint(-3, 3, (3000,), generator=generator))
              .to(dtype) for _ in range(ctx.dp_size)]
    means = {}
    for name, buffer in (("16-bit", shares[ctx.dp_rank] / ctx.dp_size), ("fp32", shares[ctx.dp_rank].float())):
        part = buffer.new_empty(buffer.numel() // ctx.dp_size)
        _reduce_scatter(part, buffer)
        parts = [torch.empty_like(part) for _ in range(ctx.dp_size)]
        dist.all_gather(parts, part)
        means[name] = torch.cat(parts)
    return shares, means


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ranks", [2, 3])
def test_the_benchmarks_ring_reduction_is_gloos_bit_for_bit(ranks, dtype):
    """benchmarks/reduce16.py emulates NCCL's ring (one rounding per addition, chunk c ending at rank c)
    to measure DP = 128 on one CPU; gloo's reduce-scatter takes that order at 2 and 3 ranks."""
    shares, means = run_on_ranks(_gloo_means, ranks, dtype)[0]
    sixteen = ring_reduce_scatter(shares, dtype, divide=True)
    assert torch.equal(sixteen, means["16-bit"])
    assert torch.equal(ring_reduce_scatter(shares, torch.float32), means["fp32"])
    if ranks == 3:  # each addition rounds: not the sum rounded once (at 2 ranks there is one addition)
        assert not torch.equal(sixteen, sum(share.float() / ranks for share in shares).to(dtype))


def test_the_16_bit_reductions_error_grows_with_dp_and_the_fp32_ones_stays_at_fp32_rounding(tmp_path):
    """benchmarks/reduce16.py at toy size (BENCHMARKS.md "Gradient reduction over DP in 16 bits" has DP up
    to 128): real gradients of 8 micro-batches, one per rank."""
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "benchmarks/reduce16.py"), "--dp", "2", "8", "--micro", "2",
                          "--seq-length", "32"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(root), "MASTER_PORT": "29542"})
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {int(line.split("|")[2]): [float(cell) for cell in line.split("|")[3:6]]
            for line in run.stdout.splitlines() if line.startswith("| bf16 |")}
    assert sorted(rows) == [2, 8], run.stdout
    (sixteen2, fp32_2, _), (sixteen8, fp32_8, _) = rows[2], rows[8]
    assert 1e-4 < sixteen2 < sixteen8 < 2e-2 and max(fp32_2, fp32_8) < 1e-7, run.stdout
