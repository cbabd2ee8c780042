"""Dropout with the cheap CPU mask: the drop rate, the scale, the mask reused by backward, no bias
between the 16-bit lanes of one draw, reproducibility; and the CPU attention path that uses it."""

import dataclasses

import pytest
import torch

from megamlm.config import GLOBAL_ATTENTION
from megamlm.model.attention import AttentionBackend, LayerInputs
from megamlm.model.layer import BidirectionalAttention
from megamlm.model.dropout import dropout
from megamlm.model.encoder import transformer_config
from megamlm.model.positions import PositionEncoding
from megamlm.parallel import tensor_parallel_rng
from tests.variants import variant_config


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_drop_rate_and_scale_in_every_lane(p):
    torch.manual_seed(0)
    n = 1 << 20
    y = dropout(torch.ones(n), p, training=True)
    dropped = y.eq(0)
    kept_value = round(p * 65536) / 65536
    assert torch.allclose(y[~dropped], torch.tensor(1 / (1 - kept_value)))
    # 4 binomial standard deviations of the drop fraction, per lane of the int64 draw (each lane
    # is every 4th element): a lane with a fixed bit would drop at another rate
    tolerance = 4 * (p * (1 - p) / (n / 4)) ** 0.5
    for lane in range(4):
        assert abs(dropped.view(-1, 4)[:, lane].float().mean().item() - p) < tolerance
    assert abs(y.mean().item() - 1.0) < 4 * (p / (1 - p) / n) ** 0.5  # expectation preserved


def test_a_drop_probability_that_rounds_to_one_is_zero_on_cpu_and_refused_where_kept_values_are_scaled():
    """Within 2^-17 of 1 the 16-bit threshold drops every element: the CPU dropout returns zeros (as
    F.dropout with p = 1); the attention masks (flex.py, the Triton kernels), which scale the kept
    probabilities, refuse it with the threshold in the message instead of dividing by zero."""
    from megamlm.model.dropout import level_keep_scale
    from megamlm.model.flex import keep_scale

    p = 1 - 2**-18
    assert torch.equal(dropout(torch.ones(8), p, training=True), torch.zeros(8))
    with pytest.raises(ValueError, match="round"):
        keep_scale(p)
    assert level_keep_scale(65535) == 65536.0  # the largest threshold that keeps something


def test_backward_uses_the_forward_mask():
    torch.manual_seed(0)
    x = torch.randn(3, 1000, requires_grad=True)
    y = dropout(x, 0.3, training=True)
    grad = torch.randn_like(y)
    y.backward(grad)
    kept = y.ne(0)
    scale = 65536 / (65536 - round(0.3 * 65536))
    torch.testing.assert_close(x.grad, grad * kept * scale)
    torch.testing.assert_close(y, x.detach() * kept * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mask_is_applied_as_where_and_scale_bit_for_bit_with_dropped_values_plus_zero(dtype):
    """The main job's numbers stay those of torch.where(keep, x, 0.0) * scale to the last bit: a multiply by the
    mask would write -0.0 for dropped negative values."""
    from megamlm.model.dropout import apply_mask, dropped_levels, level_keep_scale

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 257, generator=g).to(dtype)
    keep = torch.rand(x.shape, generator=g) >= 0.1
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    scale = level_keep_scale(dropped_levels(0.1))
    got = apply_mask(x, keep, scale)
    assert torch.equal(got.view(bits), torch.where(keep, x, 0.0).mul_(scale).view(bits))
    assert not got[~keep].signbit().any() and got.dtype == dtype


def test_reproducible_from_the_seed_and_identity_when_off():
    x = torch.randn(257)  # not a multiple of the 4 lanes
    torch.manual_seed(5)
    a = dropout(x, 0.1, training=True)
    torch.manual_seed(5)
    assert torch.equal(dropout(x, 0.1, training=True), a)
    assert not torch.equal(dropout(x, 0.1, training=True), a)  # the stream advanced
    assert dropout(x, 0.1, training=False) is x
    assert dropout(x, 0.0, training=True) is x
    assert torch.equal(dropout(x, 1.0, training=True), torch.zeros_like(x))


def _attention(dropout_p):
    model = variant_config("alibi").model
    tcfg = transformer_config(dataclasses.replace(model, attention_dropout=dropout_p), tp_size=1)
    return BidirectionalAttention(tcfg, 1, None, "self", backend=AttentionBackend(PositionEncoding()))


def test_cpu_attention_dropout_path_matches_sdpa_in_expectation():
    s, b, np_, hn = 6, 2, 4, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, b, np_, hn, generator=g) for _ in range(3))
    bias = torch.randn(b, np_, s, s, generator=g)
    bias[1, :, :, 4:] = float("-inf")  # padded keys of sample 1
    bias = {GLOBAL_ATTENTION: LayerInputs(bias, rotation=None)}  # what the encoder prepares for global layers
    attention = _attention(0.1)
    tensor_parallel_rng.seed(0)
    want = attention.eval()(q, k, v, bias)  # SDPA, no dropout
    # a drop probability below 1/65536 keeps everything: the explicit math path alone equals SDPA
    attention.dropout_p = 1e-6
    torch.testing.assert_close(attention.train()(q, k, v, bias), want)
    # with dropout, the average over draws converges to the output without it
    attention.dropout_p = 0.1
    tensor_parallel_rng.seed(0)  # attention dropout draws from the tensor-parallel stream
    draws = torch.stack([attention(q, k, v, bias) for _ in range(2000)])
    assert not torch.allclose(draws[0], want, atol=1e-3)
    torch.testing.assert_close(draws.mean(0), want, rtol=0, atol=0.05)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_compiled_code_forks_the_tensor_parallel_stream_only_when_there_are_peers(tp_size, monkeypatch):
    """Under torch.compile at TP=1 the fork is a no-op, so the code is traced whole (the generator swap
    cannot be traced: a graph break); with TP peers their masks must differ, so the stream is swapped in."""
    from torch._dynamo.utils import counters

    def attention_dropout(x):
        with tensor_parallel_rng.fork(x.device):
            return torch.nn.functional.dropout(x, 0.5, training=True)

    monkeypatch.setattr(tensor_parallel_rng, "tp_size", tp_size)  # the later tests get the stream's TP size back
    tensor_parallel_rng.seed(0, tp_size=tp_size)
    before = tensor_parallel_rng.state_dict()["cpu"].clone()
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(attention_dropout)(torch.ones(4096))
    assert 0.4 < (out == 0).float().mean() < 0.6  # dropout happened
    advanced = not torch.equal(tensor_parallel_rng.state_dict()["cpu"], before)
    assert advanced == (tp_size > 1)  # the masks came from this rank's stream exactly when it has peers
    if tp_size == 1:
        assert counters["stats"]["calls_captured"] > 0 and not counters["graph_break"]  # traced whole
