"""model.head_loss=fused: the head's projection fused with the vocab-parallel cross-entropy equals the
unfused path (loss and every gradient, fp32: 1e-6), chunk by chunk, at TP=1 and TP=2, in the training
loop, and never forms a tensor of the logits' size."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megamlm.config import ParallelConfig
from megamlm.model.head_loss import fused_vocab_parallel_cross_entropy
from megamlm.model.heads import vocab_padding_bias
from megamlm.model.reshard import full_state_dict
from megamlm.objectives import MaskedLM
from megamlm.objectives.mlm import vocab_parallel_loss
from megamlm.parallel import init_distributed, seed_everything
from tests.multiproc import run_on_ranks
from tests.test_model import batch
from tests.test_train import _train, config, tiny_shards
from tests.variants import variant_config


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return tiny_shards(tmp_path_factory, "head-loss")


def _operands(n=23, h=16, vocab=300, vocab_local=320, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=torch.float64).float().requires_grad_()
    weight = torch.randn(vocab_local, h, generator=g).requires_grad_()
    bias = (torch.randn(vocab_local, generator=g) + vocab_padding_bias(0, vocab_local, vocab)).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=g)
    return x, weight, bias, targets


@pytest.mark.parametrize("chunk_rows", [1, 5, 23, 1000])
def test_fused_equals_unfused_loss_and_gradients(world, chunk_rows):
    chunk_elements = chunk_rows * 320
    x, weight, bias, targets = _operands()
    want = vocab_parallel_loss(torch.nn.functional.linear(x, weight, bias), targets, "sum")
    want_grads = torch.autograd.grad(want * 0.37, (x, weight, bias))
    got = fused_vocab_parallel_cross_entropy(x, weight, bias, targets, 0, None, chunk_elements)
    got_grads = torch.autograd.grad(got * 0.37, (x, weight, bias))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for name, a, b in zip(("x", "weight", "bias"), got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
    assert torch.all(got_grads[2][300:] == 0)  # vocabulary padding gets no gradient


def test_without_gradients_only_the_loss_is_computed(world):
    x, weight, bias, targets = _operands()
    with torch.no_grad():
        got = fused_vocab_parallel_cross_entropy(x, weight, bias, targets, 0, None, 4 * 320)
    want = vocab_parallel_loss(torch.nn.functional.linear(x, weight, bias), targets, "sum")
    torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6)
    assert not got.requires_grad


def test_no_masked_positions_gives_zero_loss_and_gradients():
    x, weight, bias, targets = _operands(n=0)
    loss = fused_vocab_parallel_cross_entropy(x, weight, bias, targets, 0, None, 1 << 21)
    loss.backward()
    assert loss.item() == 0 and weight.grad.abs().sum() == 0 and bias.grad.abs().sum() == 0


def _both_cross_entropies(tp):
    """{dtype: (losses, gradient) of megatron-core's vocab-parallel cross-entropy (on its fp32 copy of the logits,
    as megamlm called it) and of `vocab_parallel_loss`} on this rank's shard of one set of logits (V = 300 padded
    to 320 with -inf), and ours without gradients."""
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy as megatron_core

    ctx = init_distributed(ParallelConfig(tensor_parallel=tp))
    _, _, bias, targets = _operands(n=37, vocab_local=320)
    g = torch.Generator().manual_seed(3)
    full = torch.randn(37, 320, generator=g) * 4 + bias.detach()  # [n, V] with the padding's -inf columns
    shard = full.chunk(tp, dim=-1)[ctx.tp_rank]
    weights = torch.rand(37, generator=g)  # an incoming gradient other than ones
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        got = []
        for loss in (lambda x: megatron_core(x.to(torch.float32, copy=True), targets),
                     lambda x: vocab_parallel_loss(x, targets, "none")):
            logits = shard.to(dtype).clone().requires_grad_()
            losses = loss(logits)
            (losses * weights).sum().backward()
            got.append((losses.detach(), logits.grad))
        with torch.no_grad():
            got.append(vocab_parallel_loss(shard.to(dtype), targets, "none"))
        results[dtype] = got
    return results


@pytest.mark.parametrize("tp", [1, 2])
def test_the_unfused_loss_is_megatron_cores_cross_entropy_bit_for_bit(tp):
    """megamlm's vocab-parallel cross-entropy (no fp32 copy of fp32 logits, the max without indices) gives
    megatron-core's losses and logits' gradient exactly, for fp32 and bf16 logits, on each TP shard."""
    for rank, results in enumerate(run_on_ranks(_both_cross_entropies, tp, tp)):
        for dtype, ((want, want_grad), (got, got_grad), no_grad) in results.items():
            assert torch.equal(got, want) and torch.equal(no_grad, want), (rank, dtype)
            assert got_grad.dtype == dtype and torch.equal(got_grad, want_grad), (rank, dtype)


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operator returns."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("head_loss", ["unfused", "fused"])
def test_fused_never_forms_a_tensor_of_the_logits_size(world, head_loss):
    cfg = variant_config("baseline", [f"model.head_loss={head_loss}", f"model.head_loss_chunk={16 * 1152}"])
    model = MaskedLM(cfg.model, world, seed=1)
    tokens, masked = batch(cfg.model.vocab_size, lengths=(64, 64, 64, 64))
    n, vocab_local = int(masked.sum()), model.padded_vocab_size
    mode = _LargestTensor()
    with mode:
        model(tokens, masked, targets=tokens[masked]).sum().backward()
    if head_loss == "unfused":
        assert mode.largest == n * vocab_local
    else:  # the table and its gradient ([V_local, h]) are the largest
        assert mode.largest == vocab_local * cfg.model.hidden_size < n * vocab_local


def _model_step(head_loss, variant, tp):
    ctx = init_distributed(ParallelConfig(tensor_parallel=tp))
    seed_everything(5, ctx)
    cfg = variant_config(variant, [f"model.head_loss={head_loss}"])
    model = MaskedLM(cfg.model, ctx, seed=11)
    tokens, masked = batch(cfg.model.vocab_size)
    loss = model(tokens, masked, targets=tokens[masked])
    (loss / masked.sum()).sum().backward()
    return {"loss": loss.detach(), "grads": full_state_dict(model, grads=True)}


def _all_steps():
    return {(head_loss, variant, tp): _model_step(head_loss, variant, tp)
            for tp in (1, 2) for variant in ("baseline", "zero-clap", "untied")
            for head_loss in ("unfused", "fused")}


def test_fused_tp2_equals_unfused_tp1_for_both_heads():
    results, _ = run_on_ranks(_all_steps, 2)
    for variant in ("baseline", "zero-clap", "untied"):
        want = results[("unfused", variant, 1)]
        for tp in (1, 2):
            got = results[("fused", variant, tp)]
            torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-6, atol=1e-5)
            assert got["grads"].keys() == want["grads"].keys()
            for key in want["grads"]:
                torch.testing.assert_close(got["grads"][key], want["grads"][key], rtol=1e-5, atol=1e-6,
                                           msg=f"{variant} TP={tp} {key}")


def _runs(cfgs):
    return [_train(cfg) for cfg in cfgs]


@pytest.mark.slow
def test_training_with_the_fused_loss_follows_the_unfused_curve_under_zero3_and_tp2(shards, tmp_path):
    common = ["train.global_batch_size=8", "train.steps=6", "model.hidden_dropout=0", "model.attention_dropout=0"]
    fused = [*common, "model.head_loss=fused", "model.head_loss_chunk=2000"]  # one position per chunk
    (unfused,) = run_on_ranks(_runs, 1, [config(shards, tmp_path / "unfused", *common)])[0]
    zero3, tp2 = run_on_ranks(_runs, 2, [config(shards, tmp_path / "zero3", *fused, "train.zero_stage=3"),
                                         config(shards, tmp_path / "tp2", *fused, "parallel.tensor_parallel=2")])[0]
    assert len(unfused["losses"]) == 6 and unfused["losses"][-1] < unfused["losses"][0]
    for name, run in (("ZeRO-3 DP=2", zero3), ("TP=2", tp2)):
        assert max(abs(a - b) for a, b in zip(run["losses"], unfused["losses"])) < 1e-4, name
