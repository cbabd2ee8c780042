"""FlexAttention's pieces (megamlm/model/flex.py). Attention dropout: two passes give exactly the
post-softmax dropout of the eager math with the same mask, forward (the real FlexAttention, CPU
forward) and backward (the composition's gradient); the hashed mask drops p of the entries,
independently, and its seed comes from the tensor-parallel stream."""

import warnings

import pytest
import torch

from megamlm.config import GLOBAL_ATTENTION
from megamlm.model.backends import ATTENTION_BACKENDS
from megamlm.model.flex import attend_with_dropout, draw_seed, keep_mask, keep_scale
from megamlm.model.positions import Alibi, PositionEncoding
from megamlm.parallel import tensor_parallel_rng

B, NP, S, HN = 2, 4, 16, 8


def _grids(b=B, np_=NP, s=S):
    """Broadcastable (row, head, query, key) indices: [b, 1, 1, 1], [1, np, 1, 1], [1, 1, s, 1], [1, 1, 1, s]."""
    return (torch.arange(b)[:, None, None, None], torch.arange(np_)[None, :, None, None],
            torch.arange(s)[None, None, :, None], torch.arange(s)[None, None, None, :])


def _position(name):
    if name == "none":
        return PositionEncoding()
    position = Alibi(NP, "learned", tp_rank=0, tp_size=1)  # different slopes before and after the query
    with torch.no_grad():
        position.log_slopes.copy_((torch.rand(2, NP, generator=torch.Generator().manual_seed(3)) + 0.1).log())
    return position


def _inputs(requires_grad=False):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, NP, S, HN, generator=g).requires_grad_(requires_grad) for _ in range(3))
    padding = torch.zeros(B, S, dtype=torch.bool)
    padding[1, 11:] = True
    documents = torch.zeros(B, S, dtype=torch.long).masked_fill(padding, -1)
    documents[0, 6:] = 1  # row 0 packs two documents
    return q, k, v, padding, documents


def _eager_dropout(q, k, v, bias, keep, p):
    """softmax(q·kᵀ/√hn + bias) · keep / (1 - p) @ v: what the eager backend computes with this mask."""
    probs = torch.softmax(q @ k.transpose(-2, -1) * HN**-0.5 + bias, dim=-1)
    return (probs * keep * keep_scale(p)) @ v


@pytest.mark.parametrize("position_name", ["alibi", "none"])
def test_flex_dropout_is_the_eager_dropout_with_its_mask(position_name):
    """The real FlexAttention (CPU forward) through the backend, seed from the TP stream."""
    p = 0.1
    position = _position(position_name)
    q, k, v, padding, documents = _inputs()
    sdpa, flex = (ATTENTION_BACKENDS[name](position) for name in ("sdpa", "flex"))
    bias = sdpa.prepare(padding, documents, None, torch.float32)  # the same padding / documents / ALiBi
    tensor_parallel_rng.seed(1234)
    state = tensor_parallel_rng.state_dict()
    torch.manual_seed(0)
    default_next = torch.rand(3)
    torch.manual_seed(0)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # flex warns that it runs unfused in eager mode
        got = flex.attend(q, k, v, flex.prepare(padding, documents, None, torch.float32, GLOBAL_ATTENTION), p, None)
        assert torch.equal(torch.rand(3), default_next)  # the seed came from the TP stream, not the default one
        tensor_parallel_rng.load_state_dict(state)  # what activation recomputation does
        again = flex.attend(q, k, v, flex.prepare(padding, documents, None, torch.float32, GLOBAL_ATTENTION), p, None)
        tensor_parallel_rng.load_state_dict(state)
        keep = keep_mask(draw_seed(q.device), p, *_grids())
        want = _eager_dropout(q, k, v, bias, keep, p)
        no_dropout = flex.attend(q, k, v, flex.prepare(padding, documents, None, torch.float32), 0.0, None)
    real = ~padding[:, None, :, None]  # padded queries' outputs are never used
    torch.testing.assert_close(got * real, want * real, rtol=0, atol=2e-6)
    assert torch.equal(again, got)
    assert (~keep).any(dim=-1).float().mean() > 0.7  # most queries lost keys: the correction is exercised
    assert (got - no_dropout).abs().max() > 0.05


def _flex_stand_in(mask, grids, outputs=None):
    """An eager FlexAttention: scores, then score_mod on the index grids; the logsumexp as FlexAttention
    returns it. `outputs` collects each call's output."""

    def attend(q, k, v, score_mod):
        scores = score_mod(q @ k.transpose(-2, -1) * HN**-0.5 + mask, *grids)
        # as FlexAttention: a query that sees no key gets out 0 and lse -inf, and no gradient
        unseen = torch.isneginf(scores).all(dim=-1, keepdim=True)
        scores = scores.masked_fill(unseen, 0.0)
        out = torch.softmax(scores, dim=-1).masked_fill(unseen, 0.0) @ v
        if outputs is not None:
            outputs.append(out)
        return out, torch.logsumexp(scores, dim=-1).masked_fill(unseen.squeeze(-1), float("-inf"))

    return attend


def test_flex_inside_a_compiled_region_traces_without_a_warning_and_gives_the_same_output():
    """`train.compile` compiles whole layers: Dynamo traced through compiled_flex_attention's cache, and every
    GPU run logged "Dynamo detected a call to a `functools.lru_cache`-wrapped function" (leases 1-6)."""
    position = _position("alibi")
    q, k, v, padding, documents = _inputs()
    flex = ATTENTION_BACKENDS["flex"](position)
    prepared = flex.prepare(padding, documents, None, torch.float32)
    compiled = torch.compile(lambda q, k, v: flex.attend(q, k, v, prepared, 0.0, None), backend="eager",
                             fullgraph=True)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        got = compiled(q, k, v)
        want = flex.attend(q, k, v, prepared, 0.0, None)
    assert not [str(w.message) for w in caught if "lru_cache" in str(w.message)]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_both_flex_passes_receive_an_output_gradient():
    """Inductor's flex_attention_backward lowering fails when a pass's output gets no gradient (torch 2.11,
    H200: the loop with attention dropout on Flex died compiling the logsumexp pass's backward). Both
    outputs are in the result's graph, and the logsumexp pass's (zeros) adds nothing to the result."""
    q, k, v, padding, documents = _inputs(requires_grad=True)
    mask = ATTENTION_BACKENDS["sdpa"](PositionEncoding()).prepare(padding, documents, None, torch.float32)
    outputs = []
    got = attend_with_dropout(_flex_stand_in(mask, _grids(), outputs), q, k, v, lambda score, *index: score, 0.1,
                              torch.tensor(5))
    kept, zeros = outputs
    assert zeros.shape[-1] == 16 and torch.equal(zeros, torch.zeros_like(zeros))
    grads = torch.autograd.grad(got.sum(), [kept, zeros])  # raises if an output is not in the graph
    assert grads[1].abs().sum() > 0


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_flex_dropout_gradient_is_the_eager_dropout_gradient(p):
    """The two-pass composition differentiated through an eager FlexAttention stand-in (scores, then
    score_mod on the index grids; logsumexp as FlexAttention returns it): the gradients of q, k, v
    and the learned ALiBi slopes equal those of dropout applied after the softmax."""
    position = _position("alibi")
    q, k, v, padding, documents = _inputs(requires_grad=True)
    mask = ATTENTION_BACKENDS["sdpa"](PositionEncoding()).prepare(padding, documents, None, torch.float32)  # -inf / 0
    params, term = position.score_params(), position.score_function()
    grids = _grids()
    seed = torch.tensor(987654364)  # at p = 0.5 three real queries lose every key they see (checked below)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + term(params, h, q_idx, kv_idx)

    got = attend_with_dropout(_flex_stand_in(mask, grids), q, k, v, score_mod, p, seed)
    want = _eager_dropout(q, k, v, mask + score_mod(torch.zeros(()), *grids), keep_mask(seed, p, *grids), p)
    real = ~padding[:, None, :, None]
    torch.testing.assert_close(got * real, want * real, rtol=0, atol=1e-6)
    if p == 0.5:  # some real queries lost every key they could see: their output is 0, as in dropout
        unseen = ((mask == 0) & keep_mask(seed, p, *grids)).sum(dim=-1, keepdim=True) == 0
        assert (unseen & real).any() and (got * unseen == 0).all()
    upstream = torch.randn(got.shape, generator=torch.Generator().manual_seed(1)) * real
    leaves = (q, k, v, position.log_slopes)
    grads_got = torch.autograd.grad(got, leaves, upstream, retain_graph=True)  # the slopes' graph is shared
    grads_want = torch.autograd.grad(want, leaves, upstream)
    for name, g, w in zip("q k v slopes".split(), grads_got, grads_want):
        assert w.abs().max() > 1e-3, name
        torch.testing.assert_close(g, w, rtol=0, atol=2e-6, msg=name)


def test_hashed_mask_drops_p_of_the_entries_independently():
    p, s = 0.1, 128
    grids = _grids(2, 4, s)
    keep = keep_mask(torch.tensor(5), p, *grids)  # [2, 4, 128, 128]: 131,072 entries
    assert keep.shape == (2, 4, s, s)
    assert abs(keep.float().mean().item() - (1 - p)) < 3e-3  # 6 standard deviations
    # neighbours along the key and the query are independent: P(both kept) = (1 - p)^2
    for pair in (keep[..., 1:] & keep[..., :-1], keep[:, :, 1:] & keep[:, :, :-1]):
        assert abs(pair.float().mean().item() - (1 - p) ** 2) < 5e-3
    # so are keys j and j ^ 8, which take the two halves of one hash (65,536 pairs: 3.4 standard deviations)
    low = torch.tensor([j for j in range(s) if not j & 8])
    for q in (p, 0.5):
        halves = keep_mask(torch.tensor(5), q, *grids)
        assert abs((halves[..., low] & halves[..., low ^ 8]).float().mean().item() - (1 - q) ** 2) < 5e-3, q
    # every row, head and seed has its own mask
    assert not torch.equal(keep[0], keep[1])
    assert not torch.equal(keep[:, 0], keep[:, 1])
    assert not torch.equal(keep, keep_mask(torch.tensor(6), p, *grids))
    assert abs(keep_mask(torch.tensor(5), 0.5, *grids).float().mean().item() - 0.5) < 5e-3
    assert keep_scale(0.1) == 65536 / (65536 - 6554)  # 16 bits per key: p = 6554 / 65536 = 0.100006


def _murmur_bits(seed: int, b: int, h: int, q: int, k: int) -> int:
    """The mask's hash in Python's unbounded integers: murmur3's finalizer chained over the indices."""
    def fmix(x):
        x ^= x >> 16
        x = (x * 0x85EBCA6B) % 2**32
        x ^= x >> 13
        x = (x * 0xC2B2AE35) % 2**32
        return x ^ (x >> 16)

    return fmix(fmix(fmix(seed ^ (b << 16 | h)) ^ q) ^ k)


def _murmur_kept(seed: int, b: int, h: int, q: int, k: int, dropped: int) -> bool:
    """Whether the mask keeps key k, in Python's integers: keys k and k ^ 8 share the hash of their pair,
    k with bit 3 clear taking its low 16 bits, k with it set the high 16."""
    bits = _murmur_bits(seed, b, h, q, (k >> 4) << 3 | (k & 7))
    return (bits >> 16 if k & 8 else bits & 0xFFFF) >= dropped


def test_hashed_mask_is_murmur3_on_int32_lanes_eager_and_compiled():
    """The int32 lanes (wrapping products, logical shifts, each key's half of its pair's bits) keep exactly
    the unsigned hash's entries: against Python integers, at seeds and indices that set the sign bit,
    and through Inductor (the kernel FlexAttention's score_mod becomes on a GPU)."""
    from megamlm.model.flex import dropped_levels, kept_at_level, random_bits

    rows, heads = torch.tensor([0, 1, 7, 32767]), torch.tensor([0, 3, 11, 65535])
    queries = torch.tensor([0, 1, 2047, 8191, 2**31 - 1])
    keys = torch.tensor([0, 5, 8, 13, 4095, 2**30 + 3, 2**31 - 1])
    grids = (rows[:, None, None, None], heads[None, :, None, None], queries[None, None, :, None],
             keys[None, None, None, :])
    for seed in (0, 12345, 2**31 - 1):
        bits = random_bits(torch.tensor(seed), *grids)
        assert bits.dtype == torch.int32
        want = torch.tensor([[[[_murmur_bits(seed, b, h, q, k) for k in keys.tolist()] for q in queries.tolist()]
                              for h in heads.tolist()] for b in rows.tolist()])
        assert torch.equal(bits.to(torch.int64) % 2**32, want)
        for p in (1e-9, 0.1, 0.5, 0.999):
            dropped = dropped_levels(p)
            kept = torch.tensor([[[[_murmur_kept(seed, b, h, q, k, dropped) for k in keys.tolist()]
                                   for q in queries.tolist()] for h in heads.tolist()] for b in rows.tolist()])
            assert torch.equal(kept_at_level(torch.tensor(seed), dropped, *grids), kept), (seed, p)
    # what Inductor generates from the same expression (C++ here; Triton on a GPU) keeps the same entries
    dropped, seed, grid = dropped_levels(0.1), torch.tensor(2**31 - 7), _grids(2, 3, 64)
    compiled = torch.compile(lambda s, *g: kept_at_level(s, dropped, *g), dynamic=False)
    assert torch.equal(compiled(seed, *grid), kept_at_level(seed, dropped, *grid))


def test_kernel_options_parse_and_bad_ones_are_refused_before_any_work():
    from megamlm.config import ConfigError
    from megamlm.model.attention import FlexAttention
    from megamlm.model.flex import kernel_options
    from tests.variants import variant_config

    assert kernel_options("") == {}
    assert kernel_options("BLOCK_M=128, BLOCK_N=64,num_warps=8,bwd_BLOCK_M1=32,PRESCALE_QK=true,BACKEND=TRITON") == {
        "BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "bwd_BLOCK_M1": 32, "PRESCALE_QK": True, "BACKEND": "TRITON"}
    cfg = variant_config("zero-clap", ["model.attention_backend=flex", "model.flex_kernel_options=num_warps=4"])
    assert FlexAttention.from_config(cfg.model, _position("alibi")).kernel_options == {"num_warps": 4}
    for bad in ("BLOCK_Q=64", "num_warps", "num_warps=", "fwd_num_stage=2"):
        with pytest.raises(ConfigError, match="model.flex_kernel_options: .* is not NAME=VALUE"):
            kernel_options(bad)
        bad_cfg = variant_config("zero-clap", ["model.attention_backend=flex", f"model.flex_kernel_options={bad}"])
        assert "model.flex_kernel_options" in FlexAttention.unsupported_here(bad_cfg.model)


def test_prescaled_scores_are_refused_where_a_position_adds_a_score_term():
    """PRESCALE_QK=true makes Flex hand score_mod the scores in log2 units, so ALiBi's term counts ln 2 times
    its value (lease 5's sweep on an H200: max error 0.86 against 0.017 for every other option)."""
    from megamlm.model.attention import FlexAttention
    from tests.variants import variant_config

    for options in ("PRESCALE_QK=true", "num_warps=4,bwd_PRESCALE_QK=true"):
        cfg = variant_config("zero-clap", ["model.attention_backend=flex", f"model.flex_kernel_options={options}"])
        assert "PRESCALE_QK=true is wrong with model.position=alibi" in FlexAttention.unsupported_here(cfg.model)
    for variant, options in (("zero-clap", "PRESCALE_QK=false"), ("baseline", "PRESCALE_QK=true")):
        cfg = variant_config(variant, ["model.attention_backend=flex", f"model.flex_kernel_options={options}"])
        assert "PRESCALE_QK" not in (FlexAttention.unsupported_here(cfg.model) or "")


def test_kernel_options_on_another_backend_warn_that_they_are_ignored():
    import warnings

    from megamlm.model.backends import ATTENTION_BACKENDS
    from tests.variants import variant_config

    for name in ("sdpa", "eager", "varlen"):
        cfg = variant_config("baseline", [f"model.attention_backend={name}", "model.flex_kernel_options=num_warps=4"])
        with pytest.warns(UserWarning, match=f"flex_kernel_options='num_warps=4' applies to .*flex only; the {name} "):
            ATTENTION_BACKENDS[name].from_config(cfg.model, _position("none"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # without options, or on flex itself: no warning
        ATTENTION_BACKENDS["sdpa"].from_config(variant_config("baseline").model, _position("none"))
        flex = variant_config("zero-clap", ["model.attention_backend=flex", "model.flex_kernel_options=num_warps=4"])
        ATTENTION_BACKENDS["flex"].from_config(flex.model, _position("alibi"))
