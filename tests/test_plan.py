"""`megamlm plan`: the reference arithmetic, refusals, and memory estimates against a real model."""

import pytest
import torch

from megamlm.config import ConfigError, load_config
from megamlm.objectives import MaskedLM
from megamlm.plan import check_budget, make_plan, parameter_count
from tests.variants import CONFIGS, VARIANTS, variant_config


def test_reference_base_alibi_on_one_node_of_8_gpus():
    cfg = load_config([CONFIGS / "pile/base-alibi.yaml"])
    plan = make_plan(cfg, nodes=1, gpus_per_node=8, gpu="A100", mfu=0.35)
    assert (plan.tp, plan.dp, plan.micro, plan.accumulation, plan.global_batch) == (1, 8, 4, 16, 512)
    assert plan.tokens_per_update == 512 * 2048 and plan.updates == 133082
    large = make_plan(load_config([CONFIGS / "pile/large-alibi.yaml"]), 1, 8, "A100", 0.35)
    assert (large.micro, large.accumulation, large.global_batch) == (2, 32, 512)


def test_impossible_plans_are_refused_with_the_reason():
    cfg = load_config([CONFIGS / "pile/base-alibi.yaml"])
    with pytest.raises(ConfigError, match="not divisible by .* 4 × 6"):
        make_plan(cfg, 1, 6, "A100", 0.35)
    with pytest.raises(ConfigError, match=r"tensor_parallel=4 does not divide the world size 6 \(1 node x 6 GPUs\)"):
        make_plan(load_config([CONFIGS / "pile/base-alibi.yaml"], ["parallel.tensor_parallel=4"]), 1, 6, "A100", 0.35)
    with pytest.raises(ConfigError, match="tensor_parallel=5 does not divide model.num_attention_heads=12"):
        load_config([CONFIGS / "pile/base-alibi.yaml"], ["parallel.tensor_parallel=5"])
    big = make_plan(load_config([CONFIGS / "pile/large-alibi.yaml"], ["train.micro_batch_size=32"]),
                    1, 8, "A100", 0.35)
    with pytest.raises(ConfigError, match="over the 40 GiB budget"):
        check_budget(big, 40)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_parameter_estimate_equals_the_built_model(world, variant):
    cfg = variant_config(variant)
    assert parameter_count(cfg) == MaskedLM(cfg.model, world).parameter_count()


def test_memory_estimate_matches_measured_weight_and_optimizer_bytes(world):
    cfg = variant_config("baseline", ["train.zero_stage=0", "train.precision=fp32"])
    model = MaskedLM(cfg.model, world)
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(4, 1000, (2, 16))
    masked = torch.rand(2, 16) < 0.5
    masked[:, 1] = True
    model.loss(model(tokens, masked), tokens[masked]).backward()
    optimizer.step()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    states = sum(t.numel() * t.element_size() for s in optimizer.state.values()
                 for t in s.values() if t.dim() > 0)
    plan = make_plan(cfg, 1, 1, "A100", 0.35)
    # the built model also holds the vocabulary padding rows (1100 -> 1152), which the plan ignores
    assert plan.memory["weights"] == pytest.approx(weights, rel=0.05)
    assert plan.memory["optimizer"] == pytest.approx(states, rel=0.05)
    assert plan.memory["gradients"] == pytest.approx(weights, rel=0.05)


def test_model_flops_per_token_follow_the_documented_formula():
    from megamlm.objectives import get_objective

    def flops_per_token(cfg, seq_length, mask_prob):
        assert cfg.data.mask_prob == mask_prob
        return get_objective(cfg).flops_per_token(seq_length)

    base = load_config([CONFIGS / "model/base.yaml", CONFIGS / "variants/baseline.yaml"])
    # 6·N_body + 12·L·s·h + 6·(h² + h·V)·p, N_body = L·(4h² + 2hf); roberta.base, s = 2048, p = 0.15
    body = 12 * (4 * 768**2 + 2 * 768 * 3072)
    want = 6 * body + 12 * 12 * 2048 * 768 + 6 * (768**2 + 768 * 50265) * 0.15
    assert flops_per_token(base, 2048, 0.15) == pytest.approx(want) == pytest.approx(771_374_361.6)
    clap = load_config([CONFIGS / "model/base.yaml", CONFIGS / "variants/learned-clap.yaml"])
    assert flops_per_token(base, 2048, 0.15) - flops_per_token(clap, 2048, 0.15) == pytest.approx(6 * 768**2 * 0.15)


def test_the_plan_counts_real_tokens_at_the_layouts_fill():
    padded = make_plan(load_config([CONFIGS / "pile/base-alibi.yaml"]), 1, 8, "A100", 0.35)
    packed = make_plan(load_config([CONFIGS / "pile/base-alibi.yaml"], ["data.packing=packed"]), 1, 8, "A100", 0.35)
    # the same token slots and wall time; packing trains 0.99 / 0.745 more real tokens in them
    assert packed.tokens_per_update == padded.tokens_per_update == 512 * 2048
    assert packed.hours == padded.hours and (padded.fill, packed.fill) == (0.745, 0.99)
    assert "~1,038,090 real at fill 0.99" in packed.table(80)
    bigger = make_plan(load_config([CONFIGS / "pile/base-alibi.yaml"], ["data.packing=packed",
                                   "data.tokens_per_micro_batch=16384"]), 1, 8, "A100", 0.35, fill=0.9)
    assert bigger.tokens_per_update == 16384 * 16 * 8 and bigger.fill == 0.9
    with pytest.raises(ConfigError, match="--fill 1.5 must be in"):
        make_plan(load_config([CONFIGS / "pile/base-alibi.yaml"]), 1, 8, "A100", 0.35, fill=1.5)


@pytest.mark.parametrize("engine,compiled", [("deepspeed", False), ("deepspeed", True), ("flat", False),
                                             ("flat", True)])
def test_the_wall_time_assumes_the_loops_measured_mfu_and_says_so(engine, compiled):
    """Without --mfu the plan divides by the MFU megamlm's loop measured for the run's engine (it assumed 35%,
    which no GPU row in BENCHMARKS.md reached, and said neither that nor the GPU); the line names both."""
    from megamlm.objectives import get_objective
    from megamlm.train.flops import LOOP_MFU

    cfg = load_config([CONFIGS / "pile/base-zero-clap.yaml"], [f"train.engine={engine}", f"train.compile={compiled}",
                                                                 "train.precision=bf16"])
    measured = make_plan(cfg, 1, 8, "H100")
    given = make_plan(cfg, 1, 8, "H100", 0.35)
    assert measured.mfu == LOOP_MFU[engine, compiled] and 0.1 < measured.mfu < 0.35
    assert measured.hours == pytest.approx(given.hours * 0.35 / measured.mfu)
    how = f"train.engine={engine}, {'compiled' if compiled else 'eager'}"
    assert (f"days): 8 H100 at MFU {measured.mfu * 100:.3g}% (megamlm's loop as measured for {how}, roberta.base at "
            "2048 on an H200; --mfu)") in measured.table(80)
    assert given.table(80).splitlines()[-1].endswith(": 8 H100 at MFU 35% (--mfu)")
    # base zero-clap's 133,082 updates of 512 x 2048 slots at 35% of 8 x 989 TFLOP/s: 10.8 h
    flops = get_objective(cfg).flops_per_token(2048) * 512 * 2048 * 133082
    assert given.hours == pytest.approx(flops / (0.35 * 8 * 989e12) / 3600) == pytest.approx(10.79, abs=0.01)


@pytest.mark.parametrize("recipe", sorted(p.name for p in (CONFIGS / "pile").glob("*-*.yaml")))
def test_the_fastest_settings_overlay_every_pile_recipe_and_the_plan_assumes_their_measured_mfu(recipe):
    """configs/gpu/fastest.yaml after a Pile recipe: a config that validates, the batch the recipe asks for, and the
    plan's wall time at the MFU those settings measured (29.9%, not the 20% of flat + compiled alone); without one
    of them (micro-batch 8, the sdpa backend) the plan falls back to the engine's."""
    from megamlm.train.flops import FASTEST_LOOP_MFU, LOOP_MFU

    fastest = [CONFIGS / "pile" / recipe, CONFIGS / "gpu/fastest.yaml"]
    cfg = load_config(fastest)
    # how the run executes, nothing of what it trains (the recipe's model, optimizer, 512 rows per update)
    assert set(cfg.changes_since(load_config(fastest[:1]).to_dict())) <= {
        "train.engine", "train.compile", "train.micro_batch_size", "model.attention_backend", "model.bias_activation",
        "data.packing"}
    assert (cfg.train.engine, cfg.model.attention_backend, cfg.data.packing, cfg.train.global_batch_size) == (
        "flat", "triton", "packed", 512)
    plan = make_plan(cfg, 1, 8, "H100")
    assert plan.mfu == FASTEST_LOOP_MFU == 0.299 and (plan.micro, plan.accumulation) == (16, 4)
    assert ("8 H100 at MFU 29.9% (megamlm's loop as measured with configs/gpu/fastest.yaml's settings, roberta.base "
            "at 2048 on an H200; --mfu)") in plan.table(80)
    for missing in ("train.micro_batch_size=8", "model.attention_backend=sdpa"):
        assert make_plan(load_config(fastest, [missing]), 1, 8, "H100").mfu == LOOP_MFU["flat", True]


def test_the_wall_time_of_a_short_run_is_in_minutes_or_seconds():
    cfg = load_config([CONFIGS / "demo.yaml"])
    assert make_plan(cfg, 1, 1, "H100", 0.35).table(80).splitlines()[-1].startswith("wall time     1 s: ")
    assert make_plan(cfg, 1, 1, "V100", 0.001).table(80).splitlines()[-1].startswith("wall time     28 min: ")


def test_activation_memory_counts_the_scores_only_where_a_backend_keeps_them():
    """modernbert-base at 8192 × 2 rows, bf16: 34·h bytes per token per layer (Korthikanti et al.);
    eager also keeps the scores [b, a, s, s] (5·a·s per token); sdpa and eager build a bias per
    pattern that needs one (the 128-window's [b, 1, s, s], shared by the 14 local layers; the global
    layers need none); flex and varlen neither; with checkpointing each layer keeps its input and one
    layer's activations exist at a time."""
    def memory(files, *overrides, tp=1):
        cfg = load_config(files, [*overrides, f"parallel.tensor_parallel={tp}"])
        return make_plan(cfg, 1, 8, "H100", 0.35).memory

    modernbert = ([CONFIGS / "model/modernbert-base.yaml"], "data.seq_length=8192", "train.micro_batch_size=2",
                  "train.precision=bf16")
    layers, h, heads, s, tokens = 22, 768, 12, 8192, 2 * 8192
    flex = memory(*modernbert, "model.attention_backend=flex")
    assert flex["activations"] == layers * tokens * 34 * h and flex["attention bias"] == 0
    assert memory(*modernbert, "model.attention_backend=varlen") == flex
    sdpa = memory(*modernbert)
    assert sdpa["activations"] == flex["activations"] and sdpa["attention bias"] == 2 * s * s * 2
    patterns = load_config(modernbert[0], list(modernbert[1:])).model.layer_attention()
    assert len(patterns) == layers and len(set(patterns)) == 2  # the local layers share one pattern
    eager = memory(*modernbert, "model.attention_backend=eager")
    assert eager["activations"] == layers * tokens * (34 * h + 5 * heads * s)
    assert eager["activations"] > 19 * flex["activations"]  # what the plan said for every backend before
    checkpointed = memory(*modernbert, "model.attention_backend=flex", "train.activation_checkpointing=true")
    assert checkpointed["activations"] == layers * tokens * h * 2 + tokens * 34 * h
    # ALiBi on sdpa: one global pattern, its bias [b, np, s, s] over this rank's 6 heads at TP=2
    alibi = memory([CONFIGS / "pile/base-alibi.yaml"], tp=2)
    assert alibi["attention bias"] == 4 * 6 * 2048 * 2048 * 2


def test_the_plan_says_which_dtype_sums_the_gradients_over_dp_and_when_16_bits_err_more(tmp_path):
    """BENCHMARKS.md "How the 16-bit reduction's error grows with DP": from 32 ranks on, a 16-bit sum errs
    more than the 16-bit backward; the Pile recipe (fp16 on DeepSpeed) reduces in fp16."""
    def row(nodes, *overrides):
        plan = make_plan(load_config([CONFIGS / "pile/base-alibi.yaml"], list(overrides)), nodes, 8, "A100", 0.35)
        return plan.reduction

    assert row(1) == "gradients summed over DP 8 in fp16 (DeepSpeed's communication_data_type)"
    assert row(4).endswith("in fp16 (DeepSpeed's communication_data_type): from DP 32 on, 16-bit sums err more "
                           "than the 16-bit backward (BENCHMARKS.md)")
    flat = ["train.engine=flat", "train.precision=bf16"]
    assert row(16, *flat) == "gradients summed over DP 128 in fp32 (train.grad_reduce_in_fp32)"
    assert "in bf16 (train.grad_reduce_in_fp32): from DP 32 on" in row(16, *flat, "train.grad_reduce_in_fp32=false")
    assert row(16, *flat, "parallel.tensor_parallel=4").startswith("gradients summed over DP 32 in fp32")
    # a user's DeepSpeed JSON decides DeepSpeed's
    user = tmp_path / "ds.json"
    user.write_text('{"communication_data_type": "fp32", "fp16": {"enabled": true}}')
    assert row(16, f"train.deepspeed_config={user}") == \
        "gradients summed over DP 128 in fp32 (DeepSpeed's communication_data_type)"
    one = make_plan(load_config([CONFIGS / "pile/base-alibi.yaml"]), 1, 1, "A100", 0.35)
    assert one.reduction == "none (DP 1)" and "reduction     none (DP 1)" in one.table(80)


def test_the_plan_prints_the_checkpoints_size_on_disk_with_the_one_being_written():
    """`checkpoint_bytes` against real folders: tests/test_checkpoint_disk.py."""
    cfg = load_config([CONFIGS / "pile/base-alibi.yaml"])  # fp16 on DeepSpeed ZeRO-1: 2 + 12 bytes a parameter
    plan = make_plan(cfg, 1, 8, "A100", 0.35)
    assert plan.checkpoint == 14 * parameter_count(cfg) and plan.keep_last == cfg.train.keep_last == 3
    each = plan.checkpoint / 2**30
    assert (f"checkpoints   {each:.2f} GiB each, up to 4 at once (train.keep_last 3 + 1 being written): "
            f"{4 * each:.2f} GiB in the run's checkpoints/") in plan.table(80)
    flat = make_plan(load_config([CONFIGS / "pile/base-alibi.yaml"], ["train.engine=flat", "train.keep_last=1"]),
                     1, 8, "A100", 0.35)
    assert flat.checkpoint == 12 * parameter_count(cfg) and "up to 2 at once" in flat.table(80)
