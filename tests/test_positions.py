"""ALiBi slopes and biases against the reference values; fairseq position layouts."""

import math

import pytest
import torch

from megamlm.model.positions import (
    Alibi,
    LearnedPositions,
    alibi_bias,
    alibi_slopes,
    fairseq_position_ids,
    sinusoidal_table,
)

# the reference's values (fairseq utils.alibi, verified by running the fork)
REFERENCE_SLOPES = {
    4: [2**-2, 2**-4, 2**-6, 2**-8],
    8: [2.0**-k for k in range(1, 9)],
    12: [2.0**-k for k in range(1, 9)] + [2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5],
    16: [2 ** (-k / 2) for k in range(1, 17)],
}


@pytest.mark.parametrize("heads", sorted(REFERENCE_SLOPES))
def test_slopes_match_reference(heads):
    got = torch.tensor(alibi_slopes(heads), dtype=torch.float32)
    want = torch.tensor(REFERENCE_SLOPES[heads], dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-7, atol=0)


def test_roberta_base_slopes_in_head_order():
    # the reference lists them as float32: .5 ... .00390625, .70710677, .35355338, .17677669, .08838835
    got = torch.tensor(alibi_slopes(12), dtype=torch.float32)[8:].tolist()
    assert got == pytest.approx([0.70710677, 0.35355338, 0.17677669, 0.08838835], abs=1e-8)


def test_offset_bias_is_the_blog_matrix_for_unit_slope():
    one = torch.ones(1)
    got = alibi_bias(one, one, 5, 5, offset=0.5)[0]
    want = torch.tensor([
        [0, -.5, -1.5, -2.5, -3.5],
        [-1, 0, -.5, -1.5, -2.5],
        [-2, -1, 0, -.5, -1.5],
        [-3, -2, -1, 0, -.5],
        [-4, -3, -2, -1, 0],
    ])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_symmetric_bias_is_minus_slope_times_distance():
    slopes = torch.tensor(alibi_slopes(4))
    i = torch.arange(7)
    want = -slopes[:, None, None] * (i[None, :] - i[:, None]).abs()[None]
    torch.testing.assert_close(alibi_bias(slopes, slopes, 7, 7, offset=0.0), want, rtol=0, atol=0)


def test_learned_mode_starts_symmetric_and_uses_separate_slopes():
    learned = Alibi(8, "learned", tp_rank=0, tp_size=1)
    symmetric = Alibi(8, "symmetric", tp_rank=0, tp_size=1)
    torch.testing.assert_close(learned(6, torch.float32), symmetric(6, torch.float32))
    with torch.no_grad():
        learned.log_slopes[1] += math.log(2.0)  # keys after the query: twice the slope
    bias = learned(6, torch.float32)
    assert bias[0, 3, 5].item() == pytest.approx(-2 * 2 * 2**-1)
    assert bias[0, 3, 1].item() == pytest.approx(-2 * 2**-1)
    bias.sum().backward()
    assert learned.log_slopes.grad.abs().min() > 0


@pytest.mark.parametrize("mode", ["symmetric", "offset", "learned"])
def test_each_tensor_parallel_rank_builds_only_its_heads(mode):
    full = Alibi(12, mode, tp_rank=0, tp_size=1)(9, torch.float32)
    for tp in (2, 3, 4):
        shards = [Alibi(12, mode, tp_rank=r, tp_size=tp) for r in range(tp)]
        assert all(s(9, torch.float32).shape == (12 // tp, 9, 9) for s in shards)
        torch.testing.assert_close(torch.cat([s(9, torch.float32) for s in shards]), full)


def test_cached_bias_is_sliced_exactly_for_shorter_sequences():
    alibi = Alibi(4, "offset", tp_rank=0, tp_size=1)
    alibi(64, torch.float32)  # fills the cache at 64
    for length in (8, 17, 64):
        slopes = torch.tensor(alibi_slopes(4))
        torch.testing.assert_close(alibi(length, torch.float32),
                                   alibi_bias(slopes, slopes, length, length, 0.5))
    assert alibi(100, torch.float32).shape == (4, 100, 100)


def test_fairseq_position_ids_start_at_two_and_pad_is_one():
    tokens = torch.tensor([[0, 8, 9, 2, 1, 1], [0, 5, 2, 1, 1, 1]])
    assert fairseq_position_ids(tokens, 1).tolist() == [[2, 3, 4, 5, 1, 1], [2, 3, 4, 1, 1, 1]]


def test_learned_table_has_fairseq_rows_and_refuses_longer_inputs():
    table = LearnedPositions(max_positions=8, hidden_size=4, pad_token_id=1)
    assert table.weight.shape == (10, 4)
    with pytest.raises(ValueError, match="exceeds the learned position table"):
        table(torch.full((1, 9), 5))


def test_sinusoidal_table_matches_fairseq_formula():
    table = sinusoidal_table(10, 6, pad_token_id=1)
    half = 3
    freq = math.log(10000) / (half - 1)
    for pos in (0, 2, 9):
        for k in range(half):
            assert table[pos, k].item() == pytest.approx(math.sin(pos * math.exp(-k * freq)), abs=1e-6)
            assert table[pos, half + k].item() == pytest.approx(math.cos(pos * math.exp(-k * freq)), abs=1e-6)
    assert table[1].abs().sum() == 0
