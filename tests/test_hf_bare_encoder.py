"""transformers' bare encoders (RobertaModel, BertModel, ...: what sentence-embedding models ship) through
`megamlm convert --from hf`: a folder with the encoder and no head, checked by the encoder's output against
transformers' last_hidden_state; `megamlm glue` fine-tunes it, and continued MLM pretraining starts a new MLM
head on it."""

import json

import pytest
import torch

from megamlm.convert.fairseq import ConversionError
from megamlm.convert.pipeline import convert
from megamlm.data.tokenizer import Tokenizer
from megamlm.model.folder import read_model_folder
from megamlm.objectives import load_encoder
from tests.test_hf_classifier import QUIET, SOURCES
from tests.test_hf_classifier_import import as_transformers_class
from tests.test_hf_distilbert import save_distilbert
from tests.test_hf_xlmr import save_xlmr

BUILDERS = {**SOURCES, "DistilBert": save_distilbert, "XLMRoberta": save_xlmr}


@pytest.mark.parametrize("architecture", sorted(BUILDERS))
def test_a_bare_encoder_imports_with_transformers_hidden_states(world, tmp_path, architecture):
    from transformers import AutoModel, AutoTokenizer

    source = as_transformers_class(BUILDERS[architecture](tmp_path / "mlm"), tmp_path / "bare", "AutoModel")
    report = convert("hf", "megamlm", source, tmp_path / "megamlm", **QUIET)
    assert report["max_diff"]["hf source"] < 1e-5 and report["max_diff"]["written megamlm folder"] == 0
    saved = read_model_folder(tmp_path / "megamlm")
    assert not any(key.startswith("lm_head.") for key in saved.full) and not saved.heads
    # what `megamlm glue` reads, on a sentence pair through transformers' own tokenizer (token types: BERT, ALBERT)
    inputs = AutoTokenizer.from_pretrained(source)("the fox and the dog", "run to the river bank", return_tensors="pt",
                                                   return_token_type_ids=bool(saved.cfg.model.token_types))
    _, encoder = load_encoder(tmp_path / "megamlm", world)
    order = getattr(Tokenizer.load(saved.cfg.data.tokenizer), "vocab_order", None)  # None: the bundled GPT-2's ids
    ours = inputs["input_ids"] if order is None else torch.argsort(torch.from_numpy(order))[inputs["input_ids"]]
    with torch.no_grad():
        want = AutoModel.from_pretrained(source).eval()(**inputs).last_hidden_state
        got = encoder(ours, host_layout=(ours, None, None)).transpose(0, 1)  # [s, b, h] -> [b, s, h]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # transformers' bare class is not written back: an MLM or a classifier is
    with pytest.raises(ConversionError, match="holds no masked-LM head .* to hf with --classification-head NAME"):
        convert("megamlm", "hf", tmp_path / "megamlm", tmp_path / "back", **QUIET)


@pytest.mark.slow
def test_continued_pretraining_from_a_bare_encoder_starts_a_new_mlm_head(world, tmp_path):
    from megamlm.model.reshard import load_full_state_dict
    from megamlm.objectives import get_objective
    from megamlm.parallel import init_distributed
    from tests.test_hf_import import continue_pretraining

    source = as_transformers_class(SOURCES["Roberta"](tmp_path / "mlm"), tmp_path / "bare", "AutoModel")
    cfg, batch, losses = continue_pretraining(source, tmp_path)
    warnings = [json.loads(line) for line in (tmp_path / "run/log.jsonl").read_text().splitlines()]
    assert any(e["event"] == "warning" and "holds no masked-LM head" in e["message"] and "starts a new one"
               in e["message"] for e in warnings)
    # the first update's loss: the folder's encoder under the MLM head the run's seed draws
    model = get_objective(cfg).build_model(init_distributed(cfg.parallel))
    load_full_state_dict(model, read_model_folder(tmp_path / "start").full,
                         keep={name for name, _ in model.named_parameters() if name.startswith("lm_head.")})
    with torch.no_grad():
        loss = model(batch.inputs, batch.target_index, targets=batch.targets) / len(batch.targets)
    assert abs(losses[0] - float(loss)) < 1e-5, (losses[0], float(loss))
    assert losses[-1] < losses[0]
