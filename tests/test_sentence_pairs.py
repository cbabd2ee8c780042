"""NSP and SOP (issue 18): pairs are seeded by (seed, epoch, sample) and resume exactly, never longer
than their sample; the pair head's loss is logged beside MLM's; TP=2 equals TP=1; a run trains."""

import numpy as np
import pytest
import torch

from megamlm.data.pairs import Pairing, first_document
from megamlm.data.stream import MaskedBatches, ShardSet, StreamPosition
from megamlm.data.tokenizer import Tokenizer
from megamlm.objectives import get_objective
from tests.multiproc import run_on_ranks
from tests.test_train import config, logged, shards  # noqa: F401 (fixture)


def _sample(rng, n_docs=2, length=30):
    docs = [np.append(rng.integers(10, 500, size=length), 2) for _ in range(n_docs)]
    return np.concatenate([[0], *docs]).astype(np.int64)


@pytest.mark.parametrize("kind", ["sop", "nsp"])
def test_pairs_are_seeded_segments_of_the_first_document(kind):
    rng = np.random.default_rng(0)
    pairing = Pairing(kind, seed=5)
    partner_sample = _sample(rng)
    labels = []
    for index in range(400):
        sample = _sample(rng)
        pair, label = pairing(sample, 0, index, lambda: partner_sample)
        again, same = Pairing(kind, seed=5)(sample, 0, index, lambda: partner_sample)
        assert np.array_equal(pair, again) and label == same  # a function of (seed, epoch, index)
        assert len(pair) <= len(sample) and pair[0] == 0 and pair[-1] == 2
        seps = np.flatnonzero(pair == 2)
        assert len(seps) == 2  # <s> A </s> B </s>
        a, b = pair[1:seps[0]], pair[seps[0] + 1:-1]
        document = first_document(sample)
        if label == 0:
            assert np.array_equal(np.concatenate([a, b]), document)
        elif kind == "sop":
            assert np.array_equal(np.concatenate([b, a]), document)  # swapped
        else:
            assert np.array_equal(a, document[:len(a)]) and np.array_equal(b, first_document(partner_sample)[:len(b)])
        labels.append(label)
    assert 0.4 < np.mean(labels) < 0.6  # half of the pairs are label 1
    different = sum(not np.array_equal(Pairing(kind, 6)(s, 0, 1)[0], Pairing(kind, 5)(s, 0, 1)[0])
                    for s in [_sample(np.random.default_rng(i)) for i in range(20)])
    assert different > 5  # another seed, other pairs


def _batches(shards, position=None, dp_rank=0, dp_size=1, count=6):  # noqa: F811
    tokenizer = Tokenizer.gpt2()
    cfg = config(shards, "unused", "objective.name=nsp")
    objective = get_objective(cfg)
    stream = MaskedBatches(ShardSet(shards, "train", tokenizer.dictionary.sha256), objective.corruption(tokenizer, 1),
                           seq_length=64, micro_batch=4 // dp_size, seed=1, dp_rank=dp_rank, dp_size=dp_size,
                           position=position, pairing=objective.pairing(1))
    out = []
    for batch in stream:
        out.append(batch)
        if len(out) == count:
            return out


def test_pair_stream_resumes_exactly_and_does_not_depend_on_the_layout(shards):  # noqa: F811
    straight = _batches(shards)
    resumed = _batches(shards, StreamPosition(0, 3), count=3)
    for a, b in zip(straight[3:], resumed):
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.pair_labels, b.pair_labels)
    halves = [_batches(shards, dp_rank=r, dp_size=2, count=6) for r in range(2)]
    for update in range(3):  # DP=2 sees the samples (and pairs) DP=1 sees in the same update
        one = straight[update]
        two = [halves[r][update] for r in range(2)]
        assert sorted(one.sample_ids.tolist()) == sorted(sum((h.sample_ids.tolist() for h in two), []))
        by_id = {int(i): int(lab) for h in two for i, lab in zip(h.sample_ids, h.pair_labels)}
        assert {int(i): int(lab) for i, lab in zip(one.sample_ids, one.pair_labels)} == by_id
    labels = torch.cat([b.pair_labels for b in straight])
    assert 0 < labels.sum() < len(labels)


def _tp_losses(cfgs):
    from megamlm.parallel import init_distributed
    from megamlm.train.run_data import prepare_data, train_stream
    from megamlm.train.checkpoint import TrainState

    out = []
    for cfg in cfgs:
        ctx = init_distributed(cfg.parallel)
        objective = get_objective(cfg)
        data = prepare_data(cfg, ctx, objective)
        batch = next(iter(train_stream(cfg, ctx, data, TrainState(data_seed=cfg.train.seed))))
        model = objective.build_model(ctx)
        output = objective.loss(model, batch)
        output.loss_sum.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if n.startswith("pair_head")}
        out.append((output.loss_sum.detach(), output.count, grads, batch.pair_labels))
    return out


def test_sop_tp2_equals_tp1(shards, tmp_path):  # noqa: F811
    cfgs = [config(shards, tmp_path / f"tp{tp}", "objective.name=sop", f"parallel.tensor_parallel={tp}",
                    "model.hidden_dropout=0", "model.attention_dropout=0") for tp in (1, 2)]
    (tp1, tp2), _ = run_on_ranks(_tp_losses, 2, cfgs)
    torch.testing.assert_close(tp1[0], tp2[0], rtol=1e-6, atol=1e-5)
    assert tp1[1] == tp2[1] and tp1[1][1] == len(tp1[3]) == 4
    for name, grad in tp1[2].items():
        torch.testing.assert_close(grad, tp2[2][name], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_sop_run_logs_both_losses_and_learns_the_order(shards, tmp_path):  # noqa: F811
    from megamlm.train.loop import train

    cfg = config(shards, tmp_path / "sop", "objective.name=sop", "train.steps=30", "optim.lr=3e-3")
    run_on_ranks(train, 1, cfg)
    log = {key: logged(tmp_path / "sop", key=key) for key in ("loss", "mlm_loss", "sop_loss", "sop_accuracy")}
    for step, loss in log["loss"].items():
        assert loss == pytest.approx(log["mlm_loss"][step] + log["sop_loss"][step], rel=1e-9)
    first, last = (np.mean([log["sop_loss"][s] for s in steps]) for steps in (range(1, 6), range(26, 31)))
    print(f"sop loss: first 5 updates {first:.4f}, last 5 {last:.4f}; accuracy {log['sop_accuracy']}")
    assert first > 0.6 and last < first  # starts near ln 2 (a 2-way guess) and falls
