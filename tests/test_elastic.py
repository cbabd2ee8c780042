"""Elastic resume on real gloo ranks: a checkpoint written at one layout (TP, DP, ZeRO stage,
accumulation) continues at another with the uninterrupted run's losses, gradient norms and samples."""

import shutil

import pytest
import torch

from megamlm.config import ConfigError
from megamlm.data.stream import MaskedBatches, ShardSet, StreamPosition
from megamlm.data.updates import UpdateShape
from megamlm.data.tokenizer import Tokenizer
from megamlm.objectives import get_objective
from megamlm.train.elastic import Layout, convert_position
from tests.multiproc import run_on_ranks
from tests.test_train import _zero_runs, config, logged, tiny_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return tiny_shards(tmp_path_factory, "elastic")


def _layout(tp=1, dp=1, stage=1, micro=4, accumulation=1, packed=False):
    return Layout(tp, stage, UpdateShape(packed, micro, 64, accumulation, dp, 256))


def _update_ids(shards, layout: Layout, position: StreamPosition, updates: int, packing="padded"):
    """The sample ids of the next `updates` updates at `layout`, over every DP rank and micro-batch."""
    cfg = config(shards, "unused", f"data.packing={packing}", "data.tokens_per_micro_batch=256")
    tokenizer = Tokenizer.load(cfg.data.tokenizer)
    corruption = get_objective(cfg).corruption(tokenizer, 1)
    streams = [iter(MaskedBatches(ShardSet(shards, "train"), corruption, seq_length=64,
                                  micro_batch=layout.update.micro_batch, accumulation=layout.update.accumulation,
                                  dp_rank=rank, dp_size=layout.dp, position=position, packing=packing,
                                  tokens_per_micro_batch=256, shuffle_window=64))
               for rank in range(layout.dp)]
    out = []
    for _ in range(updates):
        ids = [next(s).sample_ids for s in streams for _ in range(layout.update.accumulation)]
        out.append(sorted(torch.cat(ids).tolist()))
    return out


@pytest.mark.parametrize("packing", ["padded", "packed"])
def test_converted_position_gives_the_next_updates_the_uninterrupted_samples(shards, packing):
    packed = packing == "packed"
    written = _layout(dp=2, accumulation=1 if not packed else 2, packed=packed)
    at = StreamPosition(0, 3 * written.update.accumulation)  # after update 3
    expected = _update_ids(shards, written, at, 2, packing)
    runnings = [_layout(dp=1, accumulation=2 if not packed else 4, packed=packed),
                _layout(dp=4, accumulation=1, packed=packed) if packed else _layout(dp=1, micro=8, packed=packed)]
    for running in runnings:
        position, note = convert_position(at, written, running, allow_batch_change=False)
        assert note is None
        assert _update_ids(shards, running, position, 2, packing) == expected, running
    assert expected[0] != expected[1]


def test_a_changed_global_batch_is_refused_unless_allowed_and_then_counted_in_samples():
    written, running = _layout(dp=2), _layout(dp=1)  # 8 -> 4 sequences
    with pytest.raises(ConfigError, match=r"global batch of 8 sequences .*train.global_batch_size=8"):
        convert_position(StreamPosition(1, 3), written, running, allow_batch_change=False)
    position, note = convert_position(StreamPosition(1, 3), written, running, allow_batch_change=True)
    assert position == StreamPosition(1, 6) and "24 sequences into epoch 1 = update 6" in note
    position, note = convert_position(StreamPosition(0, 3), _layout(dp=1), _layout(dp=2), allow_batch_change=True)
    assert position == StreamPosition(0, 1) and "(4 sequences are seen again)" in note
    with pytest.raises(ConfigError, match="data.packing"):
        convert_position(StreamPosition(0, 2), _layout(), _layout(packed=True), allow_batch_change=True)


# ---- training: the uninterrupted run vs resumed at another layout -----------------------------------

COMMON = ["train.global_batch_size=8", "train.steps=8", "train.save_interval=4",
          "model.hidden_dropout=0", "model.attention_dropout=0", "optim.clip_grad=1.0"]
LAYOUTS = {
    "dp2-zero1": ["train.zero_stage=1"],
    "dp2-zero2": ["train.zero_stage=2"],
    "dp2-zero3": ["train.zero_stage=3"],
    "tp2": ["parallel.tensor_parallel=2"],
    "dp2-micro2": ["train.zero_stage=1", "train.micro_batch_size=2"],  # accumulation 2
    "dp1": [],
}


def _resume_runs(cfgs, allow_batch_change=False):
    from megamlm.train.loop import train

    return [train(cfg, resume="step00000004", allow_batch_change=allow_batch_change)["losses"] for cfg in cfgs]


@pytest.fixture(scope="module")
def straight(shards, tmp_path_factory):
    """Uninterrupted 8-update runs of every layout (checkpoints at 4 and 8): (their folder, losses)."""
    root = tmp_path_factory.mktemp("straight")
    on_two = ["dp2-zero1", "dp2-zero2", "dp2-zero3", "tp2", "dp2-micro2"]
    runs = dict(zip(on_two, run_on_ranks(_zero_runs, 2, [config(shards, root / s, *COMMON, *LAYOUTS[s])
                                                           for s in on_two])[0]))
    runs["dp1"] = run_on_ranks(_zero_runs, 1, [config(shards, root / "dp1", *COMMON)])[0][0]
    return root, runs


@pytest.mark.slow
def test_resume_on_another_layout_continues_the_uninterrupted_run(shards, straight, tmp_path):
    """Losses after the resume equal the uninterrupted run's to fp32 rounding (the layouts sum the
    global batch in another order: DP all-reduce vs accumulation, TP's split matmuls; bit-exact when
    only the ZeRO stage changes). Gradient norms are compared with an uninterrupted run *of the target
    layout*: layouts report norms that already differ before any resume (DeepSpeed's ZeRO-1/2 norm vs
    the exact L2 of the stage-0 path: ~1e-4 relative; TP's split sums ~3e-5)."""
    root, straight = straight
    # (source, target): DP and accumulation, TP, ZeRO stage, TP back to 1, micro-batch only
    moves = [("dp2-zero1", "dp1"), ("dp2-zero1", "tp2"), ("dp2-zero2", "dp2-zero1"), ("tp2", "dp1"),
             ("tp2", "dp2-zero1"), ("dp2-zero3", "dp1"), ("dp2-zero1", "dp2-zero3"), ("dp2-zero1", "dp2-micro2")]
    cfgs = {}
    for source, target in moves:
        run_dir = tmp_path / f"{source}-to-{target}"
        shutil.copytree(root / source, run_dir)
        cfgs[source, target] = config(shards, run_dir, *COMMON, *LAYOUTS[target])
    to_one = [m for m in moves if m[1] == "dp1"]
    to_two = [m for m in moves if m[1] != "dp1"]
    resumed = dict(zip(to_one, run_on_ranks(_resume_runs, 1, [cfgs[m] for m in to_one])[0]))
    resumed.update(zip(to_two, run_on_ranks(_resume_runs, 2, [cfgs[m] for m in to_two])[0]))
    for (source, target), losses in resumed.items():
        full = straight[source]["losses"]
        assert len(full) == 8 and len(losses) == 4
        loss_diff = max(abs(a - b) for a, b in zip(losses, full[4:]))
        norms, target_norms = (logged(folder, key="grad_norm") for folder in (tmp_path / f"{source}-to-{target}",
                                                                             root / target))
        norm_diff = max(abs(norms[s] - target_norms[s]) / target_norms[s] for s in range(5, 9))
        print(f"{source} -> {target}: max |Δloss| {loss_diff:.2e} (loss ~{losses[0]:.1f}), "
              f"max rel Δ grad norm {norm_diff:.2e}")
        assert loss_diff < 5e-6 and norm_diff < 1e-5, (source, target, loss_diff, norm_diff)
        if LAYOUTS[source] == ["train.zero_stage=2"]:  # only the ZeRO stage changes: nothing is re-summed
            assert loss_diff == 0
        line = logged(tmp_path / f"{source}-to-{target}", "resume", "message")[4]
        if target == "dp2-micro2":  # the same shards: DeepSpeed's own loader, the position converted
            assert line.startswith("resumed from "), line
        else:
            assert line.startswith("resumed update 4 written at "), line



@pytest.mark.slow
def test_another_global_batch_continues_from_the_samples_consumed_when_allowed(shards, straight, tmp_path):
    root, _ = straight
    shutil.copytree(root / "dp2-zero1", tmp_path / "run")  # global batch 8, checkpoint after update 4
    cfg = config(shards, tmp_path / "run", *COMMON[1:], "train.global_batch_size=12", "train.steps=6")
    (losses,) = run_on_ranks(_resume_runs, 1, [cfg], True)[0]
    assert len(losses) == 2
    line = logged(tmp_path / "run", "resume", "message")[4]
    # 4 updates x 8 = 32 sequences = 2 updates of 12 (+ 8 seen again): the step counter stays at 4
    assert "global batch 8 -> 12 sequences: data position 32 sequences into epoch 0 = update 2 of the new " \
           "batch (8 sequences are seen again)" in line, line


# ---- mixed precision: what the engine holds after the load is exactly the checkpoint's state --------

def _load_and_compare(cfg, tag: str) -> dict:
    """Build the run's engine, load checkpoint `tag` (resharded), and compare every master weight and
    moment the engine now holds (gathered to full form) with the checkpoint's."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from megamlm.model.reshard import to_full
    from megamlm.parallel import init_distributed
    from megamlm.train.checkpoint import Checkpoints
    from megamlm.train.checkpoint_folders import written_zero_stage
    from megamlm.train.elastic import KINDS, _stage0_masters, read_full_state, written_layout
    from megamlm.train.engine import build_engine

    ctx = init_distributed(cfg.parallel)
    model = get_objective(cfg).build_model(ctx)
    checkpoints = Checkpoints(cfg.train.run_dir, keep_last=3)
    engine, optimizer, schedule = build_engine(model, cfg, ctx, checkpoints.resume_stage(tag, cfg, ctx.dp_size))
    state = checkpoints.load(engine, schedule, tag, cfg, ctx)
    base = getattr(optimizer, "optimizer", optimizer)
    masters = _stage0_masters(engine, optimizer, base)
    meta = checkpoints.meta(tag)
    names = [name for name, _ in engine.module.named_parameters()]
    expected = read_full_state(checkpoints.root / tag, written_layout(meta, written_zero_stage(meta)), names, cfg)
    worst = 0.0
    for name, param in engine.module.named_parameters():
        if masters is not None:
            held = {"fp32": masters[id(param)], **{k: base.state[masters[id(param)]][k] for k in KINDS[1:]}}
        else:
            held = {"fp32": safe_get_full_fp32_param(param),
                    **{k: safe_get_full_optimizer_state(param, k) for k in KINDS[1:]}}
        for kind, local in held.items():
            full = to_full(engine.module, param, local.view(getattr(param, "ds_shape", param.shape)))
            worst = max(worst, (full - expected.full(name, kind)).abs().max().item())
    step = next(iter(base.state[t] for t in base.state if base.state[t]))["step"].item()
    return {"worst": worst, "optimizer": type(optimizer).__name__, "resharded": state.resharded,
            "step": step, "source_step": expected.optimizer_step, "lr": schedule.get_last_lr()[0],
            "global_steps": engine.global_steps}


@pytest.mark.slow
def test_bf16_optimizers_receive_the_checkpoints_exact_master_weights_and_moments(shards, tmp_path):
    bf16 = ["train.precision=bf16", "train.steps=2", "train.save_interval=1", "train.global_batch_size=8"]
    sources = {"zero1": ["train.zero_stage=1"], "zero0": ["train.zero_stage=0"], "zero3": ["train.zero_stage=3"]}
    straight = run_on_ranks(_zero_runs, 2, [config(shards, tmp_path / s, *bf16, *o) for s, o in sources.items()])[0]
    moves = {  # target: (source, overrides)
        "zero1-to-tp2": ("zero1", ["parallel.tensor_parallel=2", "train.zero_stage=1"]),
        "zero1-to-zero0": ("zero1", ["train.zero_stage=0"]),
        "zero1-to-zero3": ("zero1", ["train.zero_stage=3"]),
        "zero0-to-tp2": ("zero0", ["parallel.tensor_parallel=2", "train.zero_stage=1"]),
        "zero1-to-dp1": ("zero1", ["train.zero_stage=1"]),
        "zero3-to-dp1": ("zero3", ["train.zero_stage=1"]),
    }
    cfgs = {}
    for target, (source, overrides) in moves.items():
        shutil.copytree(tmp_path / source, tmp_path / target)
        cfgs[target] = config(shards, tmp_path / target, *bf16, *overrides)
    results = {t: run_on_ranks(_load_and_compare, 1 if t.endswith("dp1") else 2, cfgs[t], "step00000001")[0]
               for t in moves}
    for target, result in results.items():
        print(target, result)
        assert result["worst"] == 0.0, (target, result)
        # AdamW's count as the source kept it (DeepSpeed's unfused bf16 optimizer counts one extra step
        # at start): the next update's bias correction is the uninterrupted run's
        assert result["step"] == result["source_step"] == (2 if target.startswith("zero0") else 1), result
        assert result["global_steps"] == 1 and result["resharded"], (target, result)
    assert {r["optimizer"] for r in results.values()} == {"DeepSpeedZeroOptimizer", "FP16_UnfusedOptimizer",
                                                            "DeepSpeedZeroOptimizer_Stage3"}
    assert len(straight) == 3
