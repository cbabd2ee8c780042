"""Configuration: files, includes, overrides, and a one-line error for every kind of mistake."""

import dataclasses
import os
import textwrap
from pathlib import Path

import pytest
import torch

from megamlm.config import ConfigError, ModelConfig, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
VARIANTS = sorted((CONFIGS / "variants").glob("*.yaml"))
# sizes alone (tiny, base, large); bert-base / albert-base are architectures with their size (below)
SIZES = sorted(p for p in (CONFIGS / "model").glob("*.yaml") if "include:" not in p.read_text())


@pytest.mark.parametrize("size", SIZES, ids=lambda p: p.stem)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda p: p.stem)
def test_every_size_variant_combination_loads(size, variant):
    cfg = load_config([size, variant])
    assert cfg.model.num_layers in (4, 12, 24)


def test_variants_carry_the_reference_knobs():
    zero = load_config([CONFIGS / "variants/zero-clap.yaml"]).model
    assert (zero.position, zero.alibi_mode, zero.head, zero.zero_mask) == ("alibi", "offset", "clap", True)
    assert (zero.vocab_size, zero.scale_embeddings, zero.embedding_layernorm) == (50262, True, False)
    assert (zero.hidden_dropout, zero.attention_dropout) == (0.0, 0.1)
    clap = load_config([CONFIGS / "variants/learned-clap.yaml"]).model
    assert (clap.position, clap.head, clap.normalize_embeddings, clap.scale_embeddings) == (
        "learned", "clap", True, False)
    base = load_config([CONFIGS / "variants/baseline.yaml"]).model
    assert (base.head, base.embedding_layernorm, base.vocab_size) == ("roberta", True, 50265)


def test_bert_albert_and_modernbert_are_the_published_shapes():
    """Parameter counts from the config alone equal the papers' (BERT-base 110M, ALBERT-base 12M,
    ModernBERT-base 149M, -large 395M) and transformers' own count of the same configuration."""
    from transformers import (AlbertConfig, AlbertForMaskedLM, BertConfig, BertForMaskedLM, ModernBertConfig,
                              ModernBertForMaskedLM)

    from megamlm.objectives import get_objective

    for name, config_class, model_class, extra in (
            ("bert-base", BertConfig, BertForMaskedLM, {}),
            ("albert-base", AlbertConfig, AlbertForMaskedLM, {"embedding_size": 128}),
            ("modernbert-base", ModernBertConfig, ModernBertForMaskedLM, {}),
            ("modernbert-large", ModernBertConfig, ModernBertForMaskedLM, {})):
        cfg = load_config([CONFIGS / "model" / f"{name}.yaml"])
        m = cfg.model
        with torch.device("meta"):
            hf = model_class(config_class(vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                                          num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                                          intermediate_size=m.ffn_hidden_size, **extra))
        theirs = sum(p.numel() for p in hf.parameters())
        # megamlm's learned table has 2 (padding) rows more than HF's (fairseq's layout); RoPE has none
        padding_rows = 2 if m.position == "learned" else 0
        assert get_objective(cfg).parameter_count() == theirs + padding_rows * m.embedding_dim, name
    assert load_config([CONFIGS / "model/albert-base.yaml"]).model.share_layers


def test_overrides_are_typed_and_win_over_files():
    cfg = load_config([CONFIGS / "demo.yaml"], ["model.position=alibi", "optim.lr=1e-4",
                                                "optim.betas=[0.9, 0.95]", "model.init_std=1"])
    assert cfg.model.position == "alibi" and cfg.model.alibi_mode == "offset"
    assert cfg.optim.lr == 1e-4 and cfg.optim.betas == (0.9, 0.95)
    assert isinstance(cfg.model.init_std, float)
    assert cfg.model.num_layers == 4  # from the included tiny.yaml


BAD = [
    (["model.positon=alibi"], "unknown key 'model.positon'; allowed: num_layers"),
    (["modle.position=alibi"], "unknown section 'modle'"),
    (["model.position=xpos"], "model.position='xpos' is invalid; allowed: learned | sinusoidal | none | alibi | rope"),
    (["model.num_layers=two"], "model.num_layers='two' is invalid; allowed: int"),
    (["model.zero_mask=1"], "model.zero_mask=1 is invalid; allowed: bool"),
    (["data.build_from=null"], "data.build_from=null is invalid; allowed: list of str"),
    (["model.num_layers=true"], "model.num_layers=true is invalid; allowed: int"),
    (["model.num_attention_heads=12", "parallel.tensor_parallel=5"],
     "parallel.tensor_parallel=5 does not divide model.num_attention_heads=12; allowed: 1, 2, 3, 4, 6, 12"),
    (["model.hidden_size=100", "model.num_attention_heads=12"],
     "model.hidden_size=100 is not divisible by model.num_attention_heads=12"),
    (["model.position=learned", "model.alibi_mode=offset"],
     "model.alibi_mode=offset needs model.position=alibi"),
    (["model.head=clap", "model.tie_embeddings=false"],
     "model.tie_embeddings=false is impossible with model.head=clap"),
    (["model.max_positions=128", "data.seq_length=512"],
     "data.seq_length=512 exceeds model.max_positions=128"),
    (["model.hidden_dropout=1.5"], "model.hidden_dropout=1.5 must be in [0, 1)"),
    (["optim.betas=[0.9]"], "optim.betas=[0.9] is invalid; allowed: [float, float]"),
    (["model.alibi_mode=sideways", "model.position=alibi"],
     "model.alibi_mode='sideways' is invalid; allowed: symmetric | offset | learned or null"),
    (["position=alibi"], "override 'position=alibi' must look like section.key=value"),
    # issue 19: RoPE and local/global attention
    (["model.position=learned", "model.rope_theta=10000"],
     "model.rope_theta=10000.0 needs model.position=rope, got position=learned (one position encoding at a time"),
    (["model.position=rope", "model.local_window=128", "model.global_every=3", "data.seq_length=64"],
     "model.local_window=128 is larger than data.seq_length=64: the local layers would attend globally"),
    (["model.global_every=3"], "model.global_every=3 needs model.local_window"),
    (["model.local_window=16"], "model.local_window=16 needs model.global_every >= 2"),
    (["model.local_window=15", "model.global_every=2"], "model.local_window=15 must be a positive even number"),
    (["model.num_layers=2", "model.local_window=16", "model.global_every=3"],
     "model.global_every=3 must be in [1, model.num_layers=2]"),
    (["model.first_layer_norm=false"], "model.first_layer_norm=false needs model.layernorm=pre"),
    (["model.rope_theta=ten", "model.position=rope"], "model.rope_theta='ten' is invalid; allowed: float or null"),
    (["model.local_attention=bigbird"], "model.local_attention=bigbird needs model.local_window"),
    (["train.profile_updates=-1"], "train.profile_updates=-1 must be >= 0 (0: no profile)"),
    # session 27: bounds that were not checked (the first was a ZeroDivisionError, the others ran on)
    (["model.num_attention_heads=0"], "model.num_attention_heads=0 must be positive"),
    (["train.global_batch_size=0"], "train.global_batch_size=0 must be >= 1"),
    (["train.seed=-1"], "train.seed=-1 must be >= 0"),
    (["train.spike_factor=1"], "train.spike_factor=1.0 must be > 1"),
    (["optim.betas=[0.9,1.0]"], "optim.betas=[0.9, 1.0] must be in [0, 1)"),
    (["optim.weight_decay=-0.01"], "optim.weight_decay=-0.01 must be >= 0"),
    (["data.loader_workers=-1"], "data.loader_workers=-1 must be >= 0"),
    (["data.valid_fraction=1"], "data.valid_fraction=1.0 must be in [0, 1)"),
    (["model.layernorm_epsilon=0"], "model.layernorm_epsilon=0.0 must be > 0"),
    (["train.fp32_grad_accumulation=true", "train.precision=bf16"],
     "train.fp32_grad_accumulation=true needs train.engine=flat: DeepSpeed's ZeRO-1 sums micro-batches in the "
     "weights' dtype"),
]


# session 59: a mistyped name ends with the likely one (difflib's ratio >= 0.75, any case), a key given in the
# wrong section with the section that has it
LIKELY = [
    (["model.positon=alibi"], "unknown key 'model.positon'; allowed: num_layers", "; did you mean 'model.position'?"),
    (["model.atention_backend=flex"], "unknown key 'model.atention_backend'",
     "; did you mean 'model.attention_backend'?"),
    (["train.lr=1e-3"], "unknown key 'train.lr'; allowed: seed, micro_batch_size", "; did you mean 'optim.lr'?"),
    (["modle.position=alibi"], "unknown section 'modle'; allowed: model, objective, parallel, data, optim, train",
     "; did you mean 'model'?"),
    (["model.position=alibbi"],
     "model.position='alibbi' is invalid; allowed: learned | sinusoidal | none | alibi | rope",
     "; did you mean 'alibi'?"),
    (["model.alibi_mode=Ofset", "model.position=alibi"],
     "model.alibi_mode='Ofset' is invalid; allowed: symmetric | offset | learned or null", "; did you mean 'offset'?"),
    (["model.attention_backend=trition"], "allowed: sdpa | eager | flex | varlen | alibi-flash | triton",
     "; did you mean 'triton'?"),
]


@pytest.mark.parametrize("overrides,message,likely", LIKELY, ids=[b[0][0] for b in LIKELY])
def test_a_mistyped_name_ends_its_line_with_the_likely_one(overrides, message, likely):
    with pytest.raises(ConfigError) as err:
        load_config([], overrides)
    text = str(err.value)
    assert message in text and text.endswith(likely) and "\n" not in text


@pytest.mark.parametrize("overrides", [["model.position=zzz"], ["model.zzz=1"], ["zzz.position=1"]])
def test_a_name_like_none_allowed_gets_no_guess(overrides):
    with pytest.raises(ConfigError) as err:
        load_config([], overrides)
    assert "did you mean" not in str(err.value)


def test_a_whole_number_written_as_a_float_is_an_int_and_no_other_float_is(tmp_path):
    """`steps: 1e5` is a string to YAML 1.1 and 1.0e5 a float: both say 100,000 to a user."""
    exp = tmp_path / "exp.yaml"
    exp.write_text("train:\n  steps: 1e5\noptim:\n  warmup_steps: 1.0e3\n")
    cfg = load_config([exp], ["model.num_layers=2.0"])
    assert [(type(v), v) for v in (cfg.train.steps, cfg.optim.warmup_steps, cfg.model.num_layers)] == [
        (int, 100_000), (int, 1_000), (int, 2)]
    for text, shown in [("2.5", "2.5"), ("1e300", "'1e300'"), ("nan", "'nan'"), ("true", "true")]:
        with pytest.raises(ConfigError) as err:
            load_config([], [f"train.steps={text}"])
        assert str(err.value) == f"command line: train.steps={shown} is invalid; allowed: int"


def test_a_file_with_a_mistyped_section_names_the_file_and_the_likely_section(tmp_path):
    bad = tmp_path / "exp.yaml"
    bad.write_text("modle:\n  num_layers: 2\n")
    with pytest.raises(ConfigError, match=rf"^{bad}: unknown section 'modle'; allowed: include, model, .*; did you "
                                          r"mean 'model'\?$"):
        load_config([bad])


@pytest.mark.parametrize("overrides,message", BAD, ids=[b[1][:40] for b in BAD])
def test_bad_configuration_gives_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config([], overrides)
    text = str(err.value)
    assert message in text
    assert "\n" not in text


def test_errors_name_the_file_that_set_the_value(tmp_path):
    bad = tmp_path / "exp.yaml"
    bad.write_text(f"include: {CONFIGS / 'model/base.yaml'}\nparallel:\n  tensor_parallel: 5\n")
    with pytest.raises(ConfigError, match=rf"^{bad}: parallel.tensor_parallel=5 does not divide"):
        load_config([bad])
    with pytest.raises(ConfigError, match=r"^command line: model.num_layers=0 must be positive"):
        load_config([], ["model.num_layers=0"])


def test_a_check_across_keys_names_where_each_was_set(tmp_path):
    """model/base.yaml sets hidden_size=768 and the command line 5 heads: the file alone would send the user
    to a file they did not change; a key set where the first was (or left at its default) is not repeated."""
    base = CONFIGS / "model/base.yaml"
    with pytest.raises(ConfigError) as err:
        load_config([base], ["model.num_attention_heads=5"])
    assert str(err.value) == (f"{base}: model.hidden_size=768 is not divisible by model.num_attention_heads=5; "
                              "allowed head counts: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64 "
                              "(model.num_attention_heads set on the command line)")
    with pytest.raises(ConfigError) as err:
        load_config([base], ["model.num_attention_heads=5", "model.hidden_size=102"])
    assert str(err.value).startswith("command line: model.hidden_size=102 is not") and "set " not in str(err.value)


def test_file_problems_are_reported_with_the_path(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config([tmp_path / "missing.yaml"])
    broken = tmp_path / "broken.yaml"
    broken.write_text("model:\n  num_layers: [1\n")
    with pytest.raises(ConfigError, match=rf"{broken}:\d+: not valid YAML"):
        load_config([broken])
    cyclic = tmp_path / "a.yaml"
    cyclic.write_text("include: a.yaml\n")
    with pytest.raises(ConfigError, match="include cycle"):
        load_config([cyclic])
    unknown = tmp_path / "u.yaml"
    unknown.write_text("trainer:\n  steps: 3\n")
    with pytest.raises(ConfigError, match=rf"{unknown}: unknown section 'trainer'"):
        load_config([unknown])


@pytest.mark.parametrize("include,shown", [("[1]", "[1]"), ("{base.yaml: 1}", "{base.yaml: 1}"), ("", "null")])
def test_an_include_that_is_not_paths_is_one_line_naming_its_line(tmp_path, include, shown):
    """A mapping would otherwise be read as its keys' paths, a number end in a traceback."""
    (tmp_path / "base.yaml").write_text("model:\n  num_layers: 2\n")
    bad = tmp_path / "exp.yaml"
    bad.write_text(f"train:\n  steps: 3\ninclude: {include}\n")
    with pytest.raises(ConfigError) as err:
        load_config([bad])
    assert str(err.value) == (f"{bad}:3: include must be a path or a list of paths (relative to the file), "
                              f"not {shown}")


def test_a_missing_include_is_named_at_the_line_of_the_file_that_includes_it(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model/base.yaml").write_text("model:\n  num_layers: 2\n")
    (tmp_path / "model/large.yaml").write_text("model:\n  num_layers: 4\n")
    (tmp_path / "exp.yaml").write_text("train:\n  steps: 3\ninclude: [model/bsae.yaml]\n")
    (tmp_path / "top.yaml").write_text("include: exp.yaml\n")
    with pytest.raises(ConfigError) as err:
        load_config([tmp_path / "top.yaml"])
    assert str(err.value) == (f"{tmp_path / 'exp.yaml'}:3: include model/bsae.yaml: config file not found: "
                              f"{tmp_path / 'model/bsae.yaml'}; did you mean 'model/base.yaml'?")


def test_yaml_merge_keys_work_and_the_keys_beside_them_override_what_they_merge(tmp_path):
    exp = tmp_path / "exp.yaml"
    exp.write_text("model:\n  <<: {num_layers: 2, hidden_size: 64}\n  num_layers: 3\n  num_attention_heads: 2\n")
    cfg = load_config([exp])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads) == (3, 64, 2)


def test_a_key_yaml_cannot_hash_is_not_valid_yaml_at_its_line(tmp_path):
    bad = tmp_path / "exp.yaml"
    bad.write_text("train:\n  steps: 3\n? [model]\n: 1\n")
    with pytest.raises(ConfigError, match=rf"^{bad}:3: not valid YAML \(found unhashable key\)$"):
        load_config([bad])


def test_every_key_is_documented_under_its_field():
    """`megamlm config --explain` shows these texts: each of the ~110 keys has one (litgpt's convention)."""
    from megamlm.config.explain import field_docs
    from megamlm.config.sections import SECTIONS

    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        assert [f.name for f in dataclasses.fields(cls) if not docs.get(f.name, "").strip()] == [], section


def test_explain_shows_the_resolved_value_where_it_was_set_the_default_and_the_fields_own_text(capsys, monkeypatch):
    from megamlm.cli import main
    from megamlm.config.explain import field_docs

    monkeypatch.chdir(CONFIGS.parent)  # files below the working directory are named relative to it
    capsys.readouterr()
    assert main(["config", "--config", "configs/pile/base-zero-clap.yaml", "train.seed=7", "--explain",
                 "model.position", "--explain", "train.seed", "--explain", "model.rope_theta"]) == 0
    paragraphs = capsys.readouterr().out.rstrip("\n").split("\n\n")
    position = ("model.position = alibi  (set in configs/variants/zero-clap.yaml:6; default learned; allowed: "
                "learned | sinusoidal | none | alibi | rope; architecture: a model folder's weights load only where it "
                "agrees)\n"
                + textwrap.indent(field_docs(ModelConfig)["position"], "    "))
    assert len(paragraphs) == 3 and paragraphs[0] == position and "rotary" in position
    assert paragraphs[1].startswith("model.rope_theta = null  (default null; float or null)\n    ")  # not set
    assert paragraphs[2].startswith("train.seed = 7  (set on the command line; default 1; int)\n    ")


def test_explain_names_the_line_of_a_key_in_an_included_file_and_in_a_piped_one(tmp_path, monkeypatch):
    from megamlm.config import load_config_and_origins
    from megamlm.config.explain import explain

    monkeypatch.chdir(tmp_path)
    (tmp_path / "base.yaml").write_text("# the sizes\nmodel:\n  num_layers: 2\n\n  hidden_size: 64\n"
                                        "  num_attention_heads: 4\n")
    (tmp_path / "exp.yaml").write_text("include: base.yaml\ntrain:\n  seed: 3\nmodel:\n  hidden_size: 128\n")
    cfg, origins = load_config_and_origins(["exp.yaml"], ["train.steps=5"])
    first_lines = [p.splitlines()[0].split(";")[0] for p in explain(cfg, ["model.num_layers", "model.hidden_size",
                                                                          "train.seed", "train.steps"], origins)
                   .split("\n\n")]
    assert first_lines == ["model.num_layers = 2  (set in base.yaml:3", "model.hidden_size = 128  (set in exp.yaml:5",
                           "train.seed = 3  (set in exp.yaml:3", "train.steps = 5  (set on the command line"]
    # error messages still name the file alone (tests above), and a config read from a pipe has lines too
    read, write = os.pipe()
    os.write(write, b"model:\n  num_layers: 4\n")
    os.close(write)
    cfg, origins = load_config_and_origins([f"/dev/fd/{read}"])
    os.close(read)
    assert cfg.model.num_layers == 4 and origins["model.num_layers"].line == 2


def test_explain_marks_the_keys_a_model_folders_weights_must_agree_on():
    from megamlm.config.explain import explain

    text = explain(load_config([]), ["model"])
    marked = [line.split(" = ")[0] for line in text.splitlines() if line.endswith("load only where it agrees)")]
    assert marked == [f"model.{name}" for name in ModelConfig.architecture_fields()] and "model.num_layers" in marked


@pytest.mark.parametrize("names,keys", [
    (["train.spike"], ["train.spike_factor", "train.spike_patience", "train.spike_window"]),  # keys that start so
    (["model.head"], ["model.head"]),                       # a key, though model.head_loss starts so too
    (["model.head_", "model.head"], ["model.head", "model.head_loss", "model.head_loss_chunk"]),  # in order, once
    (["parallel.backend", "objective"], ["objective.name", "objective.generator_size", "objective.rtd_weight",
                                          "objective.export_generator", "parallel.backend"]),  # a section: its keys
])
def test_explain_takes_a_section_a_key_or_the_start_of_keys(names, keys):
    from megamlm.config.explain import selected_keys
    from megamlm.config.sections import SECTIONS

    assert [f"{section}.{key}" for section, key in selected_keys(names)] == keys
    every = selected_keys([])
    assert len(every) == sum(len(dataclasses.fields(cls)) for cls in SECTIONS.values())
    optim = [f.name for f in dataclasses.fields(SECTIONS["optim"])]
    assert [key for section, key in every if section == "optim"] == optim


@pytest.mark.parametrize("name,message", [
    ("mdoel.position", "--explain mdoel.position: no section or key of that name; sections: model, objective, "
                       "parallel, data, optim, train; did you mean 'model.position'?"),
    ("mod", "--explain mod: no section or key of that name; sections: model, objective, parallel, data, optim, "
            "train; did you mean 'model'?"),
    ("model.num_layers=3", "--explain model.num_layers=3: --explain takes a section or key; put overrides before "
                           "it (megamlm config model.num_layers=3 --explain ...)"),
])
def test_explain_of_no_such_name_is_one_line(name, message):
    from megamlm.config.explain import selected_keys

    with pytest.raises(ConfigError) as err:
        selected_keys([name])
    assert str(err.value) == message
