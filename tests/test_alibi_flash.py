"""model.attention_backend=alibi-flash: ALiBi as extra head dimensions of two causal flash passes
(model/alibi_flash.py) equals SDPA with the materialized bias, forward and backward, in padded and
packed rows, in the model and in the loop; on a CPU the flash pass is the reference kernel (a GPU's
private flash ops are checked against it at first use, and timed by benchmarks/attention.py)."""

import pytest
import torch
import torch.nn.functional as F

from megamlm.config import ConfigError
from megamlm.model.alibi_flash import ReferenceKernel, alibi_flash_attention, alibi_terms, check_kernel, flash_kernel
from megamlm.model.attention import AlibiFlashAttention, PackedRows
from megamlm.model.backends import ATTENTION_BACKENDS
from megamlm.model.positions import Alibi, alibi_bias, alibi_slopes
from megamlm.objectives import MaskedLM, get_objective
from megamlm.train.loop import check_before_work
from tests.backend_parity import assert_loop_trains_sdpas_losses, assert_model_gives_sdpas_loss_and_gradients
from tests.test_train import tiny_shards
from tests.variants import variant_config


def _bias(slopes, offset, padding, s):
    # [np, s, s] ALiBi + [b, 1, 1, s] -inf on padded keys -> [b, np, s, s]
    return alibi_bias(slopes, slopes, s, s, offset)[None].masked_fill(padding[:, None, None, :], float("-inf"))


@pytest.mark.parametrize("mode", ["symmetric", "offset"])
def test_alibi_flash_equals_sdpa_with_the_bias_forward_and_backward(mode):
    offset = {"symmetric": 0.0, "offset": 0.5}[mode]
    b, np_, s, hn = 2, 4, 37, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, np_, s, hn, generator=g, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, np_, s, hn, generator=g)
    slopes = torch.tensor(alibi_slopes(np_))
    padding = torch.zeros(b, s, dtype=torch.bool)
    padding[1, 29:] = True
    for key_padding in (None, padding):
        mask = torch.zeros(b, s, dtype=torch.bool) if key_padding is None else key_padding
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=_bias(slopes, offset, mask, s))
        got = alibi_flash_attention(q, k, v, alibi_terms(slopes, offset, key_padding, s, hn, q.dtype))
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
        for ours, theirs in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=5e-6)


def test_in_fp16_the_padding_column_stays_finite_and_so_do_the_gradients():
    """The padding column is -MASKED / scale (-40,000 at head dim 64 < fp16's 65,504): an inf there would
    make the backward's 0 * column products NaN."""
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, 4, 37, 64, generator=g) for _ in range(4))
    slopes = torch.tensor(alibi_slopes(4))
    padding = torch.zeros(2, 37, dtype=torch.bool)
    padding[1, 29:] = True
    results = {}
    for dtype in (torch.float16, torch.float32):
        inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = alibi_flash_attention(*inputs, alibi_terms(slopes, 0.5, padding, 37, 64, dtype))
        results[dtype] = [out, *torch.autograd.grad(out, inputs, grad.to(dtype))]
    for half, full in zip(results[torch.float16], results[torch.float32]):
        assert torch.isfinite(half).all()
        torch.testing.assert_close(half.float(), full, rtol=0, atol=2e-2)


@pytest.mark.slow
def test_at_2048_positions_its_error_is_sdpas_with_the_bias():
    """The key column travels in three parts of the input dtype (24 bits), so bf16 costs what a bf16
    bias costs (that one rounds only far keys' terms, whose probabilities are 0 anyway); in fp32 the
    large key terms cost ~1e-4. Padded queries (whose outputs nobody reads) are left out."""
    b, np_, s, hn = 1, 12, 2048, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, np_, s, hn, generator=g, dtype=torch.float64) for _ in range(3))
    slopes = torch.tensor(alibi_slopes(np_))
    padding = torch.zeros(b, s, dtype=torch.bool)
    padding[0, 1900:] = True
    bias = _bias(slopes.double(), 0.5, padding, s)
    exact = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)[:, :, :1900]
    errors = {}
    for dtype in (torch.bfloat16, torch.float32):
        q_, k_, v_ = (t.to(dtype) for t in (q, k, v))
        sdpa = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=bias.to(dtype))
        ours = alibi_flash_attention(q_, k_, v_, alibi_terms(slopes, 0.5, padding, s, hn, dtype))
        errors[dtype] = [(t[:, :, :1900].double() - exact).abs().max().item() for t in (sdpa, ours)]
    print(errors)
    assert errors[torch.bfloat16][1] < 2 * errors[torch.bfloat16][0]
    assert errors[torch.float32][1] < 2e-4


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_backend_equals_sdpa_in_padded_and_packed_rows(layout):
    s, np_, hn = 40, 4, 8
    g = torch.Generator().manual_seed(0)
    if layout == "packed":  # samples of 12, 5 and 17 tokens, 6 of padding
        segments = torch.tensor([[0] * 12 + [1] * 5 + [2] * 17 + [-1] * 6])
        padding = segments < 0
    else:
        segments, padding = None, torch.zeros(2, s, dtype=torch.bool)
        padding[1, 33:] = True
    q, k, v = (torch.randn(padding.size(0), np_, s, hn, generator=g) for _ in range(3))
    position = Alibi(np_, "offset", tp_rank=0, tp_size=1)
    sdpa, ours = ATTENTION_BACKENDS["sdpa"](position), AlibiFlashAttention(position, head_dim=hn)
    prepared = ours.prepare(padding, None, segments, torch.float32)
    if layout == "packed":  # gathered per sample as sdpa gathers them: [n, L] key padding, no bias
        assert isinstance(prepared, PackedRows) and prepared.bias.key_extra.shape == (3, np_, 17, 8)
    want = sdpa.attend(q, k, v, sdpa.prepare(padding, None, segments, torch.float32), 0.0, None)
    got = ours.attend(q, k, v, prepared, 0.0, None)
    real = ~padding[:, None, :, None].expand_as(want)
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=2e-6)


def test_a_model_on_alibi_flash_gives_sdpas_loss_and_gradients(world):
    """The zero-clap variant (ALiBi offset, CLAP): padded and packed batches."""
    assert_model_gives_sdpas_loss_and_gradients(world, "alibi-flash")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return tiny_shards(tmp_path_factory, "alibi-flash")


@pytest.mark.slow
def test_the_loop_trains_sdpas_losses_at_tp1_and_tp2_and_compiled(shards, tmp_path):
    assert_loop_trains_sdpas_losses(shards, tmp_path, "alibi-flash")


def test_alibi_flash_refuses_what_it_cannot_compute():
    def problem(*overrides, variant="zero-clap"):
        return AlibiFlashAttention.unsupported_here(variant_config(variant, list(overrides)).model)

    assert problem() is None
    assert "needs model.alibi_mode symmetric or offset" in problem("model.alibi_mode=learned")
    assert "needs model.alibi_mode symmetric or offset" in problem(variant="baseline")  # learned positions
    assert "no local attention and no document mask" in problem("model.document_mask=true")
    assert "with attention dropout needs a CUDA GPU" in problem("model.attention_dropout=0.1")
    cfg = variant_config("zero-clap", ["model.attention_backend=alibi-flash", "model.attention_dropout=0.1"])
    with pytest.raises(ConfigError, match="with attention dropout needs a CUDA GPU"):  # before a run does any work
        check_before_work(cfg, get_objective(cfg))


def test_a_flash_kernel_is_used_only_if_it_matches_the_reference():
    """What a GPU's first use checks of each private flash op; here with stand-ins."""

    class Wrong(ReferenceKernel):
        def forward(self, q, k, v, dropout_p, scale):
            out, lse, state = super().forward(q, k, v, dropout_p, scale)
            return out, lse + 0.5, state  # a log-sum-exp in other units

    class Missing(ReferenceKernel):
        def forward(self, *args):
            raise RuntimeError("aten::_private_op has no such overload")

    class Seeded(ReferenceKernel):  # a state as the CUDA ops return one: tensors (seeds) and sizes
        def forward(self, q, k, v, dropout_p, scale):
            out, lse, _ = super().forward(q, k, v, dropout_p, scale)
            return out, lse, (torch.tensor(q.size(2)), q.size(2))

        def backward(self, grad_out, q, k, v, out, lse, dropout_p, scale, state):
            assert [int(x) for x in state] == [q.size(2)] * 2, state  # each pass gets its own state back
            return super().backward(grad_out, q, k, v, out, lse, dropout_p, scale, state)

    class Undefined(ReferenceKernel):  # the CUDA ops' undefined tensors (cum_seq_q of a dense batch) are None
        def forward(self, q, k, v, dropout_p, scale):
            out, lse, _ = super().forward(q, k, v, dropout_p, scale)
            return out, lse, (None, torch.tensor(q.size(2)), None, q.size(2))

        def backward(self, grad_out, q, k, v, out, lse, dropout_p, scale, state):
            assert state[0] is None and state[2] is None and int(state[1]) == state[3] == q.size(2), state
            return super().backward(grad_out, q, k, v, out, lse, dropout_p, scale, state)

    class Silent(ReferenceKernel):
        def backward(self, *args):
            raise StopIteration  # an error with no message

    cpu = torch.device("cpu")
    assert check_kernel(ReferenceKernel(), cpu) is None
    assert check_kernel(Seeded(), cpu) is None
    assert check_kernel(Undefined(), cpu) is None
    assert check_kernel(Silent(), cpu) == "StopIteration: StopIteration"
    assert "differs from the reference pass" in check_kernel(Wrong(), cpu)
    assert check_kernel(Missing(), cpu) == "RuntimeError: aten::_private_op has no such overload"
    assert isinstance(flash_kernel(cpu), ReferenceKernel)
    assert isinstance(flash_kernel(torch.device("cuda"), torch.float32), ReferenceKernel)  # flash kernels: 16-bit


def test_a_folder_trained_on_it_loads_on_sdpa_where_it_cannot_run(world, tmp_path):
    """A folder's config names the backend its training used; GLUE on a CPU (attention dropout 0.1)
    takes sdpa instead, with a warning, and the same attention. A backend the caller names is kept
    (and refused where it cannot run)."""
    from megamlm.model.folder import write_model_folder
    from megamlm.model.reshard import full_state_dict
    from megamlm.objectives import load_encoder

    cfg = variant_config("zero-clap", ["model.attention_backend=alibi-flash"])
    write_model_folder(tmp_path / "model", cfg, full_state_dict(MaskedLM(cfg.model, world, seed=5)))
    with pytest.warns(UserWarning, match="with attention dropout needs a CUDA GPU.*uses model.attention_backend=sdpa"):
        moved, sdpa = load_encoder(tmp_path / "model", world, ["model.attention_dropout=0.1"])
    assert moved.model.attention_backend == "sdpa"
    kept, ours = load_encoder(tmp_path / "model", world, ["model.attention_dropout=0"])  # runs here
    assert kept.model.attention_backend == "alibi-flash"
    with pytest.raises(ConfigError, match="with attention dropout needs a CUDA GPU"):  # named: kept, so refused
        load_encoder(tmp_path / "model", world, ["model.attention_dropout=0.1", "model.attention_backend=alibi-flash"])
    tokens = torch.randint(4, 1100, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(sdpa(tokens), ours(tokens), rtol=0, atol=1e-5)


def test_a_folder_that_falls_back_to_sdpa_leaves_its_backends_settings_without_a_second_warning(world, tmp_path):
    """A folder trained on flex with its kernel options (GPU only) on a CPU: one warning, the fallback's; the
    options go back to their default with the backend (sdpa would warn that it ignores them)."""
    import warnings
    from pathlib import Path

    import megamlm
    from megamlm.model.folder import write_model_folder
    from megamlm.model.reshard import full_state_dict
    from megamlm.objectives import load_encoder

    cfg = variant_config("zero-clap", ["model.attention_backend=flex", "model.flex_kernel_options=num_warps=4"])
    weights = full_state_dict(MaskedLM(variant_config("zero-clap").model, world, seed=5))  # flex: not on a CPU
    write_model_folder(tmp_path / "model", cfg, weights)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        moved, _ = load_encoder(tmp_path / "model", world)
    package = Path(megamlm.__file__).parent  # (megatron-core warns of its own deprecations)
    assert [str(w.message) for w in caught if Path(w.filename).is_relative_to(package)] == [
        f"{tmp_path / 'model'}: model.attention_backend=flex needs a CUDA GPU (torch 2.13 has no FlexAttention "
        "backward on CPU); use model.attention_backend=sdpa. This run uses model.attention_backend=sdpa instead "
        "(the same attention)"]
    assert (moved.model.attention_backend, moved.model.flex_kernel_options) == ("sdpa", "")
