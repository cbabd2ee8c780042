"""The encoder on one process: an independent oracle (Hugging Face), invariances, heads, sizes."""

import pytest
import torch
import torch.nn.functional as F

from megamlm.config import load_config
from megamlm.convert.hf import hf_to_megamlm
from megamlm.model.norm import l2_normalize
from megamlm.model.reshard import load_full_state_dict
from megamlm.objectives import MaskedLM
from tests.variants import CONFIGS, VARIANTS, variant_config

PAD = 1


def batch(vocab: int, lengths=(16, 11, 7), seed: int = 0):
    """Right-padded token ids [b, s] starting with <s> and masked positions [b, s]."""
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    tokens = torch.full((len(lengths), s), PAD)
    for row, n in enumerate(lengths):
        tokens[row, :n] = torch.randint(4, vocab, (n,), generator=g)
        tokens[row, 0] = 0
    masked = (torch.rand(tokens.shape, generator=g) < 0.3) & tokens.ne(PAD)
    masked[:, 1] = True
    return tokens, masked


def test_baseline_matches_huggingface_roberta(world):
    transformers = pytest.importorskip("transformers")
    cfg = variant_config("baseline")
    m = cfg.model
    hf_cfg = transformers.RobertaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads, intermediate_size=m.ffn_hidden_size,
        max_position_embeddings=m.max_positions + 2, type_vocab_size=1, layer_norm_eps=1e-5,
        hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        pad_token_id=PAD, bos_token_id=0, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.RobertaForMaskedLM(hf_cfg).eval()
    with torch.no_grad():  # move every parameter off its trivial init (LN 1/0, zero biases)
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ours = MaskedLM(m, world, seed=123).eval()
    load_full_state_dict(ours, hf_to_megamlm(hf.state_dict(), m))

    tokens, masked = batch(m.vocab_size)
    with torch.no_grad():
        want = hf(input_ids=tokens, attention_mask=tokens.ne(PAD)).logits[masked]
        got = ours.gather_logits(ours(tokens, masked))
    assert got.shape == want.shape == (int(masked.sum()), m.vocab_size)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # the loader's flat (b, s) indices select the same positions in the same order
    with torch.no_grad():
        by_index = ours.gather_logits(ours(tokens, masked.flatten().nonzero().squeeze(1)))
    torch.testing.assert_close(by_index, want, rtol=0, atol=1e-5)
    # the loss is the standard cross-entropy over the real vocabulary
    with torch.no_grad():
        loss = ours.loss(ours(tokens, masked), tokens[masked])
    torch.testing.assert_close(loss, F.cross_entropy(want, tokens[masked]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_padding_does_not_change_real_positions(world, variant):
    cfg = variant_config(variant)
    model = MaskedLM(cfg.model, world, seed=7).eval()
    tokens, _ = batch(cfg.model.vocab_size, lengths=(16, 10))
    alone = tokens[1:, :10]
    with torch.no_grad():
        padded_logits = model(tokens)[1, :10]
        alone_logits = model(alone)[0]
    torch.testing.assert_close(padded_logits, alone_logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", ["baseline", "zero-clap"])
def test_masked_only_projection_equals_full_projection(world, variant):
    cfg = variant_config(variant)
    model = MaskedLM(cfg.model, world, seed=3).eval()
    tokens, masked = batch(cfg.model.vocab_size)
    with torch.no_grad():
        full = model(tokens)  # every position, [b, s, vocab_size]
        only = model(tokens, masked)  # [n, V_local]
    assert full.shape == (*tokens.shape, cfg.model.vocab_size)
    assert only.shape[0] == int(masked.sum()) < tokens.numel()
    torch.testing.assert_close(only[:, : cfg.model.vocab_size], full[masked], rtol=0, atol=1e-6)


def test_padded_vocabulary_columns_take_no_probability(world):
    cfg = variant_config("baseline")
    model = MaskedLM(cfg.model, world).eval()
    tokens, masked = batch(cfg.model.vocab_size)
    logits = model(tokens, masked)
    assert model.padded_vocab_size == 1152 and logits.shape[-1] == 1152
    probs = torch.softmax(logits, dim=-1)
    assert probs[:, cfg.model.vocab_size:].sum() == 0
    loss = model.loss(logits, tokens[masked])
    loss.backward()
    assert torch.isfinite(loss)
    grad = model.embedding.word_embeddings.weight.grad
    assert grad[cfg.model.vocab_size:].abs().sum() == 0


def test_clap_head_is_beta_times_normalized_embedding_product(world):
    cfg = variant_config("learned-clap")
    model = MaskedLM(cfg.model, world).eval()
    with torch.no_grad():
        model.lm_head.beta.fill_(1.7)
    tokens, masked = batch(cfg.model.vocab_size)
    with torch.no_grad():
        h = model.hidden_states(tokens).transpose(0, 1)[masked]  # [n, h], not normalized
        table = model.embedding.word_embeddings.weight[: cfg.model.vocab_size]
        want = 1.7 * h @ F.normalize(table, dim=-1).T
        got = model.gather_logits(model(tokens, masked))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_l2_normalize_is_f_normalize_forward_and_backward(dtype):
    """CLAP's row normalization with its closed-form backward (model/norm.py): the forward is
    F.normalize's bit for bit, the gradient autograd's through F.normalize (fp32: 1e-6; 16 bits: to
    rounding, against float64), zero rows (the vocab-parallel padding) included."""
    torch.manual_seed(0)
    x = torch.randn(300, 64) * torch.rand(300, 1) * 0.1
    x[[3, 17]] = 0  # padding rows: the norm is clamped to eps
    g = torch.randn(300, 64)
    g[[3, 17]] *= 1e-6  # g / eps stays finite in fp16 (in the model the padding columns' gradients are 0)
    eps = max(1e-12, torch.finfo(dtype).tiny)
    ours, theirs, exact = (x.to(d).clone().requires_grad_() for d in (dtype, dtype, torch.float64))
    y = l2_normalize(ours)
    assert torch.equal(y, F.normalize(theirs, dim=-1, eps=eps))
    y.backward(g.to(dtype))
    F.normalize(theirs, dim=-1, eps=eps).backward(g.to(dtype))
    F.normalize(exact, dim=-1, eps=eps).backward(g.double())
    assert torch.isfinite(ours.grad).all()
    if dtype == torch.float32:
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-6, atol=1e-6 * theirs.grad.abs().max().item())
    rows = [i for i in range(300) if i not in (3, 17)]  # clamped rows: g / eps, exactly in both
    assert torch.equal(ours.grad[[3, 17]], theirs.grad[[3, 17]])
    error = lambda grad: ((grad[rows].double() - exact.grad[rows]).norm() / exact.grad[rows].norm()).item()  # noqa: E731
    # 16 bits: a rounding more or less than autograd's chain (fp16: 4.8e-4 against 4.2e-4, its unit roundoff 4.9e-4)
    assert error(ours.grad) <= 1.5 * error(theirs.grad) + 1e-7, (error(ours.grad), error(theirs.grad))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_trains_with_16_bit_parameters(world, variant, dtype):
    """As DeepSpeed runs bf16 / fp16 (the Pile configs' precision): parameters cast, buffers not. The
    loss and every gradient stay finite and the loss is the fp32 model's to 16-bit rounding. Before:
    CLAP's F.normalize turned the zero vocabulary padding rows into NaN logits in fp16 (its eps, 1e-12,
    is 0 there), and the sinusoidal table (an fp32 buffer) carried fp32 into the bf16 layers."""
    cfg = variant_config(variant)
    model = MaskedLM(cfg.model, world).eval()
    assert model.embedding.word_embeddings.weight[cfg.model.vocab_size:].abs().sum() == 0  # 1100 -> 1152 rows
    tokens, masked = batch(cfg.model.vocab_size)
    with torch.no_grad():
        want = model.loss(model(tokens, masked), tokens[masked])
    for param in model.parameters():
        param.data = param.data.to(dtype)
    got = model.loss(model(tokens, masked), tokens[masked])
    got.backward()
    assert torch.isfinite(got) and abs(got.item() - want.item()) / want.item() < 1e-2, (got, want)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_zero_clap_embeds_the_mask_as_zero_vector(world):
    cfg = variant_config("zero-clap")
    vocab = cfg.model.vocab_size
    model = MaskedLM(cfg.model, world).eval()
    tokens, _ = batch(vocab)
    tokens[:, 3] = vocab  # the mask id is the dictionary size
    padding = tokens.eq(PAD)
    with torch.no_grad():
        x = model.embedding(tokens, padding)  # [s, b, h]
        assert x[3].abs().sum() == 0
        assert x[4].abs().sum() > 0
        torch.testing.assert_close(x[2].norm(dim=-1), torch.full((3,), cfg.model.hidden_size ** 0.5))
        before = model(tokens)
        model.embedding.word_embeddings.weight[vocab - 1] += 1.0  # the row the mask id clamps to
        after = model(tokens)
    # only the logit columns of the edited row change; the mask position's input does not
    torch.testing.assert_close(before[..., : vocab - 1], after[..., : vocab - 1])


def test_flex_backend_refuses_cpu_with_a_clear_message(world):
    cfg = variant_config("alibi", ["model.attention_backend=flex"])
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="attention_backend=flex needs a CUDA GPU"):
        MaskedLM(cfg.model, world)


@pytest.mark.parametrize("size,expected_millions", [("base", 125), ("large", 355)])
def test_parameter_counts_of_presets(world, size, expected_millions):
    transformers = pytest.importorskip("transformers")
    cfg = load_config([CONFIGS / "model" / f"{size}.yaml", CONFIGS / "variants/baseline.yaml"])
    m = cfg.model
    model = MaskedLM(m, world)
    count = model.parameter_count()
    print(f"\nroberta.{size}: {count:,} parameters ({count / 1e6:.1f}M)")
    with torch.device("meta"):
        hf = transformers.RobertaForMaskedLM(transformers.RobertaConfig(
            vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_attention_heads, intermediate_size=m.ffn_hidden_size,
            max_position_embeddings=m.max_positions + 2, type_vocab_size=1))
    hf_count = sum(p.numel() for p in hf.parameters())
    # identical architecture; HF also has a one-row token-type table that RoBERTa never varies
    assert count == hf_count - m.hidden_size
    assert round(count / 1e6) == expected_millions


@pytest.mark.parametrize("variant", ["alibi", "no-positions"])
def test_document_mask_keeps_attention_within_packed_documents(world, variant):
    """ALiBi / no positions are shift-invariant: with model.document_mask, document B packed after
    document A gets exactly the logits B gets alone; without it, A leaks into B."""
    from megamlm.data.tokenizer import EOS

    cfg = variant_config(variant, ["model.document_mask=true"])
    model = MaskedLM(cfg.model, world, seed=3).eval()
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(4, cfg.model.vocab_size, (n,), generator=g) for n in (9, 12))
    a[-1] = b[-1] = EOS
    packed = torch.cat([torch.tensor([0]), a, b])[None]  # <s> A </s> B </s>
    documents = torch.cat([torch.zeros(1 + len(a), dtype=torch.long), torch.ones(len(b), dtype=torch.long)])[None]
    with torch.no_grad():
        together = model(packed, documents=documents)[0, 1 + len(a):]
        alone = model(b[None], documents=torch.zeros(1, len(b), dtype=torch.long))[0]
        leaking = model(packed)[0, 1 + len(a):]  # no documents given: attention spans the sample
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-5)
    assert (leaking - alone).abs().max() > 1e-3


def test_stream_marks_documents_from_the_unmasked_text(tmp_path):
    from megamlm.data.masking import Masker
    from megamlm.data.shards import BuildOptions, build_shards
    from megamlm.data.stream import MaskedBatches, ShardSet
    from megamlm.data.tokenizer import EOS, Tokenizer

    text = tmp_path / "docs.txt"
    text.write_text("".join(f"Document number {i} says hello.\n\n" for i in range(40)))
    tokenizer = Tokenizer.gpt2()
    build_shards(BuildOptions([str(text)], str(tmp_path / "shards"), seq_length=64, valid_fraction=0.0),
        tokenizer, progress=False)
    masker = Masker(tokenizer.dictionary.mask_id, tokenizer.dictionary.ordinary_ids(), mask_prob=0.5)
    batch = next(iter(MaskedBatches(ShardSet(tmp_path / "shards"), masker, seq_length=64, micro_batch=2)))
    original = batch.inputs.clone()
    original[batch.target_mask] = batch.targets  # the text before masking
    for row in range(2):
        docs = batch.documents[row]
        assert (docs >= 0).sum() == original[row].ne(1).sum() and docs.max() >= 1  # several documents
        # a new document starts right after every </s> (also where the </s> itself was masked)
        for end in (original[row] == EOS).nonzero().flatten()[:-1].tolist():
            assert docs[end + 1] == docs[end] + 1


@pytest.mark.parametrize("variant,checkpointing,tp_peers", [("alibi", False, False), ("modernbert", False, False),
                                                            ("alibi", True, False), ("alibi", True, True)])
def test_compiled_layers_give_the_eager_outputs_and_gradients(world, variant, checkpointing, tp_peers, monkeypatch):
    # modernbert: RoPE, a global and a windowed layer; checkpointing: both recomputed in the backward;
    # tp_peers: the tensor-parallel stream serves 2 ranks, so checkpointing replays it (uncompiled)
    from megamlm.parallel import tensor_parallel_rng
    from megamlm.train.layers import apply_activation_checkpointing, compile_layers

    if tp_peers:
        monkeypatch.setattr(tensor_parallel_rng, "tp_size", 2)
    cfg = variant_config(variant, ["model.num_layers=1"] if variant == "alibi" else [])
    tokens, masked = batch(cfg.model.vocab_size)
    results = []
    for compiled in (False, True):
        model = MaskedLM(cfg.model, world, seed=3)
        if checkpointing:
            apply_activation_checkpointing(model)
        if compiled:
            compile_layers(model)
        loss = model.loss(model(tokens, masked), tokens[masked])
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-5)
    assert compiled_grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("variant,checkpointing,overrides", [
    ("baseline", False, []), ("zero-clap", False, []), ("modernbert", False, []), ("baseline", True, []),
    ("zero-clap", False, ["model.bias_activation=triton"])])
def test_each_compiled_layer_is_traced_without_a_graph_break(world, variant, checkpointing, overrides):
    """torch.compile fuses only within a graph: a call it cannot trace splits the layer there and runs
    it eagerly. megatron-core 0.16's RowParallelLinear split every layer twice (warnings.warn on each
    forward; model/layer.py passes the group); with activation checkpointing the layers ran uncompiled
    (train/layers.py). model.bias_activation=triton's custom ops are opaque, not breaks. Dropout is off
    here: the CPU dropout mask (random_) is a break of its own."""
    from torch._dynamo.utils import counters

    from megamlm.train.layers import apply_activation_checkpointing, compile_layers

    cfg = variant_config(variant, overrides)
    tokens, masked = batch(cfg.model.vocab_size)
    model = MaskedLM(cfg.model, world, seed=3)
    if checkpointing:
        apply_activation_checkpointing(model)
    compile_layers(model)
    torch._dynamo.reset()
    counters.clear()
    model.loss(model(tokens, masked), tokens[masked]).backward()
    assert counters["stats"]["calls_captured"] > 0  # the layers were compiled
    assert not counters["graph_break"], "\n".join(reason.splitlines()[0] for reason in counters["graph_break"])


@pytest.mark.slow
def test_a_compiled_layer_is_compiled_once_for_a_single_row_batch(world):
    """Packed rows are batches of one row. The embedding's [b, s, h] -> [s, b, h] kept the transpose's
    strides there (a size-1 dimension counts as contiguous), every layer's output has the standard ones,
    and Dynamo guards on strides: layer 0 got a compilation of its own (on an H200 with Flex, the packed
    loop's first update compiled for over 100 s). Dropout is off (its CPU mask is a graph break)."""
    from torch._dynamo.utils import counters

    from megamlm.train.layers import compile_layers

    cfg = variant_config("baseline", ["model.num_layers=3", "model.hidden_dropout=0", "model.attention_dropout=0"])
    tokens, masked = batch(cfg.model.vocab_size, lengths=(16,))
    model = MaskedLM(cfg.model, world, seed=3)
    compile_layers(model)
    torch._dynamo.reset()
    counters.clear()
    model.loss(model(tokens, masked), tokens[masked]).backward()
    assert counters["stats"]["calls_captured"] > 0  # the layers were compiled
    assert counters["stats"]["unique_graphs"] == 1  # the 3 layers share one (2 before: layer 0's own)


def test_registries_name_exactly_what_the_config_allows():
    import typing

    from megamlm.config import ModelConfig
    from megamlm.model.backends import ATTENTION_BACKENDS
    from megamlm.model.positions import POSITIONS

    hints = typing.get_type_hints(ModelConfig)
    assert set(ATTENTION_BACKENDS) == set(typing.get_args(hints["attention_backend"]))
    assert set(POSITIONS) == set(typing.get_args(hints["position"]))


@pytest.mark.parametrize("variant", ["baseline", "alibi-learned", "zero-clap"])
def test_the_encoder_is_the_objective_model_without_heads(world, variant):
    from megamlm import Encoder

    cfg = variant_config(variant)
    encoder, mlm = Encoder(cfg.model, world, seed=3).eval(), MaskedLM(cfg.model, world, seed=3).eval()
    heads = {name for name, _ in mlm.named_parameters()} - {name for name, _ in encoder.named_parameters()}
    assert heads and all(name.startswith("lm_head.") for name in heads)
    tokens, _ = batch(cfg.model.vocab_size)
    with torch.no_grad():
        assert torch.equal(encoder(tokens), mlm.hidden_states(tokens))


@pytest.mark.parametrize("variant", ["baseline", "rope-swiglu-rmsnorm"])
def test_one_rank_linears_compute_megatrons_products_bit_for_bit(world, variant, monkeypatch):
    # the plain matmul path (model/layer.py) replaces megatron's autograd.Function at TP=1: same loss,
    # same gradients to the last bit, dropout streams untouched
    from megamlm.model.layer import ColumnLinear, TensorParallelLinear
    from megamlm.parallel import seed_everything

    cfg = variant_config(variant, ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"])
    tokens = torch.randint(4, cfg.model.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    tokens[:, 0], tokens[2, 18:] = 0, cfg.model.pad_token_id
    index = torch.tensor([1, 5, 30, 44, 60])
    results = []
    for fast in (True, False):
        monkeypatch.setattr(TensorParallelLinear, "one_rank_fast_path", fast)
        seed_everything(1, world)
        model = MaskedLM(cfg.model, world, seed=3).train()
        assert any(isinstance(m, ColumnLinear) for m in model.modules())
        loss = model(tokens, index, targets=tokens.flatten()[index])
        # which path ran: megatron's Function leaves its backward nodes in the graph
        assert ("LinearWithGradAccumulationAndAsyncCommunicationBackward" in _backward_nodes(loss)) != fast
        loss.sum().backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (fast_loss, fast_grads), (megatron_loss, megatron_grads) = results
    assert torch.equal(fast_loss, megatron_loss)
    assert fast_grads.keys() == megatron_grads.keys()
    assert all(torch.equal(fast_grads[n], megatron_grads[n]) for n in fast_grads)


def _backward_nodes(tensor: torch.Tensor) -> set[str]:
    """Names of the autograd nodes behind `tensor`."""
    seen, stack = set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(next_node for next_node, _ in node.next_functions)
    return {type(node).__name__ for node in seen}
