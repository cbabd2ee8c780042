"""Checkpoint conversion: fairseq fixtures of every variant round-trip bit-exactly, logits agree with
an independent fairseq forward, TP resharding is exact, unsafe pickles are refused, ZeRO DP×TP
checkpoints consolidate to the training model."""

import os
from pathlib import Path

import pytest
import torch

from megamlm import MaskedLM, from_pretrained
from megamlm.cli import main as cli
from megamlm.config import ConfigError
from megamlm.convert import fairseq as fs
from megamlm.convert.fairseq_reference import fairseq_logits
from megamlm.convert.parity import probe_tokens
from megamlm.convert.pipeline import convert, read_megamlm
from megamlm.convert.safe_load import UnsafeCheckpointError, load_untrusted
from megamlm.model.folder import SHARD_FILE
from megamlm.model.tp import shard_rule, shard_stride
from tests.fairseq_fixtures import VARIANT_KNOBS, fairseq_checkpoint
from tests.variants import VARIANTS, variant_config

QUIET = {"log": lambda *a: None}


def write_dict(path: Path, lines: int) -> Path:
    path.write_text("".join(f"{1000 + i} {lines - i}\n" for i in range(lines)))
    return path


def fixture_file(tmp_path, variant, **kw):
    ckpt = fairseq_checkpoint(variant, **kw)
    path = tmp_path / f"{variant}.pt"
    torch.save(ckpt, path)
    # 120 rows = 4 specials + lines (+ <mask> unless zero-clap)
    dict_path = write_dict(tmp_path / "dict.txt", 116 if VARIANT_KNOBS[variant].get("zero_masking") else 115)
    return path, ckpt, dict_path


@pytest.mark.parametrize("variant", sorted(VARIANT_KNOBS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fairseq_round_trip_is_bit_exact_and_logits_match_fairseq(world, tmp_path, variant, dtype):
    old = variant in ("baseline", "learned-clap")
    src, ckpt, dict_path = fixture_file(tmp_path, variant, dtype=dtype, old_names=old,
                                        hydra=variant != "sinusoidal", classification_head=variant == "baseline")
    there = convert("fairseq", "megamlm", src, tmp_path / "megamlm", dict_path=dict_path, **QUIET)
    back = convert("megamlm", "fairseq", tmp_path / "megamlm", tmp_path / "back.pt", **QUIET)
    assert max(there["max_diff"].values()) < 2e-5 and max(back["max_diff"].values()) < 2e-5
    original, written = ckpt["model"], load_untrusted(tmp_path / "back.pt")["model"]
    assert list(written) == list(original)  # same keys in fairseq's order
    for key, value in original.items():
        assert written[key].dtype == value.dtype and torch.equal(written[key], value), key
    prefix = "decoder." if old else "encoder."
    if not VARIANT_KNOBS[variant].get("untie_weights_roberta"):  # the tie survives as shared storage
        assert (written[prefix + "lm_head.weight"].data_ptr()
                == written[prefix + "sentence_encoder.embed_tokens.weight"].data_ptr())
    # the documented Python API on the converted folder: every position, the whole vocabulary
    model = from_pretrained(tmp_path / "megamlm", world)
    tokens = probe_tokens(model_cfg := read_megamlm(tmp_path / "megamlm").cfg)
    state, _ = fs.normalize_names(original)
    want = fairseq_logits(state, fs.fairseq_model_cfg(ckpt), tokens)
    with torch.no_grad():
        got = model(tokens)
    assert got.shape == (2, tokens.shape[1], model_cfg.model.vocab_size)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


def test_fairseq_knobs_map_to_the_model_config(tmp_path):
    _, ckpt, _ = fixture_file(tmp_path, "zero-clap")
    model = fs.model_config_from_fairseq(fs.fairseq_model_cfg(ckpt), ckpt["model"])
    assert (model.position, model.alibi_mode, model.head, model.zero_mask, model.scale_embeddings,
            model.normalize_embeddings, model.embedding_layernorm) == ("alibi", "offset", "clap", True, True,
                                                                       True, False)
    _, ckpt, _ = fixture_file(tmp_path, "alibi-symmetric")
    assert fs.model_config_from_fairseq(fs.fairseq_model_cfg(ckpt), ckpt["model"]).alibi_mode == "symmetric"
    # and back: our cfg for a megamlm model reads back to the same ModelConfig
    for variant in VARIANTS:
        if variant in ("alibi-learned", "bert", "albert", "modernbert", "rope-swiglu-rmsnorm", "bigbird"):
            continue  # no fairseq counterpart (fixed slopes, BERT / ALBERT / ModernBERT parts)
        model = variant_config(variant).model
        state = fs.megamlm_to_fairseq(
            {k: v for k, v in _full_state(model).items()}, model,
            fs.FairseqSource(cfg={}, constants={"sentence_encoder.version": torch.tensor([3.0])}))
        back = fs.model_config_from_fairseq(fs.fairseq_cfg_for(model)["model"], state)
        for knob in ("position", "alibi_mode", "head", "zero_mask", "scale_embeddings", "normalize_embeddings",
                     "embedding_layernorm", "layernorm", "tie_embeddings", "num_layers", "vocab_size"):
            assert getattr(back, knob) == getattr(model, knob), (variant, knob)


def _full_state(model_cfg):
    from megamlm.config import ParallelConfig
    from megamlm.model.reshard import full_state_dict
    from megamlm.parallel import init_distributed

    return full_state_dict(MaskedLM(model_cfg, init_distributed(ParallelConfig())))


def test_conversion_errors_name_the_problem(tmp_path):
    src, ckpt, dict_path = fixture_file(tmp_path, "baseline")
    with pytest.raises(fs.ConversionError, match="gives 119 symbols .* checkpoint has 120 embedding rows"):
        convert("fairseq", "megamlm", src, tmp_path / "out", dict_path=write_dict(tmp_path / "d.txt", 114), **QUIET)
    with pytest.raises(fs.ConversionError, match="not GPT-2's 50265: pass the dictionary"):
        convert("fairseq", "megamlm", src, tmp_path / "out", **QUIET)
    ckpt["cfg"]["model"]["layernorm_embedding"] = False  # the cfg no longer describes the weights
    torch.save(ckpt, src)
    with pytest.raises(fs.ConversionError, match="layernorm_embedding.weight is present but the cfg says"):
        convert("fairseq", "megamlm", src, tmp_path / "out", dict_path=dict_path, **QUIET)
    ckpt["cfg"]["model"].update(layernorm_embedding=True, mask_prob=0.1)
    torch.save(ckpt, src)
    assert cli(["convert", "--from", "fairseq", "--to", "megamlm", str(src), str(tmp_path / "out"),
                "--dict", str(dict_path)]) == 2
    assert not (tmp_path / "out").exists()


def test_a_wrong_mapping_fails_the_probe_and_writes_nothing(world, tmp_path, monkeypatch):
    src, _, dict_path = fixture_file(tmp_path, "alibi")

    def swapped(q, k, v, heads):  # q and k exchanged: every shape still fits
        return fs_fuse(k, q, v, heads)

    from megamlm.convert.hf import fuse_qkv as fs_fuse
    monkeypatch.setattr(fs, "fuse_qkv", swapped)
    with pytest.raises(fs.ConversionError, match="logits differ from the fairseq source"):
        convert("fairseq", "megamlm", src, tmp_path / "out", dict_path=dict_path, **QUIET)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


class _Payload:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def test_a_pickle_with_code_is_refused_and_nothing_runs(tmp_path, capsys):
    marker = tmp_path / "pwned"
    ckpt = fairseq_checkpoint("baseline")
    ckpt["extra_state"]["payload"] = _Payload(marker)
    torch.save(ckpt, tmp_path / "evil.pt")
    with pytest.raises(UnsafeCheckpointError, match="system.*not on the allow-list"):
        load_untrusted(tmp_path / "evil.pt")
    assert cli(["convert", "--from", "fairseq", "--to", "megamlm", str(tmp_path / "evil.pt"),
                str(tmp_path / "out")]) == 2
    assert "nothing from the file was executed" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "out").exists()
    # the allow-listed data types of genuine checkpoints load (pre-hydra args Namespace)
    torch.save(fairseq_checkpoint("baseline", hydra=False), tmp_path / "old.pt")
    assert load_untrusted(tmp_path / "old.pt")["args"].encoder_layers == 2


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_shard_table_matches_the_model_parameters(world, variant):
    assert_shard_table_matches(MaskedLM(variant_config(variant).model, world))


def assert_shard_table_matches(model):
    for name, param in model.named_parameters():
        dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
        assert shard_rule(name) == (dim, getattr(param, "vocab_parallel", False)), name
        if dim is not None:  # a gated FFN's first linear holds two halves per shard
            assert shard_stride(name, model.config) == getattr(param, "partition_stride", 1), name


def test_tensor_parallel_resharding_is_bit_exact(world, tmp_path):
    src, _, dict_path = fixture_file(tmp_path, "zero-clap")
    convert("fairseq", "megamlm", src, tmp_path / "tp1", dict_path=dict_path, **QUIET)
    convert("megamlm", "megamlm", tmp_path / "tp1", tmp_path / "tp2", tp=2, **QUIET)
    convert("megamlm", "megamlm", tmp_path / "tp2", tmp_path / "tp1-again", **QUIET)
    convert("megamlm", "megamlm", tmp_path / "tp1-again", tmp_path / "tp2-again", tp=2, **QUIET)
    for a, b in (("tp1", "tp1-again"), ("tp2", "tp2-again")):
        files = sorted(p.name for p in (tmp_path / a).glob("model*.pt"))
        assert files == sorted(p.name for p in (tmp_path / b).glob("model*.pt"))
        for name in files:
            x, y = (torch.load(tmp_path / d / name, weights_only=True) for d in (a, b))
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    shard = torch.load(tmp_path / "tp2" / SHARD_FILE.format(rank=1, tp=2), weights_only=True)
    assert shard["embedding.word_embeddings.weight"].shape == (128, 32)  # 256 padded rows / 2
    assert "classification_heads.pt" not in os.listdir(tmp_path / "tp2")
    with pytest.raises(ConfigError, match="does not divide model.num_attention_heads=4"):
        convert("megamlm", "megamlm", tmp_path / "tp1", tmp_path / "tp3", tp=3, **QUIET)


def test_a_tp_the_output_cannot_take_is_one_line_naming_tp(world, tmp_path, capsys):
    """--tp is checked before the probe's forwards (minutes for a large model) and said as the user typed it."""
    from megamlm.cli import main as cli

    src, _, dict_path = fixture_file(tmp_path, "zero-clap")
    convert("fairseq", "megamlm", src, tmp_path / "tp1", dict_path=dict_path, **QUIET)
    capsys.readouterr()
    for target, tp, message in [
            ("megamlm", 0, "convert: --tp 0 must be >= 1 (the tensor-parallel shards of the megamlm output)"),
            ("hf", 2, "convert: --tp 2: only --to megamlm writes tensor-parallel shards; --to hf writes the whole "
                      "model"),
            ("megamlm", 3, f"config error: --tp 3: parallel.tensor_parallel=3 does not divide "
                           f"model.num_attention_heads=4; allowed: 1, 2, 4 (model.num_attention_heads set in "
                           f"{tmp_path / 'tp1'})")]:
        assert cli(["convert", "--from", "megamlm", "--to", target, str(tmp_path / "tp1"), str(tmp_path / "out"),
                    "--tp", str(tp)]) == 2
        out, err = capsys.readouterr()
        assert err == f"megamlm: {message}\n" and "parity" not in out
        assert not (tmp_path / "out").exists()


def _train_run(cfg):
    from megamlm.train.loop import train

    return train(cfg)["steps"]


@pytest.mark.slow
def test_zero2_dp2_tp2_checkpoint_consolidates_to_the_training_model(tmp_path):
    from megamlm.config import load_config
    from megamlm.data.shards import BuildOptions, build_shards
    from megamlm.data.tokenizer import Tokenizer
    from tests.multiproc import run_on_ranks

    root = Path(__file__).resolve().parents[1]
    text = tmp_path / "corpus.txt"
    text.write_text((root / "data/wikitext-103/valid.txt").read_text()[:100_000])
    build_shards(BuildOptions([str(text)], str(tmp_path / "shards"), seq_length=64, long_docs="split",
                              valid_fraction=0.1), Tokenizer.gpt2(), progress=False)
    cfg = load_config([root / "configs/variants/zero-clap.yaml"], [
        "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=128",
        "data.seq_length=64", f"data.shards={tmp_path / 'shards'}", "train.micro_batch_size=2",
        "parallel.tensor_parallel=2", "train.zero_stage=2", "train.steps=3", "train.eval_interval=1000",
        "train.eval_batches=1", "optim.warmup_steps=1", "optim.lr=1e-2", f"train.run_dir={tmp_path / 'run'}"])
    assert run_on_ranks(_train_run, 4, cfg)[0] == 3  # DP=2 x TP=2
    assert len(list((tmp_path / "run/checkpoints/step00000003").glob("*optim_states.pt"))) == 4
    report = convert("zero", "megamlm", tmp_path / "run", tmp_path / "consolidated", **QUIET)
    assert report["max_diff"]["written megamlm folder"] == 0
    trained, consolidated = (read_megamlm(tmp_path / d) for d in ("run/final", "consolidated"))
    assert trained.full.keys() == consolidated.full.keys()
    for name, value in trained.full.items():  # fp32 master weights == the training model's weights
        assert torch.equal(consolidated.full[name], value), name
    tokens = probe_tokens(trained.cfg)
    from megamlm.config import ParallelConfig
    from megamlm.parallel import init_distributed

    ctx = init_distributed(ParallelConfig())
    with torch.no_grad():
        want = from_pretrained(tmp_path / "run/final", ctx)(tokens)
        got = from_pretrained(tmp_path / "consolidated", ctx)(tokens)
    assert torch.equal(got, want)
    # a converted folder starts a new run (train.init_from): with lr 1e-30 the run's export is that folder
    from megamlm.config import replace_config

    again = replace_config(cfg, [f"train.init_from={tmp_path / 'consolidated'}", "parallel.tensor_parallel=1",
                                 "train.zero_stage=0", "optim.lr=1e-30", "optim.min_lr=0", "optim.weight_decay=0",
                                 "train.steps=1", f"train.run_dir={tmp_path / 'again'}"])
    assert run_on_ranks(_train_run, 1, again)[0] == 1
    restarted = read_megamlm(tmp_path / "again/final")
    assert all(torch.allclose(restarted.full[k], v, rtol=0, atol=1e-20) for k, v in consolidated.full.items())
    wrong = replace_config(again, ["model.num_layers=3", f"train.run_dir={tmp_path / 'wrong'}"])
    with pytest.raises(RuntimeError, match="holds a different architecture: model.num_layers: run 3 vs 2"):
        run_on_ranks(_train_run, 1, wrong)


@pytest.mark.parametrize("variant", ["alibi", "zero-clap"])
def test_alibi_and_clap_variants_export_as_remote_code_that_transformers_loads(world, tmp_path, variant,
                                                                                monkeypatch):
    from transformers import AutoModelForMaskedLM, pipeline

    from megamlm.model.folder import write_model_folder
    from megamlm.model.reshard import full_state_dict

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = variant_config(variant, ["model.vocab_size=50262" if variant == "zero-clap" else "model.vocab_size=50265",
                                   "data.tokenizer=" + ("gpt2-zero-clap" if variant == "zero-clap" else "gpt2")])
    write_model_folder(tmp_path / "model", cfg, full_state_dict(MaskedLM(cfg.model, world, seed=5)))
    report = convert("megamlm", "hf", tmp_path / "model", tmp_path / "hf", **QUIET)
    assert report["max_diff"]["transformers MegamlmForMaskedLM (trust_remote_code)"] < 1e-5
    assert (tmp_path / "hf/modeling_megamlm.py").exists()
    hf = AutoModelForMaskedLM.from_pretrained(tmp_path / "hf", trust_remote_code=True)
    assert type(hf).__name__ == "MegamlmForMaskedLM"
    fill = pipeline("fill-mask", model=str(tmp_path / "hf"), trust_remote_code=True, top_k=3)
    results = fill("The capital of France is <mask>.")
    assert len(results) == 3 and all(r["sequence"].startswith("The capital of France is") for r in results)
    assert abs(sum(r["score"] for r in results)) <= 1.0


def test_the_tool_script_is_the_same_command(tmp_path):
    import subprocess
    import sys

    src, _, dict_path = fixture_file(tmp_path, "learned-clap")
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "tools/convert_checkpoint.py"), "--from", "fairseq", "--to",
                          "megamlm", str(src), str(tmp_path / "out"), "--dict", str(dict_path), "--tp", "2"],
                         env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "parity vs fairseq source: max |Δlogit| = " in run.stdout
    assert sorted(p.name for p in (tmp_path / "out").glob("model*.pt")) == ["model-tp00-of-02.pt",
                                                                             "model-tp01-of-02.pt"]
