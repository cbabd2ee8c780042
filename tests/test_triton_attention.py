"""model.attention_backend=triton: our Triton kernels (run by Triton's interpreter on the CPU) give the
eager attention's output and gradients — ALiBi (fixed and learned slopes), padding, documents, packed
samples, sliding windows, and dropout with flex.py's mask — visiting only the blocks a query can see,
and a model on them gives sdpa's loss and gradients, at TP=1 and TP=2."""

import functools
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megamlm.config import ConfigError
from megamlm.data.batch import collate
from megamlm.model.positions import Alibi, PositionEncoding
from megamlm.model.patterns import group_sees
from megamlm.model.triton_attention import (TritonAttention, group_runs, group_spans, materialized_attention,
                                            triton_attention)
from megamlm.objectives import MaskedLM
from tests.backend_parity import (assert_loop_trains_sdpas_losses, assert_model_gives_sdpas_loss_and_gradients,
                                  assert_model_gives_the_references_loss_and_gradients)
from tests.multiproc import run_on_ranks
from tests.test_packing import _no_corruption, _samples
from tests.test_train import _straight_then_resume, _train, config, tiny_shards
from tests.variants import variant_config

pytest.importorskip("triton")  # the dev install has it (setup.py); the package imports without it


def _layer_inputs(b, np_, s, hn, seed=0):
    """q, k, v [b, np, s, hn] as a layer hands them over: views of [s, b, np, 3·hn] (non-contiguous)."""
    g = torch.Generator().manual_seed(seed)
    mixed = torch.randn(s, b, np_, 3 * hn, generator=g)
    return [t.permute(1, 2, 0, 3).requires_grad_() for t in mixed.split(hn, dim=-1)]


def _assert_kernels_give_the_reference(b, np_, s, alibi, groups, p, window=None, atomic_dq=False):
    """Output and dQ, dK, dV against `materialized_attention`; with dropout, another seed another mask."""
    q, k, v = (t.detach().clone().requires_grad_() for t in _layer_inputs(b, np_, s, 16))
    slopes = Alibi(np_, alibi, 0, 1).slopes if alibi else None
    offset = 0.5 if alibi == "offset" else 0.0
    seed = torch.tensor(987654321)
    out = triton_attention(q, k, v, slopes, offset, groups, p, seed if p else None, window=window, atomic_dq=atomic_dq)
    want = materialized_attention(q, k, v, slopes, offset, groups, p, seed, window=window)
    torch.testing.assert_close(out, want, rtol=0, atol=2e-6)
    assert out.permute(2, 0, 1, 3).is_contiguous()  # laid out [s, b, np, hn]: the layer's permute is a view
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got, expected = (torch.autograd.grad(o, (q, k, v), grad) for o in (out, want))
    for ours, theirs in zip(got, expected):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=5e-6)
    if p:  # the mask depends on the seed
        other = triton_attention(q, k, v, slopes, offset, groups, p, seed + 1, window=window)
        assert (other - out).abs().max() > 0.1


def test_the_interpreter_patches_the_language_once_per_launch_with_the_same_results(monkeypatch):
    """`patch_the_language_once_per_launch` (triton_interpreter.py): Triton's interpreter re-patched
    triton.language at each jit helper's call. One forward and backward with dropout and documents: every
    output and gradient bit for bit those of Triton's own patching, in 33 module patch passes where it made 7,228."""
    from triton.runtime import interpreter

    patch, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    assert patch.once_per_launch  # applied on import, as TRITON_INTERPRET=1 (tests/conftest.py) asks
    passes = []
    patch_builtin = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *args: passes.append(1) or patch_builtin(*args))

    def run():
        q, k, v = (t.detach().clone().requires_grad_() for t in _layer_inputs(2, 2, 100, 16))
        out = triton_attention(q, k, v, Alibi(2, "offset", 0, 1).slopes, 0.5, _layout_groups("documents", 100), 0.25,
                               torch.tensor(7))
        return [out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))], len(passes)

    ours, ours_passes = run()
    passes.clear()
    monkeypatch.setattr(interpreter, "_patch_lang", patch.triton_patch)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", launch.triton_launch)
    theirs, their_passes = run()
    for got, expected in zip(ours, theirs):
        assert torch.equal(got, expected)
    assert ours_passes * 10 < their_passes, (ours_passes, their_passes)


@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize("layout", ["whole-rows", "padded", "documents"])
@pytest.mark.parametrize("alibi", ["offset", "symmetric", None])
def test_the_kernels_give_eager_attention_and_its_gradients(alibi, layout, p):
    _assert_kernels_give_the_reference(2, 3, 100, alibi, _layout_groups(layout, 100), p)


def _layout_groups(layout: str, s: int) -> torch.Tensor | None:
    """Two rows' groups: whole rows (None); padded (row 1 from 80 on); documents across the block edge (and the
    padding); packed (`_packed_groups`). 100 positions: two of the interpreter's 64-wide blocks, the second
    partial."""
    if layout == "packed":
        return _packed_groups(s)
    if layout == "whole-rows":
        return None
    groups = torch.zeros(2, s, dtype=torch.int32)
    groups[1, 80:] = -1  # padding
    if layout == "documents":
        groups[0, 11:], groups[0, 70:], groups[1, 5:80] = 1, 2, 1
    return groups


def _packed_groups(s: int) -> torch.Tensor:
    """Row 0: three samples and a free tail; row 1: one sample that ends one past a block edge, then free."""
    groups = torch.full((2, s), -1, dtype=torch.int32)
    groups[0, :70], groups[0, 70:150], groups[0, 150:190], groups[1, :129] = 0, 1, 2, 0
    return groups


@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize("layout", ["whole-rows", "packed"])
def test_one_tensor_holding_q_k_v_gets_the_references_output_and_its_gradient_whole(layout, p):
    """q alone, [b, np, s, 3·hn] (the QKV projection's layout), k and v None: the output of its three
    thirds, and its gradient as the reference's three gradients side by side, laid out as the projection's
    output, so that nothing is copied between it and the projection's backward."""
    g = torch.Generator().manual_seed(2)
    mixed = torch.randn(100 if layout == "whole-rows" else 190, 2, 3, 3 * 16, generator=g, requires_grad=True)
    s = mixed.size(0)
    groups = _layout_groups(layout, s)
    slopes, seed = Alibi(3, "offset", 0, 1).slopes, torch.tensor(987654321)
    out = triton_attention(mixed.permute(1, 2, 0, 3), None, None, slopes, 0.5, groups, p, seed if p else None)
    # [s, b, np, 3 hn] -> 3 x [s, b, np, hn] -> 3 x [b, np, s, hn]
    q, k, v = (t.permute(1, 2, 0, 3) for t in mixed.split(16, -1))
    want = materialized_attention(q, k, v, slopes, 0.5, groups, p, seed)
    torch.testing.assert_close(out, want, rtol=0, atol=2e-6)
    grad = torch.randn(out.shape, generator=g)
    (got,), (expected,) = (torch.autograd.grad(o, mixed, grad) for o in (out, want))
    torch.testing.assert_close(got, expected, rtol=0, atol=5e-6)
    # the op's gradient for q is [b, np, s, 3 hn] laid out [s, b, np, 3 hn]: permuted back, the projection's layout
    assert got.is_contiguous()


@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize(("layout", "window"), [("packed", None), ("whole-rows", 130), ("packed", 130),
                                               ("whole-rows", 252), ("whole-rows", 254)])
def test_the_kernels_visit_only_the_blocks_a_group_or_window_reaches(layout, window, p):
    """Five blocks of 64 per row, most of them out of reach of the others: a block skipped that a query
    sees would change the output or a gradient (ALiBi offset). Edges one position past a block's: the
    sample ending at 129, the window (65 each side) reaching key 63 from query 128. Windows of 126 and
    127 each side: neighbouring blocks (127 apart at most) are whole (unmasked) with the second only."""
    groups = _packed_groups(300) if layout == "packed" else None
    _assert_kernels_give_the_reference(2, 2, 300, "offset", groups, p, window)


@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize(("alibi", "layout", "window"), [
    ("offset", "whole-rows", None), (None, "whole-rows", None), ("symmetric", "documents", None),
    ("offset", "padded", None), ("offset", "packed", None), ("offset", "whole-rows", 130)])
def test_dk_dv_with_queries_along_rows_gives_the_reference(monkeypatch, alibi, layout, window, p):
    """dK/dV's other orientation (`_attention_backward_keys_kernel` TRANSPOSED=False, among the autotuner's
    candidates on a GPU; the interpreter runs the first, keys along rows): score tiles [BM, BN] as the
    forward's, Pᵀ and dSᵀ transposed for the products. The same cases against the reference."""
    _with_dk_dv_orientation(monkeypatch, False)
    s = 300 if layout == "packed" or window else 100
    _assert_kernels_give_the_reference(2, 2 if s == 300 else 3, s, alibi, _layout_groups(layout, s), p, window)


def _with_dk_dv_orientation(monkeypatch, transposed: bool) -> None:
    """The interpreter's one dK/dV configuration with the score tiles' keys (True) or queries along rows."""
    import triton

    from megamlm.model import triton_kernels

    (config,) = triton_kernels._backward_keys.configs
    assert config.kwargs["TRANSPOSED"]  # what the other tests run
    monkeypatch.setattr(triton_kernels._backward_keys, "configs",
                        [triton.Config({**config.kwargs, "TRANSPOSED": transposed}, num_warps=1, num_stages=1)])


@pytest.mark.parametrize("transposed", [True, False], ids=["keys-along-rows", "queries-along-rows"])
@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize(("alibi", "layout", "window"), [
    ("offset", "whole-rows", None), (None, "documents", None), ("offset", "packed", None),
    ("offset", "whole-rows", 130)])
def test_dq_by_atomic_adds_gives_the_reference(monkeypatch, alibi, layout, window, p, transposed):
    """model.triton_dq=atomic: no dQ kernel; the dK/dV kernel adds each block pair's dS · k into an fp32 sum
    (in both of its orientations). The same cases against the reference as the dQ kernel's."""
    from megamlm.model import triton_kernels

    _with_dk_dv_orientation(monkeypatch, transposed)
    monkeypatch.setattr(triton_kernels, "_backward_queries", None)  # a launch of the dQ kernel would fail
    s = 300 if layout == "packed" or window else 100
    _assert_kernels_give_the_reference(2, 2 if s == 300 else 3, s, alibi, _layout_groups(layout, s), p, window,
                                       atomic_dq=True)


@pytest.mark.parametrize("atomic_dq", [False, True], ids=["recompute", "atomic"])
@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize("layout", ["whole-rows", "packed"])
def test_learned_slopes_before_and_after_the_query_get_the_reference_gradient(layout, p, atomic_dq):
    """Learned ALiBi (alibi_mode=learned): slopes [2, np] that differ before and after the query; their
    gradient, summed over every query of every row, against autograd through the materialized bias in
    float64: the slopes' gradient sums 22,500 terms, and an fp32 reference's own rounding (up to 5.5e-6
    here) is as large as the kernels' (up to 7.9e-6). atomic: the dK/dV kernel adds each query's shares."""
    q, k, v = (t.detach().clone().requires_grad_() for t in _layer_inputs(2, 3, 150, 16))
    log_slopes = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -4.0]], requires_grad=True)
    groups = _packed_groups(150) if layout == "packed" else None
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    results = []
    for attention, dtype in ((functools.partial(triton_attention, atomic_dq=atomic_dq), torch.float32),
                             (materialized_attention, torch.float64)):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, log_slopes)]
        out = attention(*leaves[:3], leaves[3].exp(), 0.0, groups, p, torch.tensor(5))
        results.append([out, *torch.autograd.grad(out, leaves, grad.to(dtype))])
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours.double(), theirs, rtol=1e-6, atol=5e-6)
    assert results[0][-1].abs().min() > 1e-3  # every slope has a gradient to get right


@pytest.mark.parametrize("p", [0.0, 0.25])
def test_bf16_kernels_are_as_close_to_the_fp64_reference_as_eager_bf16_attention(p):
    """The GPU's dtype on the interpreter, which keeps bf16 as uint16 bits (`triton_interpreter`): before
    the kernels widened their tiles there, a bf16 output was off by ~1e9 and gradient norms in training
    were ~1e13, without an error. Yardstick: eager attention in bf16 (materialized scores; with dropout, the
    same mask) against the fp64 reference on the same rounded inputs."""
    q, k, v = (t.detach().to(torch.bfloat16) for t in _layer_inputs(2, 3, 100, 16))
    groups = torch.zeros(2, 100, dtype=torch.int32)
    groups[0, 40:], groups[1, 80:] = 1, -1  # two documents; padding
    slopes, seed = Alibi(3, "offset", 0, 1).slopes, torch.tensor(11)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    results = []
    for attention, dtype in ((materialized_attention, torch.float64), (triton_attention, torch.bfloat16),
                             (materialized_attention, torch.bfloat16)):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, slopes, 0.5, groups, p, seed)
        results.append([t.double() for t in (out, *torch.autograd.grad(out, leaves, grad.to(dtype)))])
    reference, ours, eager = results
    for name, r, o, e in zip(("out", "dq", "dk", "dv"), reference, ours, eager):
        ours_error, eager_error = (o - r).abs().max().item(), (e - r).abs().max().item()
        assert ours_error <= eager_error, (name, ours_error, eager_error)
        assert ours_error > 0  # rounded to bf16: not the fp32 kernels' numbers


def test_group_spans_hold_every_pair_a_query_sees():
    groups = torch.tensor([[0, 0, 1, 1, 1, 2, -1, -1],   # packed samples, a free tail
                           [3, 3, 0, 0, 3, -1, 9, 9],    # a group in two pieces; an id above s
                           [-1] * 8])                    # no real token
    spans = group_spans(groups)
    assert spans.tolist() == [[[0, 0, 2, 2, 2, 5, 8, 8], [0, 0, 2, 2, 0, 8, 6, 6], [8] * 8],
                              [[2, 2, 5, 5, 5, 6, 0, 0], [5, 5, 4, 4, 5, 0, 8, 8], [0] * 8]]
    query, key = groups[:, :, None], groups[:, None, :]  # [b, s, 1] vs [b, 1, s]: the kernels' rule
    sees = group_sees(query, key) & (query >= 0)
    row, i, j = sees.nonzero(as_tuple=True)
    assert ((spans[0, row, i] <= j) & (j < spans[1, row, i])).all()  # keys of query i
    assert ((spans[0, row, j] <= i) & (i < spans[1, row, j])).all()  # queries of key j


def test_group_runs_are_the_stretches_of_one_group():
    groups = torch.tensor([[0, 0, 1, 1, 1, 2, -1, -1],   # packed samples, a free tail
                           [3, 3, 0, 0, 3, -1, 9, 9],    # a group in two pieces; an id above s
                           [-1] * 8])                    # no real token
    assert group_runs(groups).tolist() == [[[0, 0, 2, 2, 2, 5, 8, 8], [0, 0, 2, 2, 4, 8, 6, 6], [8] * 8],
                                           [[2, 2, 5, 5, 5, 6, 0, 0], [2, 2, 4, 4, 5, 0, 8, 8], [0] * 8]]


@pytest.mark.parametrize("p", [0.0, 0.25])
def test_whole_blocks_are_whole_runs_not_group_spans(p):
    """A group in two pieces around another: the key block between them lies inside the first query
    block's group span but not in its run, so it keeps its mask (the kernels skip the visibility test
    only for block pairs within one run of equal groups, `group_runs`); row 1: a run that ends one
    position into a block."""
    groups = torch.zeros(2, 256, dtype=torch.int32)
    groups[0, 64:128] = 1
    groups[1, 129:] = 1
    _assert_kernels_give_the_reference(2, 2, 256, "offset", groups, p)


def test_a_query_that_sees_no_key_gets_zeros_and_no_gradient():
    q, k, v = _layer_inputs(1, 2, 20, 16)
    groups = torch.full((1, 20), -1, dtype=torch.int32)  # padding only: no real key anywhere
    out = triton_attention(q, k, v, None, 0.0, groups, 0.0, None)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in (q, k, v))


def test_the_backend_prepares_groups_only_where_a_query_cannot_see_its_whole_row():
    backend = TritonAttention(Alibi(4, "offset", 0, 1))
    padding = torch.zeros(2, 8, dtype=torch.bool)
    prepared = backend.prepare(padding, None, None, torch.float32)
    groups, slopes, offset = prepared.groups, prepared.slopes, prepared.offset
    assert groups is None and torch.equal(slopes, Alibi(4, "offset", 0, 1).slopes) and offset == 0.5
    padding[1, 6:] = True
    groups = backend.prepare(padding, None, None, torch.float32).groups
    assert groups.tolist() == [[0] * 8, [0] * 6 + [-1] * 2]
    segments = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1]] * 2)
    assert backend.prepare(segments < 0, None, segments, torch.float32).groups.tolist() == segments.tolist()
    without_alibi = TritonAttention(PositionEncoding()).prepare(padding, None, None, torch.float32)
    assert (without_alibi.slopes, without_alibi.offset) == (None, 0.0)


def test_triton_refuses_what_it_cannot_compute(world):
    def problem(*overrides, variant="zero-clap"):
        return TritonAttention.unsupported_here(variant_config(variant, ["model.attention_backend=triton",
                                                                        *overrides]).model)

    assert problem() is None and problem(variant="baseline") is None  # ALiBi offset; learned positions
    assert problem("model.alibi_mode=learned") is None  # the slopes' gradient: in the dQ kernel
    assert problem("model.local_window=8", "model.global_every=2") is None  # sliding windows: in the kernels
    assert "has no model.local_attention=bigbird" in problem("model.local_window=8", "model.global_every=2",
                                                             "model.local_attention=bigbird")
    assert "a power of 2 >= 16, not 24" in problem("model.hidden_size=96", "model.num_attention_heads=4")
    with pytest.raises(ConfigError, match="a power of 2 >= 16, not 24"):
        MaskedLM(variant_config("zero-clap", ["model.attention_backend=triton", "model.hidden_size=96",
                                              "model.num_attention_heads=4"]).model, world, seed=1)


def test_attention_dropout_refuses_rows_longer_than_its_hash_folds():
    """The kernels fold a step of the dropout hash into each query's bits, exact for keys below 2^16."""
    q = torch.zeros(1, 1, 2**16 + 1, 16)
    with pytest.raises(ValueError, match="at most 65536 positions, not 65537; use flex or sdpa"):
        triton_attention(q, q, q, None, 0.0, None, 0.1, torch.tensor(1))


def test_the_whole_blocks_loop_issues_fewer_instructions_than_the_masked_one_and_dropout_hashes_pairs():
    """benchmarks/triton_static.py compiles the forward as a training step launches it (sm_90, on this
    CPU) and reads its loops from the SASS: the whole blocks' loop (no visibility test, ALiBi as a key
    and a query term) issues fewer instructions per score than the masked one, in every variant; and the
    dropout mask costs one hash per two scores (keys j, j ^ 8): the dropout variant's whole loop issues
    under 1.75x the ALiBi variant's (~1.5x; one hash per score made it ~2x)."""
    import os
    import re
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "benchmarks/triton_static.py", "--first-only", "--kernels", "forward"],
                         capture_output=True, text=True, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| forward |")]
    assert len(rows) == 3  # ALiBi, + dropout, + groups
    wholes = []
    for row in rows:
        stack, whole, masked = (int(re.search(r", (\d+) B", row).group(1)),
                                *(float(x) for x in re.findall(r"\*\*([\d.]+)\*\*", row)))
        assert stack == 0 and whole < 0.8 * masked, row
        wholes.append(whole)
    assert wholes[1] < 1.75 * wholes[0], rows[:2]


_ORIENTATIONS = """
import torch
from benchmarks.triton_static import compile_sass, launches, loop_costs, loops
launch = launches(8, 2048, 12, 64, torch.bfloat16, 0.0, False)["dK/dV"]
for transposed, block_m, block_n, warps in ((True, 64, 128, 8), (False, 64, 64, 4)):
    config = next(c for c in launch.kernel.configs if c.kwargs == {"BLOCK_M": block_m, "BLOCK_N": block_n,
                  "TRANSPOSED": transposed} and c.num_warps == warps and c.num_stages == 2)
    registers, stack, sass = compile_sass(launch, config, 90)
    masked, *whole = loops(sass)
    print(stack, sum(loop_costs(max(whole, key=len), config)[0].values()))
"""


def test_dk_dv_with_queries_along_rows_issues_fewer_instructions_per_score():
    """Why dK/dV has a second orientation: compiled for sm_90 as a training step launches it (ALiBi), the
    fewest-instruction candidate of each orientation, neither spilling: in the whole blocks' loop queries along
    rows issue fewer instructions per score, each thread's per-query terms being 2 rows', not 16 columns'
    (thread slots per score, 64 x 128 keys along rows against 64 x 64 queries along rows: 15.0 against 12.0
    with Triton 3.6, the leases'; 14.7 against 13.1 with Triton 3.9; with the recipe's attention dropout
    21.5 against 19.1 and 20.7 against 20.0). The GPU's autotuner times both."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _ORIENTATIONS], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert run.returncode == 0, run.stderr[-2000:]
    (keys_stack, keys_rows), (queries_stack, queries_rows) = (line.split() for line in run.stdout.splitlines())
    assert keys_stack == queries_stack == "0"
    assert float(queries_rows) < 0.92 * float(keys_rows), run.stdout


_ATOMIC_DQ = """
import torch
from benchmarks.triton_static import ATOMIC, compile_sass, launches, loop_costs, loops
step = launches(8, 2048, 12, 64, torch.bfloat16, 0.1, True)
for name in ("dK/dV", "dQ", ATOMIC):
    config = step[name].kernel.configs[0]
    registers, stack, sass = compile_sass(step[name], config, 90)
    masked, *whole = loops(sass)
    body = max(whole, key=len)
    print(name, stack, sum(loop_costs(body, config)[0].values()), sum(op.startswith("RED") for op in body),
          sum(op.startswith("ATOM") for op in body))
"""


def test_dq_by_atomic_adds_issues_a_quarter_fewer_instructions_per_score_than_the_two_kernels():
    """Why model.triton_dq=atomic: compiled for sm_90 as a training step launches it (the recipe's variant:
    ALiBi, dropout 0.1, packed rows), each kernel's first candidate, none spilling: the one backward kernel's
    whole blocks' loop issues under 0.8x the instructions per score of the dK/dV and dQ kernels' together
    (30.1 against 24.6 + 15.9 with Triton 3.9), its dQ share going out as vectorized reductions (RED, no
    ATOM compare-and-swap loop)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _ATOMIC_DQ], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert run.returncode == 0, run.stderr[-2000:]
    (_, *keys), (_, *queries), (_, *atomic) = (line.split() for line in run.stdout.splitlines())
    assert keys[0] == queries[0] == atomic[0] == "0", run.stdout  # no stack: nothing spilled
    assert float(atomic[1]) < 0.8 * (float(keys[1]) + float(queries[1])), run.stdout
    assert int(atomic[2]) > 0 and atomic[3] == "0" and keys[2] == queries[2] == "0", run.stdout


_COMPILE_HOOK = """
import warnings, torch
from benchmarks.triton_static import launches
launch = launches(2, 256, 2, 64, torch.bfloat16, 0.1, True)["forward"]
tuner = launch.kernel
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    kept = tuner.early_config_prune(tuner.configs, dict(zip(tuner.arg_names, launch.args)), grid=launch.grid,
                                    warmup=False, **launch.constants)
assert kept is tuner.configs and len(kept) == 5, kept
assert torch.cuda.is_available() or any("compile one by one" in str(w.message) for w in caught), caught
print("ok")
"""


def test_compiling_the_candidates_at_once_prunes_none_and_falls_back_to_one_by_one():
    """The autotuner's hook (`triton_autotune.compile_at_once`) returns every candidate; where it cannot
    compile them (here: no GPU driver) it warns and leaves the compiling to the autotuner."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_HOOK], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_every_launch_of_our_kernels_asks_for_fp_contraction(monkeypatch):
    """Triton 3.10 turns floating-point contraction (FMA) off by default (3.9 warns): each of our five kernels
    (attention forward, dK/dV, dQ; the FFN's bias + activation forward and backward) is launched with
    `COMPILE_OPTIONS` (contraction on), however Triton's autotuner is reached."""
    import triton

    from megamlm.model import triton_bias_activation
    from megamlm.model.triton_autotune import COMPILE_OPTIONS

    launched = {}
    run = triton.runtime.Autotuner.run

    def recording(self, *args, **kwargs):
        launched[self.fn.__name__] = {key: kwargs.get(key) for key in COMPILE_OPTIONS}
        return run(self, *args, **kwargs)

    monkeypatch.setattr(triton.runtime.Autotuner, "run", recording)
    q, k, v = _layer_inputs(1, 2, 64, 16)
    out = triton_attention(q, k, v, Alibi(2, "offset", 0, 1).slopes, 0.5, torch.zeros(1, 64, dtype=torch.int32),
                           0.1, torch.tensor(3))
    out.sum().backward()
    pre, bias = torch.randn(4, 64), torch.randn(64)
    triton_bias_activation.forward(pre, bias, "gelu", torch.empty_like(pre))
    triton_bias_activation.backward(torch.randn(4, 64), pre, bias, "gelu", torch.empty_like(pre))
    assert launched == dict.fromkeys(["_attention_forward_kernel", "_attention_backward_keys_kernel",
                                      "_attention_backward_queries_kernel", "_bias_activation_forward_kernel",
                                      "_bias_activation_backward_kernel"], COMPILE_OPTIONS)


_CONTRACTION = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from benchmarks.triton_static import compile_sass, launches, specialize
launch = launches(2, 256, 2, 64, torch.bfloat16, 0.1, True)["forward"]
config = launch.kernel.configs[0]
_, _, sass = compile_sass(launch, config, 90)  # with COMPILE_OPTIONS, as every launch
signature, constexprs, attrs = specialize(launch, config)
default = triton.compile(ASTSource(fn=launch.kernel.fn, signature=signature, constexprs=constexprs, attrs=attrs),
                         target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": config.num_warps, "num_stages": config.num_stages})
print(sass.count("FFMA"), default.asm["ptx"].count("fma.rn.f32"))
"""


@pytest.mark.slow
def test_the_kernels_keep_their_fmas_where_tritons_default_turns_contraction_off():
    """With Triton's default set to no contraction (TRITON_DEFAULT_FP_FUSION=0, Triton 3.10's), the attention
    forward compiled for sm_90 with `COMPILE_OPTIONS` still has its FMAs; compiled with the default it has none."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "0"}
    run = subprocess.run([sys.executable, "-c", _CONTRACTION], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert run.returncode == 0, run.stderr[-2000:]
    ours, default = (int(n) for n in run.stdout.split())
    assert ours > 50 and default == 0, run.stdout


def test_a_model_on_triton_gives_sdpas_loss_and_gradients(world):
    """The zero-clap variant (ALiBi offset, CLAP): padded and packed batches."""
    assert_model_gives_sdpas_loss_and_gradients(world, "triton")


def test_a_learned_alibi_model_on_triton_gives_sdpas_loss_and_gradients(world):
    """alibi_mode=learned: the log-slopes' gradient (every layer's share) is a parameter's gradient."""
    assert_model_gives_sdpas_loss_and_gradients(world, "triton", "alibi-learned")


def test_a_learned_alibi_model_with_dq_by_atomic_adds_gives_sdpas_loss_and_gradients(world):
    """model.triton_dq=atomic, with learned slopes (their gradient's shares added in the dK/dV kernel too)."""
    assert_model_gives_the_references_loss_and_gradients(
        world, ("model.attention_backend=triton", "model.triton_dq=atomic"), "model.attention_backend=sdpa",
        "alibi-learned")


def test_triton_dq_on_another_backend_warns_that_it_is_ignored():
    import warnings

    from megamlm.model.backends import ATTENTION_BACKENDS

    atomic = variant_config("zero-clap", ["model.triton_dq=atomic"]).model
    with pytest.warns(UserWarning, match="^model.triton_dq='atomic' applies to model.attention_backend=triton only; "
                                         "the sdpa backend ignores it$"):
        ATTENTION_BACKENDS["sdpa"].from_config(atomic, Alibi(atomic.num_attention_heads, "offset", 0, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backend = ATTENTION_BACKENDS["triton"].from_config(atomic, Alibi(atomic.num_attention_heads, "offset", 0, 1))
    assert backend.atomic_dq


def test_dq_by_atomic_adds_is_refused_where_torch_is_asked_for_deterministic_algorithms():
    atomic = variant_config("zero-clap", ["model.attention_backend=triton", "model.triton_dq=atomic"]).model
    recompute = variant_config("zero-clap", ["model.attention_backend=triton"]).model
    assert TritonAttention.unsupported_here(atomic) is None
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert TritonAttention.unsupported_here(atomic) == (
            "model.triton_dq=atomic sums dQ in an order that varies from run to run, and "
            "torch.use_deterministic_algorithms(True) is set; use model.triton_dq=recompute")
        assert TritonAttention.unsupported_here(recompute) is None
    finally:
        torch.use_deterministic_algorithms(was)


def test_a_local_global_model_on_triton_gives_sdpas_loss_and_gradients(world):
    """ModernBERT's recipe (RoPE, a global then a windowed layer): the window in the kernels."""
    assert_model_gives_sdpas_loss_and_gradients(world, "triton", "modernbert")


class _Concatenations(TorchDispatchMode):
    """The shapes of the aten.cat results of what runs under it."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.cat:
            self.shapes.append(tuple(out.shape))
        return out


def test_a_layer_on_triton_concatenates_no_gradient_of_the_qkv_projection(world):
    """The layers hand the core attention the QKV projection unsplit (UnsplitQKVSelfAttention): sdpa's
    backward concatenates the three gradients of its split, [b, np, s, 3·hn] per layer; our kernels write
    them in that layout, and the backward concatenates nothing."""
    samples = [(s, i) for i, s in enumerate(_samples(200))]
    batch = collate(samples, _no_corruption, 0, 16, pad_id=1)
    cats = {}
    for backend in ("sdpa", "triton"):
        cfg = variant_config("zero-clap", [f"model.attention_backend={backend}"]).model
        model = MaskedLM(cfg, world, seed=3)
        loss = model(batch.inputs, batch.target_index, batch.documents, batch.segments, targets=batch.targets).mean()
        with _Concatenations() as spy:
            loss.backward()
        cats[backend] = spy.shapes
    b, s = batch.inputs.shape
    assert [math.prod(shape) for shape in cats["sdpa"]] == [b * s * 3 * cfg.hidden_size] * cfg.num_layers
    assert cats["triton"] == []


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return tiny_shards(tmp_path_factory, "triton")


@pytest.mark.slow
def test_the_loop_trains_sdpas_losses_at_tp1_and_tp2_and_compiled(shards, tmp_path):
    """The kernels are one custom op inside train.compile's compiled layers."""
    assert_loop_trains_sdpas_losses(shards, tmp_path, "triton")


@pytest.mark.slow
def test_attention_dropout_on_triton_resumes_the_uninterrupted_losses(shards, tmp_path):
    """The masks' seeds come from the TP stream, which a checkpoint keeps: a run killed after its
    checkpoint and resumed continues the uninterrupted run's losses bit for bit."""

    def run(name):
        return config(shards, tmp_path / name, "model.attention_backend=triton", "model.attention_dropout=0.1",
                      "train.save_interval=2", "train.steps=4", variant="zero-clap")

    with pytest.raises(RuntimeError, match="died without a result"):
        run_on_ranks(_train, 1, run("killed"), None, 3)  # killed during update 3; last checkpoint: 2
    (full, resumed), = run_on_ranks(_straight_then_resume, 1, run("straight"), run("killed"))
    assert len(full["losses"]) == 4 and resumed["losses"] == full["losses"][2:]
