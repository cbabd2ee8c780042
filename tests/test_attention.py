"""Core attention: the FlexAttention score_mod equals SDPA with the materialized ALiBi bias;
the tensor-parallel dropout stream is separate and reproducible."""

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megamlm.config import GLOBAL_ATTENTION, LayerAttention
from megamlm.model.attention import LayerInputs, sdpa_kernels
from megamlm.model.layer import BidirectionalAttention
from megamlm.model.backends import ATTENTION_BACKENDS
from megamlm.model.patterns import flex_block_mask
from megamlm.model.encoder import transformer_config
from megamlm.model.positions import Alibi, alibi_bias
from megamlm.model.sequences import LayoutReads
from megamlm.parallel import TensorParallelRNG, tensor_parallel_rng
from tests.variants import variant_config


def _attention(backend, position):
    tcfg = transformer_config(variant_config("alibi").model, tp_size=1)
    return BidirectionalAttention(tcfg, 1, None, "self", backend=ATTENTION_BACKENDS[backend](position)).eval()


@pytest.mark.parametrize("documents", [False, True], ids=["one-document", "packed"])
@pytest.mark.parametrize("mode", ["symmetric", "offset", "learned"])
def test_flex_score_mod_equals_sdpa_with_materialized_bias(mode, documents):
    s, b, np_, hn = 12, 2, 4, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, b, np_, hn, generator=g) for _ in range(3))
    padding = torch.zeros(b, s, dtype=torch.bool)
    padding[1, 7:] = True
    groups = torch.zeros(b, s, dtype=torch.long).masked_fill(padding, -1)  # key groups: -1 = padding
    if documents:
        groups[0, 5:] = 1  # row 0 packs two documents
    position = Alibi(np_, mode, tp_rank=0, tp_size=1)
    if mode == "learned":  # different slopes before and after the query
        with torch.no_grad():
            position.log_slopes.copy_((torch.rand(2, np_, generator=g) + 0.1).log())
    before, after = position.slopes_before_after()
    # sdpa: [b, 1, 1, s] key padding (+ [b, 1, s, s] other documents) + [np, s, s] bias
    bias = torch.zeros(b, 1, 1, s).masked_fill(padding[:, None, None, :], float("-inf"))
    other = (groups[:, None, :, None] >= 0) & (groups[:, None, :, None] != groups[:, None, None, :])
    bias = bias.masked_fill(other, float("-inf")) + alibi_bias(before, after, s, s, position.offset)[None]
    # each backend prepares its own inputs from padding / documents / the position encoding
    documents = groups if documents else None
    sdpa, flex = _attention("sdpa", position), _attention("flex", position)
    torch.testing.assert_close(sdpa.backend.prepare(padding, documents, None, torch.float32).expand_as(bias), bias)
    want = sdpa(q, k, v, {GLOBAL_ATTENTION: LayerInputs(bias, rotation=None)})
    # no_grad: the CPU (eager) FlexAttention cannot trace learned slopes that require grad
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # flex warns that it runs unfused in eager mode
        got = flex(q, k, v, flex.backend.prepare_layers([GLOBAL_ATTENTION], padding, documents, None, torch.float32))
    assert got.shape == (s, b, np_ * hn)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_tensor_parallel_rng_is_a_separate_reproducible_stream():
    rng = TensorParallelRNG()
    rng.seed(1234)
    torch.manual_seed(0)
    default_first = torch.rand(3)
    torch.manual_seed(0)
    with rng.fork(torch.device("cpu")):
        forked_a = torch.rand(3)
    assert torch.equal(torch.rand(3), default_first)  # the default stream did not advance
    with rng.fork(torch.device("cpu")):
        forked_b = torch.rand(3)
    assert not torch.equal(forked_a, forked_b)  # the forked stream advanced
    other = TensorParallelRNG()
    other.seed(1234)
    with other.fork(torch.device("cpu")):
        assert torch.equal(torch.rand(3), forked_a)
    state = rng.state_dict()
    with rng.fork(torch.device("cpu")):
        next_value = torch.rand(3)
    rng.load_state_dict(state)
    with rng.fork(torch.device("cpu")):
        assert torch.equal(torch.rand(3), next_value)


def test_flex_block_mask_skips_padding_and_other_documents():
    s, block = 512, 128
    groups = torch.zeros(3, s, dtype=torch.long)
    groups[1, 200:] = -1  # 200 real tokens, then padding
    groups[2, 256:] = 1  # two documents of 256 tokens
    mask = flex_block_mask(groups)
    # key blocks each query block visits (partial + full): [b, 1, q_blocks]
    visited = mask.kv_num_blocks + mask.full_kv_num_blocks
    assert visited[0, 0].tolist() == [4, 4, 4, 4]
    assert visited[1, 0].tolist() == [2, 2, 2, 2]  # key blocks 2 and 3 are padding only
    assert visited[2, 0].tolist() == [2, 2, 2, 2]  # each query block stays in its document's 2 blocks
    assert mask.BLOCK_SIZE == (block, block)


@pytest.mark.parametrize("backend", ["sdpa", "eager", "flex", "varlen"])
def test_sliding_window_equals_dense_attention_with_the_explicit_window_mask(backend):
    """A local layer's query sees the keys within window / 2 of it (ModernBERT's |i - j| <= 8 for a
    16-token window), never padding, on every backend; checked on rows 2.5x and 1.9x the window."""
    from megamlm.model.positions import PositionEncoding

    s, b, np_, hn, window = 40, 2, 4, 8, 16
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, np_, s, hn, generator=g) for _ in range(3))
    padding = torch.zeros(b, s, dtype=torch.bool)
    padding[1, 30:] = True
    index = torch.arange(s)
    visible = ((index[:, None] - index[None, :]).abs() <= window // 2) & ~padding[:, None, None, :]
    scores = (q @ k.transpose(-1, -2)) * hn ** -0.5
    want = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v
    attention = ATTENTION_BACKENDS[backend](PositionEncoding())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex warns that it runs unfused in eager mode
        local = attention.prepare(padding, None, None, torch.float32, LayerAttention(window=window))
        got = attention.attend(q, k, v, local, 0.0, None)
    real = ~padding  # [b, s]: padded queries are never read
    torch.testing.assert_close(got.transpose(1, 2)[real], want.transpose(1, 2)[real], rtol=0, atol=1e-5)
    wide = attention.prepare(padding, None, None, torch.float32, LayerAttention(window=2 * window))
    wider = attention.attend(q, k, v, wide, 0.0, None)
    assert not torch.allclose(wider.transpose(1, 2)[real], got.transpose(1, 2)[real], atol=1e-3)


def test_flex_block_mask_visits_only_the_blocks_of_the_window():
    s = 1024  # 8 blocks of 128
    groups = torch.zeros(2, s, dtype=torch.long)
    groups[1, 512:] = -1  # 512 real tokens, then padding
    local = flex_block_mask(groups, LayerAttention(window=256))  # 128 keys on each side: the block and its neighbours
    visited = local.kv_num_blocks + local.full_kv_num_blocks
    assert visited[0, 0].tolist() == [2, 3, 3, 3, 3, 3, 3, 2]
    # padding queries (blocks 4-7 of row 1) keep every real key, as on the SDPA path
    assert visited[1, 0].tolist() == [2, 3, 3, 2, 4, 4, 4, 4]
    narrow = flex_block_mask(groups, LayerAttention(window=16))  # 8 keys each side: still the neighbours at block edges
    assert (narrow.kv_num_blocks + narrow.full_kv_num_blocks)[0, 0].tolist() == [2, 3, 3, 3, 3, 3, 3, 2]
    dense = flex_block_mask(groups)
    assert (dense.kv_num_blocks + dense.full_kv_num_blocks).sum() == 8 * 8 + 8 * 4


def test_bigbird_pattern_is_window_global_tokens_and_random_blocks_on_every_backend():
    """BigBird (model.local_attention=bigbird): a real query sees its window, the sample's first global
    tokens see and are seen by all, and each query block sees its random key blocks; sdpa's explicit
    mask and flex's BlockMask agree, and the pattern is the same for a sample packed or padded."""
    from megamlm.model.patterns import pattern_sees, random_block_table
    from megamlm.model.positions import PositionEncoding

    pattern = LayerAttention(window=4, global_tokens=2, random_blocks=1, block_size=8, table_blocks=4, seed=3)
    table = random_block_table(pattern)
    assert table.sum(dim=1).tolist() == [1, 1, 1, 1]  # one random key block per query block
    assert not torch.equal(table, random_block_table(LayerAttention(**{**pattern.__dict__, "seed": 4})))
    index = torch.arange(40)
    seen = pattern_sees(pattern, index[:, None], index[None, :], table)
    assert seen[0].all() and seen[:, 1].all()  # global tokens
    assert seen[20, 18] and seen[20, 22] and seen[20, 23] == table[2, 2]  # the window: 2 keys each side
    random_keys = {j for j in range(40) if seen[20, j] and abs(20 - j) > 2 and j >= 2}
    want = {j for j in range(40) if table[(20 // 8) % 4, (j // 8) % 4] and abs(20 - j) > 2 and j >= 2}
    assert random_keys == want and len(want) >= 6  # a whole block of 8, repeating beyond 4 blocks

    s, b, np_, hn = 40, 2, 2, 8
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(b, np_, s, hn, generator=g) for _ in range(3))
    padding = torch.zeros(b, s, dtype=torch.bool)
    padding[1, 27:] = True
    visible = seen & ~padding[:, None, None, :]
    scores = (q @ k.transpose(-1, -2)) * hn ** -0.5
    want_out = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v
    real = ~padding
    for name in ("sdpa", "flex"):
        backend = ATTENTION_BACKENDS[name](PositionEncoding())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flex warns that it runs unfused in eager mode
            got = backend.attend(q, k, v, backend.prepare(padding, None, None, torch.float32, pattern), 0.0, None)
        torch.testing.assert_close(got.transpose(1, 2)[real], want_out.transpose(1, 2)[real], rtol=0, atol=1e-5)
    # row 1's sample packed after a 13-token sample: its positions (so its pattern) restart
    packed_q, packed_k, packed_v = (torch.cat([t[:1, :, :13], t[1:, :, :27]], dim=2) for t in (q, k, v))
    segments = torch.tensor([[0] * 13 + [1] * 27])
    sdpa = ATTENTION_BACKENDS["sdpa"](PositionEncoding())
    out = sdpa.attend(packed_q, packed_k, packed_v, sdpa.prepare(segments < 0, None, segments, torch.float32, pattern),
                      0.0, None)
    alone = sdpa.attend(q[1:, :, :27], k[1:, :, :27], v[1:, :, :27],
                        sdpa.prepare(padding[1:, :27], None, None, torch.float32, pattern), 0.0, None)
    torch.testing.assert_close(out[:, :, 13:], alone, rtol=0, atol=1e-6)


def test_sdpa_takes_no_mask_when_every_key_is_visible():
    """No padded key, no score term, no documents or pattern: sdpa passes no bias (SDPA's flash path)
    and gives the masked math's output; any of those present brings the bias back."""
    from megamlm.model.positions import PositionEncoding

    b, np_, s, hn = 2, 4, 24, 8
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(b, np_, s, hn, generator=g) for _ in range(3))
    sdpa = ATTENTION_BACKENDS["sdpa"](PositionEncoding())
    full = torch.zeros(b, s, dtype=torch.bool)
    assert sdpa.prepare(full, None, None, torch.float32) is None
    want = torch.softmax((q @ k.transpose(-1, -2)) * hn ** -0.5, dim=-1) @ v
    torch.testing.assert_close(sdpa.attend(q, k, v, None, 0.0, None), want, rtol=0, atol=1e-6)
    padded = full.clone()
    padded[1, 20:] = True
    assert sdpa.prepare(padded, None, None, torch.float32).shape == (b, 1, 1, s)
    assert sdpa.prepare(full, torch.zeros(b, s, dtype=torch.long), None, torch.float32) is not None
    assert sdpa.prepare(full, None, None, torch.float32, LayerAttention(window=8)) is not None
    alibi = ATTENTION_BACKENDS["sdpa"](Alibi(np_, "offset", tp_rank=0, tp_size=1))
    assert alibi.prepare(full, None, None, torch.float32).shape == (b, np_, s, s)
    # packed samples of equal length fill their [n, L] slots: no bias either; unequal ones need it
    equal = torch.tensor([[0] * 12 + [1] * 12, [2] * 12 + [3] * 12])
    assert sdpa.prepare(equal < 0, None, equal, torch.float32).bias is None
    unequal = torch.tensor([[0] * 10 + [1] * 14, [2] * 12 + [3] * 12])
    assert sdpa.prepare(unequal < 0, None, unequal, torch.float32).bias.shape == (4, 1, 1, 14)


@pytest.mark.parametrize("mode", ["offset", "learned"])
def test_sdpa_shares_one_score_term_across_rows_when_no_key_is_padded(mode, monkeypatch):
    """With ALiBi and no padded key, no document or pattern, the bias is the score term [1, np, s, s]
    viewed as [b, np, s, s] (nothing b times larger is built), and attention (forward, backward, with
    our dropout) is bit for bit what the materialized bias gives; a padded key brings back the full bias."""
    b, np_, s, hn = 3, 4, 20, 8
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(b, np_, s, hn, generator=g, requires_grad=True) for _ in range(3))
    position = Alibi(np_, mode, tp_rank=0, tp_size=1)
    sdpa = ATTENTION_BACKENDS["sdpa"](position)
    full = torch.zeros(b, s, dtype=torch.bool)
    shared = sdpa.prepare(full, None, None, torch.float32)
    assert shared.shape == (b, np_, s, s) and shared.stride(0) == 0
    torch.testing.assert_close(shared, position.score_bias(s, torch.float32).expand(b, -1, -1, -1), rtol=0, atol=0)
    for name in ("_states", "tp_size"):  # the process's stream as it was, after the test
        monkeypatch.setattr(tensor_parallel_rng, name, getattr(tensor_parallel_rng, name))
    tensor_parallel_rng.seed(7)
    state = tensor_parallel_rng.state_dict()
    for dropout_p in (0.0, 0.1):
        runs = []
        for bias in (shared, shared.detach().clone().requires_grad_(mode == "learned")):
            tensor_parallel_rng.load_state_dict(state)  # the same dropout masks for both
            out = sdpa.attend(q, k, v, bias, dropout_p, None)
            runs.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
        for got, want in zip(*runs):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    padded = full.clone()
    padded[0, -3:] = True
    assert sdpa.prepare(padded, None, None, torch.float32).stride(0) == np_ * s * s
    # on a device, asked only of a host copy of the layout: without one the full bias, and no read (meta has none)
    on_device, sdpa = full.to("meta"), ATTENTION_BACKENDS["sdpa"](Alibi(np_, mode, tp_rank=0, tp_size=1).to("meta"))
    assert sdpa.prepare(on_device, None, None, torch.float32).stride(0) == np_ * s * s
    hosted = LayoutReads(on_device, None, None, host=(full, None, None))
    assert sdpa.prepare(on_device, None, None, torch.float32, reads=hosted).stride(0) == 0


def test_sdpa_avoids_cudnn_where_its_masked_backward_returns_nan():
    """pytorch#196678 (torch >= 2.11, Hopper): cuDNN's masked backward gives NaN dQ at key lengths 64
    mod 128, which every bf16 eager H200 run hit at update 23 (a 1,856-wide micro-batch). Those
    batches run without cuDNN; every other case keeps torch's choice."""
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):  # cuDNN allowed outside
        with sdpa_kernels("cuda", 1856, masked=True):
            assert not torch.backends.cuda.cudnn_sdp_enabled()
            assert torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.cudnn_sdp_enabled()
    for case in (("cuda", 2048, True), ("cuda", 1856, False), ("cuda", 1992, True), ("cpu", 1856, True)):
        assert isinstance(sdpa_kernels(*case), contextlib.nullcontext), case
    # entered anywhere, attention stays exact (the CPU runs its own kernels under the same list)
    q, k, v = (torch.randn(2, 3, 192, 16) for _ in range(3))
    bias = torch.zeros(2, 1, 1, 192).masked_fill(torch.rand(2, 1, 1, 192) < 0.2, float("-inf"))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    with sdpa_kernels("cuda", 192, masked=True):
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=bias), want)


def test_the_hf_exports_copy_of_the_cudnn_rule_agrees():
    """The exported modeling_megamlm.py cannot import megamlm; its copy of `sdpa_kernels` must pick the
    same kernels, or fine-tuning an ALiBi export on a Hopper GPU meets pytorch#196678's NaN."""
    import importlib.util

    from megamlm.convert.hf_export import MODELING_FILE

    spec = importlib.util.spec_from_file_location("exported_modeling_megamlm", MODELING_FILE)
    exported = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(exported)

    def enabled(choose, *case):
        with choose(*case):
            return (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                    torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled())

    cases = [(device, length, masked) for device in ("cuda", "cpu") for length in (64, 192, 1856, 1857, 2048)
             for masked in (True, False)]
    for case in cases:
        assert enabled(exported.sdpa_kernels, *case) == enabled(sdpa_kernels, *case), case
    assert enabled(exported.sdpa_kernels, "cuda", 1856, True)[0] is False
