"""ModernBERT (issue 19): `convert --from hf` reads a ModernBertForMaskedLM folder (random, non-default
shape: 5 layers, every 2nd global, a 16-token window, θ 160,000 / 10,000, no biases, GeGLU, its own
byte-level BPE with the specials after the pieces, saved locally) with transformers' logits on
sequences longer than the window at TP=1 and TP=2, and writes it back as the same class; RoPE, the
windows and the gated FFN's shards against independent references."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from megamlm.config import load_config
from megamlm.convert.parity import megamlm_logits
from megamlm.convert.pipeline import convert, read_megamlm
from megamlm.data.tokenizer import Tokenizer
from megamlm.model.encoder import encoder_flops_per_token
from megamlm.model.positions import Rotary, apply_rotation, sample_positions
from megamlm.model.tp import shard, unshard
from tests.test_hf_bert_albert import WORDS
from tests.test_hf_import import assert_refused_in_one_line
from tests.variants import CONFIGS

QUIET = {"log": lambda *a: None, "tolerance": 1e-5}
SPECIALS = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]  # ids 296..300, after the pieces (ModernBERT's order)
LONG_TEXT = " ".join(WORDS) + ", the fox and the dog run to the river bank in paris."


def byte_level_bpe():
    """A 301-id byte-level BPE (tokenizers): 256 bytes + 40 merges, then ModernBERT's specials."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=296, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator([" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 5, trainer)
    tokenizer.add_special_tokens(SPECIALS)
    assert tokenizer.get_vocab_size() == 301
    return tokenizer


def save_modernbert(folder: Path, heads: int = 3, seed: int = 0, **config) -> Path:
    """A random ModernBertForMaskedLM (every weight nonzero) and its PreTrainedTokenizerFast."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    values = dict(vocab_size=301, hidden_size=48, num_hidden_layers=5, num_attention_heads=heads,
                  intermediate_size=80, global_attn_every_n_layers=2, local_attention=16, max_position_embeddings=128,
                  global_rope_theta=160000.0, local_rope_theta=10000.0, pad_token_id=299, cls_token_id=297,
                  sep_token_id=298, bos_token_id=297, eos_token_id=298)
    model = ModernBertForMaskedLM(ModernBertConfig(**{**values, **config}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(), unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                            pad_token="[PAD]", mask_token="[MASK]").save_pretrained(folder)
    return folder


def hf_logits(folder: Path, text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own tokenizer and model: (their ids [1, s], logits [1, s, V])."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)(text, return_tensors="pt")["input_ids"]
    model = AutoModelForMaskedLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return ids, model(input_ids=ids).logits


@pytest.mark.parametrize("heads,tp", [(3, 1), (6, 2)])
def test_modernbert_folder_converts_both_ways_with_transformers_logits(world, tmp_path, heads, tp):
    source = save_modernbert(tmp_path / "hf", heads)
    report = convert("hf", "megamlm", source, tmp_path / "megamlm", tp=tp, **QUIET)
    assert report["max_diff"]["hf source"] < 1e-5  # the probe: 24 tokens, windows of 8 keys each side
    model = read_megamlm(tmp_path / "megamlm")
    m = model.cfg.model
    assert model.cfg.parallel.tensor_parallel == tp
    assert (m.position, m.rope_theta, m.rope_theta_local, m.local_window, m.global_every) == (
        "rope", 160000.0, 10000.0, 16, 2)
    assert (m.gated_ffn, m.bias, m.first_layer_norm, m.layernorm, m.vocab_size) == (True, False, False, "pre", 301)
    back = convert("megamlm", "hf", tmp_path / "megamlm", tmp_path / "back", **QUIET)
    assert back["max_diff"]["transformers ModernBertForMaskedLM"] < 1e-5
    config = json.loads((tmp_path / "back/config.json").read_text())
    assert config["architectures"] == ["ModernBertForMaskedLM"] and config["local_attention"] == 16
    assert (tmp_path / "back/tokenizer.json").read_text() == (source / "tokenizer.json").read_text()
    # a sequence 4x the window, through transformers' own tokenizer: source, megamlm, and the way back
    ids, want = hf_logits(source, LONG_TEXT)
    assert ids.shape[1] > 4 * 16
    order = torch.from_numpy(Tokenizer.load(model.cfg.data.tokenizer).vocab_order)  # megamlm id -> theirs
    ours = megamlm_logits(model.cfg, model.full, torch.argsort(order)[ids])[..., torch.argsort(order)]
    assert (ours - want).abs().max().item() < 1e-5
    _, got = hf_logits(tmp_path / "back", LONG_TEXT)
    assert (got - want).abs().max().item() < 1e-5


def test_byte_level_ids_are_modernberts(world, tmp_path):
    from transformers import AutoTokenizer

    convert("hf", "megamlm", save_modernbert(tmp_path / "hf"), tmp_path / "megamlm", **QUIET)
    ours = Tokenizer.load(read_megamlm(tmp_path / "megamlm").cfg.data.tokenizer)
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert [ours.vocab_order[i] for i in range(4)] == [297, 299, 298, 296]  # [CLS] [PAD] [SEP] [UNK]
    assert ours.vocab_order[ours.dictionary.mask_id] == 300
    text = "The fox runs to a river bank in Paris!"
    their_ids = theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.vocab_order[ours.encode(text)].tolist() == their_ids
    assert ours.decode(ours.encode(text)) == text
    pieces = theirs.convert_ids_to_tokens(their_ids)  # byte-level BPE's Ġ begins a word
    assert ours.word_starts()[ours.encode(text)].tolist() == [p.startswith("\u0120") for p in pieces]


def test_bad_modernbert_folders_are_one_line_and_write_nothing(world, tmp_path, capsys):
    save_modernbert(tmp_path / "mixed", attention_bias=True)
    save_modernbert(tmp_path / "odd", local_attention=15)
    save_modernbert(tmp_path / "pattern", layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                                       "full_attention", "full_attention"])
    save_modernbert(tmp_path / "scaled", rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 160000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    other = shutil.copytree(tmp_path / "odd", tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["ModernBertForTokenClassification"]}))
    assert_refused_in_one_line(tmp_path, {
        "mixed": "attention_bias=True, mlp_bias=False, norm_bias=False, classifier_bias=False (megamlm's model.bias",
        "odd": "local_attention=15 (megamlm's windows are even",
        "pattern": "(megamlm needs every k-th layer global, from layer 0)",
        "scaled": "rope_parameters.full_attention.rope_type='linear' (needs 'default')",
        "other": "architecture ModernBertForTokenClassification is not supported; --from hf reads"}, capsys)


def test_rope_is_the_complex_rotation_and_depends_only_on_distance():
    """Each pair (d, d + hn/2) is the complex number x_d + i·x_{d+hn/2} times e^{i·p·θ^(-2d/hn)}, and
    q·k after rotation is the same for positions shifted together."""
    hn, theta, s = 8, 500.0, 12
    rotary = Rotary(hn, theta, theta_local=10.0)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 1, s, hn, generator=g, dtype=torch.float64).unbind(0)
    cos, sin = rotary.rotation(sample_positions(None, s, "cpu"), local=False)
    got = apply_rotation(q.float(), cos, sin).double()
    frequencies = torch.tensor([theta ** (-2 * d / hn) for d in range(hn // 2)], dtype=torch.float64)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * frequencies  # [s, hn/2]
    pairs = torch.complex(q[..., : hn // 2], q[..., hn // 2:]) * torch.exp(1j * angle)
    torch.testing.assert_close(got, torch.cat([pairs.real, pairs.imag], dim=-1), rtol=0, atol=1e-5)

    def scores(shift):
        cos, sin = rotary.rotation(sample_positions(None, s, "cpu") + shift, local=True)
        return apply_rotation(q.float(), cos, sin) @ apply_rotation(k.float(), cos, sin).transpose(-1, -2)

    torch.testing.assert_close(scores(0), scores(37), rtol=0, atol=1e-4)
    assert not torch.allclose(rotary.rotation(torch.arange(s)[None], True)[0], cos)  # local θ differs


def test_a_gated_ffn_shard_holds_its_slice_of_both_halves():
    full = torch.arange(8.0)[:, None]  # rows [a0 a1 a2 a3 | g0 g1 g2 g3]
    shards = [shard(full, 0, tp=2, rank=r, stride=2) for r in range(2)]
    assert [s.flatten().tolist() for s in shards] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert torch.equal(unshard(shards, 0, stride=2), full)


def test_flops_count_local_layers_by_their_window():
    cfg = load_config([CONFIGS / "model/modernbert-base.yaml"])
    h, f, L, s = 768, 1152, 22, 8192
    local_layers = sum(i % 3 != 0 for i in range(L))  # 14 local, 8 global
    want = 6 * L * (4 * h * h + 3 * h * f) + 12 * h * ((L - local_layers) * s + local_layers * 129)
    assert encoder_flops_per_token(cfg.model, s) == want
    assert math.isclose(encoder_flops_per_token(cfg.model, 128), 6 * L * (4 * h * h + 3 * h * f) + 12 * h * L * 128)


@pytest.mark.parametrize("to", ["hf", "fairseq"])
def test_other_mixes_of_the_modernbert_parts_are_refused_on_export_in_one_line(world, tmp_path, capsys, to):
    """RoPE + SwiGLU + RMSNorm + biases is no transformers class and megamlm's modeling file has none of
    these parts; fairseq has none of them either: one line, nothing written."""
    from megamlm.cli import main as cli
    from megamlm.model.folder import write_model_folder
    from megamlm.model.reshard import full_state_dict
    from megamlm.objectives import MaskedLM
    from tests.faults_common import one_line
    from tests.variants import variant_config

    cfg = variant_config("rope-swiglu-rmsnorm", ["model.vocab_size=50265", "data.tokenizer=gpt2"])
    write_model_folder(tmp_path / "model", cfg, full_state_dict(MaskedLM(cfg.model, world, seed=5)))
    capsys.readouterr()
    assert cli(["convert", "--from", "megamlm", "--to", to, str(tmp_path / "model"), str(tmp_path / "out")]) == 2
    line = one_line(capsys.readouterr().err)
    parts = ("model.position=rope, model.gated_ffn=True, model.normalization=rmsnorm, model.first_layer_norm=False, "
             "model.local_window=16")
    want = f"{parts}: only the modernbert variant's mix" if to == "hf" else f"{parts} has no fairseq counterpart"
    assert line.startswith("megamlm: convert: ") and want in line, line
    assert not (tmp_path / "out").exists()


def test_config_json_of_the_hub_format_reads_the_same(world, tmp_path):
    """The Hub's ModernBERT config.json files predate layer_types / rope_parameters:
    global_attn_every_n_layers, global_rope_theta and local_rope_theta give the same model."""
    source = save_modernbert(tmp_path / "hf")
    config = json.loads((source / "config.json").read_text())
    del config["layer_types"], config["rope_parameters"]
    config.update(global_attn_every_n_layers=2, global_rope_theta=160000.0, local_rope_theta=10000.0)
    (source / "config.json").write_text(json.dumps(config))
    assert convert("hf", "megamlm", source, tmp_path / "megamlm", **QUIET)["max_diff"]["hf source"] < 1e-5
    m = read_megamlm(tmp_path / "megamlm").cfg.model
    assert (m.rope_theta, m.rope_theta_local, m.global_every, m.local_window) == (160000.0, 10000.0, 2, 16)
