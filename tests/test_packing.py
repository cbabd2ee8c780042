"""Packed micro-batches: the bin plan (data/packing.py) on a Pile-like length distribution, and a
packed row computing exactly what the padded layout computes, for every variant."""

import numpy as np
import pytest
import torch

from megamlm.data.batch import collate
from megamlm.data.blocks import plan_blocks
from megamlm.data.packing import best_fit_decreasing, fill_ratio, plan_bins
from megamlm.objectives import MaskedLM
from tests.multiproc import run_on_ranks
from tests.test_train import logged
from tests.variants import VARIANTS, variant_config


def pile_like_samples(n_docs: int = 20000, seq_length: int = 2048, seed: int = 0) -> np.ndarray:
    """Sample lengths (<s> + block) of the reference's recipe on lognormal documents with the Pile's
    facts: median 1,024 tokens, 1/7 longer than 2,048 (sigma = ln 2 / z(6/7) = 0.649); documents
    longer than a sample are dropped, the rest packed by fairseq's `complete`."""
    rng = np.random.default_rng(seed)
    docs = np.round(rng.lognormal(np.log(1024), np.log(2) / 1.0676, n_docs)).astype(np.int64) + 1  # + </s>
    docs = docs[docs <= seq_length - 1]
    blocks = plan_blocks(docs, seq_length, "complete")
    return blocks[:, 1] - blocks[:, 0] + 1


def test_best_fit_decreasing_places_every_item_once_within_the_budget():
    lengths = np.random.default_rng(1).integers(1, 100, 500)
    bins = best_fit_decreasing(lengths, 100)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(lengths[b].sum() <= 100 for b in bins)
    assert bins == best_fit_decreasing(lengths, 100)
    # no bin could take another bin's smallest item: at most one bin is less than half full
    assert sum(lengths[b].sum() < 50 for b in bins) <= 1


def test_packing_fills_98_percent_of_a_pile_like_distribution_where_padding_fills_75():
    lengths = pile_like_samples()
    padded = lengths.sum() / (len(lengths) * 2048)
    assert padded == pytest.approx(0.745, abs=0.01)
    bins = plan_bins(lengths, 8 * 2048, window=1000, seed=1, epoch=0)
    assert fill_ratio(lengths, bins, 8 * 2048) >= 0.98
    positions = np.concatenate(bins)
    assert sorted(positions.tolist()) == list(range(len(lengths)))  # every sample once, none dropped
    assert all(lengths[b].sum() <= 8 * 2048 for b in bins)


def test_the_plan_is_seeded_per_epoch():
    lengths = pile_like_samples(4000)
    plan = plan_bins(lengths, 4 * 2048, window=500, seed=3, epoch=0)
    again = plan_bins(lengths, 4 * 2048, window=500, seed=3, epoch=0)
    other = plan_bins(lengths, 4 * 2048, window=500, seed=3, epoch=1)
    assert all(np.array_equal(a, b) for a, b in zip(plan, again)) and len(plan) == len(again)
    assert not all(np.array_equal(a, b) for a, b in zip(plan, other))


def _samples(vocab: int, lengths=(16, 11, 7, 13), seed: int = 0):
    """Samples <s> ... with an </s> inside (two documents in the first), as the loader builds them."""
    g = torch.Generator().manual_seed(seed)
    samples = [torch.randint(4, vocab, (n,), generator=g) for n in lengths]
    for sample in samples:
        sample[0], sample[-1] = 0, 2
    samples[0][7] = 2
    return [s.numpy() for s in samples]


def _no_corruption(sample, epoch, index):
    return sample, sample % 3 == 0  # every third id a target, none changed


@pytest.mark.parametrize("document_mask", [False, True], ids=["samples", "documents"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_packed_row_gives_every_sample_its_padded_logits(world, variant, document_mask):
    cfg = variant_config(variant, [f"model.document_mask={str(document_mask).lower()}"])
    model = MaskedLM(cfg.model, world, seed=3).eval()
    samples = [(s, i) for i, s in enumerate(_samples(cfg.model.vocab_size))]
    padded = collate(samples, _no_corruption, 0, 16, pad_id=1)
    packed = collate(samples, _no_corruption, 0, 56, pad_id=1, packed=True)  # 47 tokens + 9 padding
    assert packed.inputs.shape == (1, 56) and packed.segments.max() == 3
    assert torch.equal(padded.targets, packed.targets)  # the same targets, in the same order
    with torch.no_grad():
        want = model(padded.inputs, padded.target_index, padded.documents, padded.segments)
        got = model(packed.inputs, packed.target_index, packed.documents, packed.segments)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_packed_row_trains_every_variant_with_fp16_parameters(world, variant):
    """fp16 parameters (the Pile configs' precision; the flat engine runs it on a CPU too): the packed
    row's loss is the padded batch's and every gradient is finite. Before: BERT and ALBERT (LayerNorm
    eps 1e-12) had NaN gradients, from the all-zero rows of the packed row's padding in the layers'
    LayerNorm, whose CPU kernel kept 1/σ = 1e6 in fp16 (model/norm.py: LayerNorm)."""
    cfg = variant_config(variant)
    samples = [(s, i) for i, s in enumerate(_samples(cfg.model.vocab_size))]
    padded = collate(samples, _no_corruption, 0, 16, pad_id=1)
    packed = collate(samples, _no_corruption, 0, 56, pad_id=1, packed=True)
    losses = []
    for batch in (padded, packed):
        model = MaskedLM(cfg.model, world, seed=3).train().half()
        logits = model(batch.inputs, batch.target_index, batch.documents, batch.segments)
        loss = model.loss(logits, batch.targets)
        loss.backward()
        assert torch.isfinite(loss)
        assert [n for n, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()] == []
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-2)


def test_layer_norm_keeps_fp32_statistics_for_fp16_on_a_cpu():
    """model/norm.py's LayerNorm: in fp16 on a CPU, the output is torch's bit for bit, the gradients
    are fp32's to fp16 rounding, and a zero row that receives no gradient gives none (torch's CPU
    kernel: NaN in that row and in the weights' gradients, from its fp16 1/σ)."""
    from megamlm.model.norm import LayerNorm

    torch.manual_seed(0)
    weight, bias = torch.randn(64).half(), torch.randn(64).half()
    x, g = torch.randn(32, 64).half(), torch.randn(32, 64).half()
    x[5], g[5] = 0, 0  # a padding row
    norms, inputs = [], []
    for cls, dtype in ((LayerNorm, torch.float16), (torch.nn.LayerNorm, torch.float16),
                       (torch.nn.LayerNorm, torch.float32)):
        norm = cls(64, eps=1e-12).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(weight)
            norm.bias.copy_(bias)
        inputs.append(x.to(dtype, copy=True).requires_grad_())
        norm(inputs[-1]).backward(g.to(dtype))
        norms.append(norm)
    ours, theirs, exact = norms
    assert torch.equal(ours(x), theirs(x)) and ours(x).dtype == torch.float16
    assert inputs[1].grad[5].isnan().all() and theirs.weight.grad.isnan().all()  # torch's, on this CPU
    assert torch.equal(inputs[0].grad[5], torch.zeros(64, dtype=torch.float16))
    for got, want in ((inputs[0].grad, inputs[2].grad), (ours.weight.grad, exact.weight.grad),
                      (ours.bias.grad, exact.bias.grad)):
        assert got.dtype == torch.float16  # sums of 32 rows' fp16 products: a few units of fp16's roundoff
        assert (got.float() - want).abs().max() < 4e-3 * want.abs().max(), (got, want)


@pytest.mark.parametrize("mode", ["symmetric", "offset", "learned"])
def test_flex_and_sdpa_agree_on_packed_rows(mode):
    import warnings

    from megamlm.model.attention import PackedRows
    from megamlm.model.backends import ATTENTION_BACKENDS
    from megamlm.model.positions import Alibi

    s, np_, hn = 40, 4, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, np_, s, hn, generator=g) for _ in range(3))
    segments = torch.tensor([[0] * 12 + [1] * 5 + [2] * 17 + [-1] * 6])
    position = Alibi(np_, mode, tp_rank=0, tp_size=1)
    sdpa, flex = (ATTENTION_BACKENDS[name](position) for name in ("sdpa", "flex"))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # flex warns that it runs unfused in eager mode
        prepared = sdpa.prepare(segments < 0, None, segments, torch.float32)
        assert isinstance(prepared, PackedRows) and prepared.bias.shape == (3, np_, 17, 17)  # no [s, s]
        want = sdpa.attend(q, k, v, prepared, 0.0, None)
        got = flex.attend(q, k, v, flex.prepare(segments < 0, None, segments, torch.float32), 0.0, None)
        # each sample alone, in the padded layout
        for start, end in ((0, 12), (12, 17), (17, 34)):
            alone = sdpa.attend(*(t[:, :, start:end] for t in (q, k, v)),
                                sdpa.prepare(torch.zeros(1, end - start, dtype=torch.bool), None, None,
                                             torch.float32), 0.0, None)
            torch.testing.assert_close(want[:, :, start:end], alone, rtol=0, atol=1e-6)
    torch.testing.assert_close(got[:, :, :34], want[:, :, :34], rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# The packed stream and packed training
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from tests.test_train import tiny_shards

    return tiny_shards(tmp_path_factory, "packing")


def _stream(shards, **options):
    from megamlm.data.masking import Masker
    from megamlm.data.stream import MaskedBatches, ShardSet
    from megamlm.data.tokenizer import Tokenizer

    dictionary = Tokenizer.gpt2().dictionary
    args = dict(seq_length=64, micro_batch=4, shuffle_window=64, seed=5, packing="packed")
    return MaskedBatches(ShardSet(shards), Masker(dictionary.mask_id, dictionary.ordinary_ids(), seed=5),
                         **{**args, **options})


def test_a_packed_epoch_holds_every_sample_once_in_full_rows(shards):
    stream = _stream(shards, epochs=1)
    batches = list(stream)
    assert len(batches) == stream.batches_per_epoch(0) > 10
    seen = [int(i) for b in batches for i in b.sample_ids]
    assert len(seen) == len(set(seen)) == int(stream.counts.sum()) - stream.left_out_per_epoch()
    assert all(b.inputs.shape == (1, 4 * 64) for b in batches)
    fill = sum(b.real_tokens() for b in batches) / sum(b.inputs.numel() for b in batches)
    padded = _stream(shards, epochs=1, packing="padded")
    padded_fill = np.mean([b.fill() for b in padded])
    assert fill > max(0.95, padded_fill)  # WikiText split at 64 pads little already (92%)
    again = list(_stream(shards, epochs=1))  # seeded: the same micro-batches
    assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(batches, again))
    # validation streams keep the order (shuffle window 1): packing still fills its rows
    ordered = list(_stream(shards, epochs=1, shuffle_window=1))
    assert sum(b.real_tokens() for b in ordered) / sum(b.inputs.numel() for b in ordered) > 0.95


def _packed(shards, run_dir, *overrides):
    from tests.test_train import config

    return config(shards, run_dir, "data.packing=packed", "train.micro_batch_size=2", *overrides)


def _runs(cfgs):
    from tests.test_train import _train

    return [_train(cfg) for cfg in cfgs]


@pytest.mark.slow
def test_packed_dp2_and_tp2_equal_dp1_with_accumulation(shards, tmp_path):
    common = ["train.global_batch_size=4", "model.hidden_dropout=0", "model.attention_dropout=0"]
    (dp1,) = run_on_ranks(_runs, 1, [_packed(shards, tmp_path / "dp1", *common)])[0]
    dp2, tp2 = run_on_ranks(_runs, 2, [_packed(shards, tmp_path / "dp2", *common),
                                       _packed(shards, tmp_path / "tp2", *common, "parallel.tensor_parallel=2")])[0]
    assert len(dp1["losses"]) == 8 and dp1["losses"][-1] < dp1["losses"][0] - 0.2
    for other in (dp2, tp2):
        assert max(abs(a - b) for a, b in zip(other["losses"], dp1["losses"])) < 1e-4
    assert min(logged(tmp_path / "dp1", key="fill").values()) > 0.9


@pytest.mark.slow
def test_packed_resume_after_sigkill_reproduces_the_uninterrupted_losses(shards, tmp_path):
    from tests.test_train import _straight_then_resume, _train

    steps = ["train.steps=10", "train.save_interval=5", "model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
    killed = _packed(shards, tmp_path / "killed", *steps)
    with pytest.raises(RuntimeError, match="died without a result"):
        run_on_ranks(_train, 2, killed, None, 7)
    straight = _packed(shards, tmp_path / "straight", *steps)
    (full, resumed), _ = run_on_ranks(_straight_then_resume, 2, straight, killed)
    assert len(full["losses"]) == 10 and resumed["losses"] == full["losses"][5:]  # bit for bit


@pytest.mark.parametrize("window", [None, 4], ids=["global", "window-4"])
@pytest.mark.parametrize("layout", ["padded", "packed", "documents"])
def test_varlen_takes_only_the_real_tokens_and_equals_sdpa(layout, window):
    """The varlen backend's layout (sequences end to end, cu_seqlens; a local layer's window as the
    kernel's window_size) with its CPU stand-in kernel equals sdpa; on a GPU the kernel is torch's
    varlen FlashAttention (benchmarks/gpu.sh)."""
    from megamlm.config import LayerAttention
    from megamlm.model.attention import Sequences
    from megamlm.model.backends import ATTENTION_BACKENDS
    from megamlm.model.positions import PositionEncoding

    g = torch.Generator().manual_seed(0)
    if layout == "padded":  # two right-padded rows
        padding = torch.tensor([[False] * 9 + [True] * 3, [False] * 12])
        segments = documents = None
    else:  # one packed row: samples of 5, 4 and 8 tokens, 3 of padding
        segments = torch.tensor([[0] * 5 + [1] * 4 + [2] * 8 + [-1] * 3])
        padding = segments < 0
        documents = torch.tensor([[0] * 5 + [1] * 2 + [2] * 2 + [3] * 8 + [-1] * 3]) if layout == "documents" else None
    b, s = padding.shape
    q, k, v = (torch.randn(b, 4, s, 8, generator=g) for _ in range(3))
    sdpa, varlen = (ATTENTION_BACKENDS[name](PositionEncoding()) for name in ("sdpa", "varlen"))
    pattern = LayerAttention(window=window)
    prepared = varlen.prepare(padding, documents, segments, torch.float32, pattern)
    assert isinstance(prepared, Sequences) and int(prepared.cu_seqlens[-1]) == int((~padding).sum())
    want = sdpa.attend(q, k, v, sdpa.prepare(padding, documents, segments, torch.float32, pattern), 0.0, None)
    got = varlen.attend(q, k, v, prepared, 0.0, None)
    real = ~padding[:, None, :, None].expand_as(want)
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-6)
    assert not got[~real].any()  # padding computes nothing


def test_varlen_refuses_what_it_cannot_compute():
    from megamlm.model.attention import VarlenAttention

    alibi = variant_config("alibi", ["model.attention_backend=varlen"]).model
    assert "no score term for ALiBi; use model.attention_backend=flex" in VarlenAttention.unsupported_here(alibi)
    dropout = variant_config("baseline", ["model.attention_backend=varlen", "model.attention_dropout=0.1"]).model
    assert "no attention dropout" in VarlenAttention.unsupported_here(dropout)
    bigbird = variant_config("bigbird", ["model.attention_backend=varlen"]).model
    assert "no BigBird pattern (only windows); use model.attention_backend=flex" in (
        VarlenAttention.unsupported_here(bigbird))
