"""ELECTRA's generator and transformers (`megamlm convert --from hf DISC OUT --generator GEN`, and `--to hf
... --generator GEN_OUT`): the Hub's two folders (ElectraForPreTraining + ElectraForMaskedLM, one embedding
between them) become one megamlm ELECTRA folder whose generator gives transformers' logits, continued
pretraining starts from both, and both go back."""

import pytest
import torch

from megamlm.config import ConfigError, replace_config
from megamlm.convert.fairseq import ConversionError
from megamlm.convert.pipeline import convert
from megamlm.model.embedding import token_types
from megamlm.model.folder import read_model_folder
from megamlm.objectives import get_objective, load_pretrained
from megamlm.train.loop import init_from_folder
from tests.faults_common import run_cli
from tests.test_electra_hf import save_electra
from tests.test_modernbert import QUIET


def save_generator(folder, discriminator, heads: int = 2, hidden: int = 24, ffn: int = 48, **config):
    """A random ElectraForMaskedLM of `discriminator`'s vocabulary (E = 32 != hidden: embeddings_project)
    whose embedding module is the discriminator's, as ELECTRA trains them."""
    from transformers import ElectraConfig, ElectraForMaskedLM, ElectraForPreTraining

    from tests.test_hf_bert_albert import VOCAB

    torch.manual_seed(1)
    values = dict(vocab_size=len(VOCAB), embedding_size=32, hidden_size=hidden, num_hidden_layers=2,
                  num_attention_heads=heads, intermediate_size=ffn, max_position_embeddings=40, type_vocab_size=2,
                  pad_token_id=0)
    model = ElectraForMaskedLM(ElectraConfig(**{**values, **config}))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    shared = {k: v for k, v in ElectraForPreTraining.from_pretrained(discriminator).state_dict().items()
              if k.startswith("electra.embeddings.")}
    model.load_state_dict(shared, strict=False)  # the decoder is tied: it follows the word embeddings
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("electra-pair")
    discriminator = save_electra(root / "discriminator")
    return discriminator, save_generator(root / "generator", discriminator)


@pytest.mark.parametrize("tp", [1, 2])
def test_an_electra_generator_imports_with_transformers_logits(world, tmp_path, pair, tp):
    from transformers import AutoTokenizer, ElectraForMaskedLM

    from megamlm.data.tokenizer import Tokenizer

    discriminator, generator = pair
    report = convert("hf", "megamlm", discriminator, tmp_path / "megamlm", tp=tp, generator=generator, **QUIET)
    assert report["max_diff"]["hf source"] < 1e-5 and report["max_diff"]["hf generator"] < 1e-5
    saved = read_model_folder(tmp_path / "megamlm")
    assert (saved.cfg.objective.generator_size, saved.cfg.objective.export_generator) == (0.5, True)
    assert saved.full["generator.embedding_projection.weight"].shape == (24, 32)
    assert not any(k.startswith("generator.embedding.") for k in saved.full)  # it reads the discriminator's

    # the training forward of the loaded folder (written at TP=2: read at this world's TP=1) on a sentence
    # pair through transformers' tokenizer, some tokens masked: the generator's logits are transformers'
    inputs = AutoTokenizer.from_pretrained(discriminator)("the fox and the dog", "run to the river bank",
                                                          return_tensors="pt")
    cfg, model = load_pretrained(tmp_path / "megamlm", world)
    order = torch.from_numpy(Tokenizer.load(cfg.data.tokenizer).vocab_order)  # megamlm id -> theirs
    original = torch.argsort(order)[inputs["input_ids"]]
    target_index = torch.tensor([1, 3, 7])  # flat (b, s) positions
    masked = original.flatten().index_fill(0, target_index, cfg.model.vocab_size - 1).view_as(original)
    with torch.no_grad():
        ours = model(masked, original, target_index, sampling_seed=3).generator_logits[:, :cfg.model.vocab_size]
        theirs = ElectraForMaskedLM.from_pretrained(generator).eval()(
            input_ids=order[masked], token_type_ids=token_types(masked, cfg.model)).logits
    theirs = theirs.flatten(0, 1)[target_index][:, order]  # [n, V] in megamlm's columns
    keep = torch.arange(cfg.model.vocab_size) != cfg.model.pad_token_id  # megamlm's generator never predicts it
    torch.testing.assert_close(ours[:, keep], theirs[:, keep], rtol=0, atol=1e-5)


def test_continued_pretraining_starts_from_the_imported_generator(world, tmp_path, pair):
    discriminator, generator = pair
    convert("hf", "megamlm", discriminator, tmp_path / "megamlm", generator=generator, **QUIET)
    saved = read_model_folder(tmp_path / "megamlm")
    cfg = replace_config(saved.cfg, ["train.init_from=" + str(tmp_path / "megamlm")])
    objective = get_objective(cfg)
    model = objective.build_model(world)
    init_from_folder(model, cfg, cfg.train.init_from, objective)
    params = dict(model.named_parameters())
    generator_keys = [k for k in saved.full if k.startswith("generator.")]
    assert len(generator_keys) > 10
    for key in generator_keys:  # (the model's vocabulary rows are padded: lm_head.bias)
        assert torch.equal(params[key][:len(saved.full[key])], saved.full[key]), key
    # a run whose generator has another size cannot start from this one: one line naming the setting
    cfg = replace_config(cfg, ["objective.generator_size=0.25"])
    objective = get_objective(cfg)
    with pytest.raises(ConfigError, match=r"objective\.generator_size: run 0\.25 vs 0\.5"):
        init_from_folder(objective.build_model(world), cfg, cfg.train.init_from, objective)


def _perturbed_embedding(folder, discriminator):
    from transformers import ElectraForMaskedLM

    save_generator(folder, discriminator)
    model = ElectraForMaskedLM.from_pretrained(folder)
    with torch.no_grad():
        model.electra.embeddings.position_embeddings.weight[5, 0] += 0.01
    model.save_pretrained(folder)


@pytest.mark.parametrize("make,message", [
    (lambda folder, disc: _perturbed_embedding(folder, disc),
     "electra.embeddings.position_embeddings.weight differs from the discriminator's"),
    (lambda folder, disc: save_generator(folder, disc, hidden=32),  # head size 16, the discriminator's 12
     "hidden_size=32, num_attention_heads=2, intermediate_size=48: megamlm's generator is the discriminator"),
    (lambda folder, disc: save_generator(folder, disc, num_hidden_layers=1),
     "num_hidden_layers=1 (the discriminator's: 2)"),
    (lambda folder, disc: save_generator(folder, disc, hidden_act="gelu_new"),
     "hidden_act='gelu_new' (transformers' generator head applies 'gelu'"),
    (lambda folder, disc: save_electra(folder),
     "architecture ElectraForPreTraining is not supported; --generator reads ElectraForMaskedLM"),
], ids=["embeddings", "head-size", "depth", "activation", "not-a-generator"])
def test_a_generator_megamlm_cannot_run_is_refused_in_one_line(world, tmp_path, capsys, pair, make, message):
    discriminator, _ = pair
    make(tmp_path / "generator", discriminator)
    out = tmp_path / "out"
    code, line = run_cli(capsys, "convert", "--from", "hf", "--to", "megamlm", discriminator, out,
                         "--generator", tmp_path / "generator")
    assert code == 2 and message in line, line
    assert not out.exists()


def test_generator_needs_an_electra_discriminator_from_hf(world, tmp_path, capsys, pair):
    from tests.test_hf_bert_albert import save_bert

    _, generator = pair
    bert = save_bert(tmp_path / "bert")
    code, line = run_cli(capsys, "convert", "--from", "hf", "--to", "megamlm", bert, tmp_path / "out",
                         "--generator", generator)
    assert code == 2 and "for an ELECTRA discriminator (ElectraForPreTraining)" in line and "BertForMaskedLM" in line
    code, line = run_cli(capsys, "convert", "--from", "megamlm", "--to", "megamlm", tmp_path / "any", tmp_path / "out",
                         "--generator", generator)
    assert code == 2 and "read along with --from hf or written along with --to hf" in line
    assert not (tmp_path / "out").exists()


def test_the_generator_goes_back_to_transformers(world, tmp_path, pair):
    from transformers import AutoTokenizer, ElectraForMaskedLM, ElectraForPreTraining

    discriminator, generator = pair
    convert("hf", "megamlm", discriminator, tmp_path / "megamlm", generator=generator, **QUIET)
    report = convert("megamlm", "hf", tmp_path / "megamlm", tmp_path / "back", generator=tmp_path / "back-generator",
                     **QUIET)
    assert report["max_diff"]["transformers ElectraForPreTraining"] < 1e-5
    assert report["max_diff"]["transformers ElectraForMaskedLM"] < 1e-5
    # the written pair is the Hub's pair: the same logits through transformers' own tokenizer
    inputs = AutoTokenizer.from_pretrained(tmp_path / "back-generator")("the fox and the dog", "to the river",
                                                                       return_tensors="pt")
    with torch.no_grad():
        for kind, original, written in ((ElectraForMaskedLM, generator, "back-generator"),
                                        (ElectraForPreTraining, discriminator, "back")):
            torch.testing.assert_close(kind.from_pretrained(tmp_path / written).eval()(**inputs).logits,
                                       kind.from_pretrained(original).eval()(**inputs).logits, rtol=0, atol=1e-5)
    # a discriminator alone has no generator to write: one line, nothing written
    convert("hf", "megamlm", discriminator, tmp_path / "alone", **QUIET)
    with pytest.raises(ConversionError, match="this folder has no generator"):
        convert("megamlm", "hf", tmp_path / "alone", tmp_path / "out", generator=tmp_path / "out-generator", **QUIET)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out-generator").exists()
