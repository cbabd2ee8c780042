"""TP=2 equals TP=1: logits, loss and (gathered) gradients, for every variant, on real gloo ranks.

One 2-process job computes every variant first at TP=1 (DP=2: both ranks hold the whole model),
then at TP=2, from the same seed; the comparison runs in the test process.
"""

import torch

from megamlm.config import ParallelConfig
from megamlm.model.reshard import full_state_dict
from megamlm.objectives import MaskedLM
from megamlm.parallel import init_distributed, seed_everything
from tests.multiproc import run_on_ranks
from tests.test_model import batch
from tests.variants import VARIANTS, variant_config

# (name, extra overrides, train mode): hidden dropout is drawn from the default stream, identical on
# TP peers and at any TP degree, so it must not break the equality either
CASES = [(name, [], False) for name in sorted(VARIANTS)] + [
    ("baseline", ["model.hidden_dropout=0.1"], True),
]


def _run_all_cases():
    import torch.distributed as dist

    out = {}
    for tp in (1, 2):
        ctx = init_distributed(ParallelConfig(tensor_parallel=tp))
        for name, extra, train in CASES:
            cfg = variant_config(name, extra)
            seed_everything(5, ctx)
            model = MaskedLM(cfg.model, ctx, seed=11).train(train)
            tokens, masked = batch(cfg.model.vocab_size)
            tokens[:, 5] = 2  # a separator: BERT's token type 1 follows
            logits_local = model(tokens, masked)
            loss = model.loss(logits_local, tokens[masked])
            loss.backward()
            grads = full_state_dict(model, grads=True)
            # parameters replicated across TP ranks must receive identical gradients on each peer
            replicated_gap = 0.0
            for param in model.parameters():
                if not getattr(param, "tensor_model_parallel", False) and ctx.tp_size > 1:
                    peers = [torch.empty_like(param.grad) for _ in range(ctx.tp_size)]
                    dist.all_gather(peers, param.grad, group=ctx.tp_group)
                    replicated_gap = max(replicated_gap, (peers[0] - peers[1]).abs().max().item())
            out[(tp, name, train)] = {
                "logits": model.gather_logits(logits_local).detach(),
                "loss": loss.detach(),
                "grads": grads,
                "replicated_gap": replicated_gap,
            }
    return out


def test_tp2_equals_tp1_for_every_variant():
    rank0, rank1 = run_on_ranks(_run_all_cases, 2)
    failures = []
    for name, _, train in CASES:
        one, two = rank0[(1, name, train)], rank0[(2, name, train)]
        errors = {
            "logits": (one["logits"] - two["logits"]).abs().max().item(),
            "loss": (one["loss"] - two["loss"]).abs().item(),
            "grads": max((one["grads"][k] - two["grads"][k]).abs().max().item() for k in one["grads"]),
            "replicated grads across TP peers": two["replicated_gap"],
            "rank1 vs rank0 logits": (rank1[(2, name, train)]["logits"] - two["logits"]).abs().max().item(),
        }
        assert one["grads"].keys() == two["grads"].keys()
        # every parameter is connected to the loss
        assert all(g.abs().sum() > 0 for g in two["grads"].values()), name
        for what, err in errors.items():
            if not err <= 1e-5:
                failures.append(f"{name} (train={train}): {what} differ by {err:.3g}")
    assert not failures, "\n".join(failures)


def _grads_with_and_without_recompute():
    from megamlm.train.layers import apply_activation_checkpointing

    ctx = init_distributed(ParallelConfig(tensor_parallel=2))
    cfg = variant_config("alibi", ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"])
    out = {}
    for recompute in (False, True):
        seed_everything(5, ctx)
        model = MaskedLM(cfg.model, ctx, seed=11).train()
        if recompute:
            apply_activation_checkpointing(model)
        tokens, masked = batch(cfg.model.vocab_size)
        for _ in range(2):  # two steps: the replayed streams must also leave the right state behind
            model.loss(model(tokens, masked), tokens[masked]).backward()
        out[recompute] = {name: p.grad.clone() for name, p in model.named_parameters()}
        out[recompute]["names"] = sorted(n for n, _ in model.named_parameters())
    return out


def test_activation_checkpointing_recomputes_the_same_dropout_masks_at_tp2():
    """With hidden and attention dropout on, recomputed layers give bit-identical gradients."""
    for rank in run_on_ranks(_grads_with_and_without_recompute, 2):
        plain, recomputed = rank[False], rank[True]
        assert plain.pop("names") == recomputed.pop("names")  # parameter names unchanged
        for name, grad in plain.items():
            assert torch.equal(grad, recomputed[name]), name


def _threads_after_repeated_inits(calls: int) -> list[int]:
    import os

    counts = []
    for _ in range(calls):
        init_distributed(ParallelConfig(tensor_parallel=2))
        counts.append(len(os.listdir(f"/proc/{os.getpid()}/task")))
    return counts


def test_repeated_init_keeps_the_groups_and_starts_no_threads():
    """Every in-process command (train, eval, convert, glue) calls init_distributed; re-creating
    megatron's gloo groups each time left ~50 threads behind per call, some spinning (the suite ran
    45 minutes instead of 25). The same layout now keeps its groups."""
    for counts in run_on_ranks(_threads_after_repeated_inits, 2, 4):
        assert counts[1:] == counts[:1] * 3, counts
