"""Hugging Face import: a masked-LM folder (RoBERTa, XLM-R, CamemBERT, BERT, DistilBERT, ALBERT, ModernBERT:
config.json + model.safetensors or pytorch_model.bin, or the shards an `.index.json` maps, saved locally;
hf_weights.py) -> a megamlm model, for continued pretraining (BERT's and ALBERT's pretraining classes: with
their sentence-pair head); an `ElectraForPreTraining` one (ELECTRA's discriminator) -> megamlm's ELECTRA
model, with the generator (`ElectraForMaskedLM`, hf_electra.py) when --generator names its folder; a
`*ForSequenceClassification` -> the encoder and a classification head, no MLM head (for `megamlm glue`); a
bare encoder (`RobertaModel`, `BertModel`, ...: sentence-embedding models) -> the encoder alone.

The key tables are convert/hf_formats.py's and the conversion convert/hf.py's (the export's, read the other way).
RoBERTa's vocabulary is GPT-2 BPE with fairseq's dictionary ids (`vocab.json` of roberta-base is
fairseq's dict.txt order): a 50,265-row model takes megamlm's bundled tokenizer unchanged. BERT's
WordPiece vocab.txt and ALBERT's (SentencePiece) and ModernBERT's (byte-level BPE) tokenizer.json travel
with the model (the output's
`tokenizer/` folder) and their ids are permuted into megamlm's convention (data/pieces.py). The
reference side of the parity check is transformers' own forward of the folder.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megamlm.config import Config, ModelConfig, config_from_dict, load_config
from megamlm.convert.fairseq import ConversionError
from megamlm.convert.hf import (ACTIVATIONS, hf_to_megamlm, hf_to_sequence_head, model_values, pair_head,
                                permute_vocab, standard_values)
from megamlm.convert.hf_formats import (ALBERT, BASE_MODELS, BERT, DISTILBERT, ELECTRA, ELECTRA_GENERATOR,
                                        HF_FORMATS, MODERNBERT, PRETRAINING, ROBERTAS, SEQUENCE_CLASSIFIERS,
                                        HFFormat)
from megamlm.convert.hf_electra import check_generator_config, generator_size, generator_weights
from megamlm.convert.hf_export import SequenceClassifier
from megamlm.convert.hf_weights import check_keys, expected_shapes, read_weights
from megamlm.convert.hf_modernbert import modernbert_problems
from megamlm.data.dictionary import TokenizerError
from megamlm.data.pieces import PieceTokenizer, JsonTokenizer, WordPieceTokenizer
from megamlm.data.tokenizer import Tokenizer
from megamlm.model import names
from megamlm.model.embedding import token_types

MEGAMLM_EXPORT = "MegamlmForMaskedLM"
"""megamlm's own export of the other variants (hf_export.py: modeling_megamlm.py through auto_map)."""
SUPPORTED = (*HF_FORMATS, *PRETRAINING, *SEQUENCE_CLASSIFIERS, *BASE_MODELS, MEGAMLM_EXPORT)
"""Architectures `convert --from hf` reads."""
VARIANTS = Path(__file__).resolve().parents[2] / "configs" / "variants"
VARIANT = {"RobertaForMaskedLM": "baseline.yaml", "XLMRobertaForMaskedLM": "baseline.yaml",
           "CamembertForMaskedLM": "baseline.yaml",
           "BertForMaskedLM": "bert.yaml", "AlbertForMaskedLM": "albert.yaml",
           "ModernBertForMaskedLM": "modernbert.yaml", "ElectraForPreTraining": "bert.yaml",
           "DistilBertForMaskedLM": "bert.yaml"}
"""The megamlm variant each format is (its config file)."""


@dataclass
class HFSource:
    cfg: Config
    full: dict[str, torch.Tensor]
    reference: object
    """tokens [b, s] (megamlm ids) -> logits [b, s, V] (megamlm columns): transformers' forward of the folder."""
    tokenizer_files: dict[str, str] | None = None
    """Files of the tokenizer folder to ship with the model (BERT's WordPiece), or None (bundled GPT-2)."""
    heads: dict[str, torch.Tensor] = field(default_factory=dict)
    """A pretraining checkpoint's sentence-pair head as a classification head (hf.pair_head): kept in the
    folder's classification_heads.pt, where fine-tuning's pooler starts from it."""
    generator_reference: object = None
    """ELECTRA with --generator: tokens [b, s] -> transformers' ElectraForMaskedLM logits [b, s, V] (megamlm
    columns); None: no generator read."""
    classifier: SequenceClassifier | None = None
    """A *ForSequenceClassification read: its head (the folder's classification head of that name, `reference`
    its logits [b, labels]); None: a masked LM."""
    notes: list[str] = field(default_factory=list)
    """What the conversion should say (e.g. classifier rows kept in an order no label name confirms)."""


def _with_defaults(path: Path, values: dict, fmt: HFFormat) -> dict:
    """config.json's `values` and, for the keys it leaves out, what transformers' config class of `fmt` loads
    (its defaults, and fields derived from the values, e.g. ModernBERT's layer_types)."""
    try:
        import transformers
    except ImportError:
        raise ConversionError("--from hf needs transformers (its reference forward checks the conversion): "
                              "pip install 'megamlm[hf]'") from None
    try:
        loaded = getattr(transformers, fmt.config_class).from_dict(values).to_dict()
    except Exception as err:  # transformers' validators raise several types
        raise ConversionError(f"{path}: transformers' {fmt.config_class} refuses it: "
                              f"{str(err).strip().splitlines()[-1]}") from None
    return {**loaded, **values}


def _read_config(folder: Path, accept: tuple[str, ...] = SUPPORTED,
                 flag: str = "--from hf") -> tuple[dict, HFFormat | None]:
    """config.json's values and their format (None: megamlm's own export); `accept`: the architectures
    `flag` reads."""
    path = folder / "config.json"
    if not path.is_file():
        raise ConversionError(f"{folder}: no config.json: not a Hugging Face model folder")
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConversionError(f"{path}: not valid JSON ({err})") from None
    architectures = values.get("architectures") or [values.get("model_type", "unknown")]
    if architectures[0] not in accept:
        raise ConversionError(f"{path}: architecture {architectures[0]} is not supported; "
                              f"{flag} reads {', '.join(accept)}")
    if architectures[0] == MEGAMLM_EXPORT:
        return values, None
    fmt = {**HF_FORMATS, **PRETRAINING, **SEQUENCE_CLASSIFIERS, **BASE_MODELS,
           ELECTRA_GENERATOR.architecture: ELECTRA_GENERATOR}[architectures[0]]
    values = _with_defaults(path, values, fmt)  # a key config.json leaves out: as transformers loads it
    differ = [f"{key}={values.get(key)!r} (needs {want!r})" for key, want in fmt.fixed.items()
              if key in values and values[key] != want and not (key == "type_vocab_size" and values[key] >= 1)]
    if fmt is MODERNBERT:
        differ += modernbert_problems(values, ACTIVATIONS)
    elif (activation := standard_values(values, fmt).get("hidden_act", "gelu")) not in ACTIVATIONS:
        differ.append(f"{dict(fmt.config_names).get('hidden_act', 'hidden_act')}={activation!r} (needs one of "
                      f"{', '.join(ACTIVATIONS)})")
    if values.get("position_embedding_type", "absolute") != "absolute":
        differ.append(f"position_embedding_type={values['position_embedding_type']!r} (needs 'absolute')")
    if differ:
        raise ConversionError(f"{path}: {'; '.join(differ)}: megamlm's {fmt.prefix} computes another function")
    return values, fmt


WORDPIECE = (BERT, ELECTRA, DISTILBERT)
"""The formats whose vocabulary is BERT's WordPiece vocab.txt."""

SPECIAL_NAMES = {
    "AlbertForMaskedLM": {"cls_token": "[CLS]", "pad_token": "<pad>", "sep_token": "[SEP]", "unk_token": "<unk>",
                          "mask_token": "[MASK]", "tokenizer_class": "AlbertTokenizer"},
    **{f.architecture: {"cls_token": "<s>", "pad_token": "<pad>", "sep_token": "</s>", "unk_token": "<unk>",
                        "mask_token": "<mask>", "tokenizer_class": f.architecture.replace("ForMaskedLM", "Tokenizer")}
       for f in ROBERTAS},
    "ModernBertForMaskedLM": {"cls_token": "[CLS]", "pad_token": "[PAD]", "sep_token": "[SEP]", "unk_token": "[UNK]",
                              "mask_token": "[MASK]", "tokenizer_class": "PreTrainedTokenizerFast"}}
"""The tokenizers' special names in megamlm's order and their transformers class, where
tokenizer_config.json does not give them."""


def _setting(settings: dict, key: str, default: str) -> str:
    """tokenizer_config.json's value for `key`: a string, or an AddedToken's {"content": ...}."""
    value = settings.get(key, default)
    return value["content"] if isinstance(value, dict) else value


def _vocabulary(folder: Path, fmt: HFFormat, vocab_size: int) -> tuple[dict[str, str], PieceTokenizer]:
    """BERT's vocab.txt + casing (tokenizer_config.json's do_lower_case), or ALBERT's / ModernBERT's
    tokenizer.json + its special names, as megamlm's tokenizer files; checked to hold the model's vocabulary."""
    settings_path = folder / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text()) if settings_path.is_file() else {}
    if fmt in WORDPIECE:
        kind, source = WordPieceTokenizer, folder / "vocab.txt"
        needs = "its WordPiece vocabulary"
    else:
        kind, source = JsonTokenizer, folder / "tokenizer.json"
        needs = {ALBERT.architecture: "its SentencePiece tokenizer", MODERNBERT.architecture: "its byte-level BPE "
                 "tokenizer"}.get(fmt.architecture, f"the tokenizer of their vocabulary (vocab_size={vocab_size}, "
                                                    f"not roberta-base's GPT-2 BPE)")
    if not source.is_file():
        raise ConversionError(f"{folder}: no {source.name}: {fmt.architecture} folders need {needs} "
                              f"(tokenizer.save_pretrained(folder))")
    try:  # written by the tokenizer class itself, read back as the files to ship
        with tempfile.TemporaryDirectory() as tmp:
            if kind is WordPieceTokenizer:
                kind.write(tmp, source.read_text(encoding="utf-8").splitlines(), settings.get("do_lower_case", True))
            else:
                names = [_setting(settings, key, default) for key, default in SPECIAL_NAMES[fmt.architecture].items()]
                kind.write(tmp, source.read_text(encoding="utf-8"), tuple(names[:4]), names[4], names[5],
                           pair_separators=2 if fmt in ROBERTAS else 1)  # <s> A </s></s> B </s>
            tokenizer = kind(tmp)
            files = {name: (Path(tmp) / name).read_text(encoding="utf-8") for name in kind.FILES}
    except TokenizerError as err:  # it names the staged copy: name the folder's file
        raise ConversionError(f"{source}: {str(err).split(': ', 1)[1]}") from None
    if len(tokenizer.dictionary) != vocab_size:
        raise ConversionError(f"{source}: {len(tokenizer.dictionary)} pieces, config.json's vocab_size is "
                              f"{vocab_size}: the vocabulary is not the model's")
    return files, tokenizer


def read_hf(folder: str | Path, generator: str | Path | None = None,
            classifier: SequenceClassifier | None = None) -> HFSource:
    """A transformers folder (SUPPORTED) in megamlm terms (checked: architecture, weights, keys, shapes,
    vocabulary): a masked LM (+ a pretraining class's sentence-pair head); an ELECTRA discriminator with its
    `generator` folder (ElectraForMaskedLM: hf_electra.py) when given; a *ForSequenceClassification as the
    encoder and the classification head `classifier` names (its labels: the rows' order), no MLM head; a bare
    *Model as the encoder alone. `reference` is transformers' forward of the same class."""
    folder = Path(folder)
    for path in (folder, generator):
        if path is not None and not Path(path).is_dir():
            raise ConversionError(f"{path}: not a folder (--from hf reads a save_pretrained folder)")
    values, fmt = _read_config(folder)
    architecture = values["architectures"][0] if values.get("architectures") else MEGAMLM_EXPORT
    if generator is not None and fmt is not ELECTRA:
        raise ConversionError(f"--generator {generator}: for an ELECTRA discriminator (ElectraForPreTraining); "
                              f"{folder} holds {architecture}")
    sequence = architecture in SEQUENCE_CLASSIFIERS
    bare = architecture in BASE_MODELS  # an encoder without any head
    if classifier is not None and not sequence:
        raise ConversionError(f"--classification-head with --from hf: for a *ForSequenceClassification folder "
                              f"({', '.join(SEQUENCE_CLASSIFIERS)}); {folder} holds {architecture}")
    if fmt is None:
        return _read_megamlm_export(folder, values)
    model = model_values(values, fmt)
    overrides = [f"model.{key}={value}" for key, value in model.items()]
    overrides += [f"data.seq_length={model['max_positions']}", f"objective.name={fmt.objective}"]
    if sequence:
        classifier = _sequence_classifier(folder, values, classifier)
        overrides.append(f"model.classifier={fmt.sequence_head[0]}")
    if generator is not None:
        generator = Path(generator)
        generator_values, _ = _read_config(generator, (ELECTRA_GENERATOR.architecture,), "--generator")
        overrides += [f"objective.generator_size={generator_size(generator_values, values)}",
                      "objective.export_generator=true"]
    files, order = None, None
    if fmt in ROBERTAS and values["vocab_size"] == len(Tokenizer.gpt2().dictionary):  # roberta-base's: fairseq ids
        _check_gpt2(folder, values["vocab_size"], zero_mask=False)
    else:  # its own vocabulary: vocab.txt / tokenizer.json travel with the model
        files, tokenizer = _vocabulary(folder, fmt, values["vocab_size"])
        order = torch.from_numpy(tokenizer.vocab_order)
    cfg = load_config(VARIANTS / VARIANT[fmt.architecture], overrides)
    weights, state = read_weights(folder)
    if bare and not any(key.startswith(f"{fmt.prefix}.") for key in state):  # a bare encoder's keys lack it
        state = {f"{fmt.prefix}.{key}": value for key, value in state.items()}
    check_keys(weights, state, expected_shapes(values, fmt, sequence, bare), fmt)
    state = {k: v.float() for k, v in state.items()}
    decoder = state.get(fmt.decoder.format(kind="weight"))
    if decoder is not None and not torch.equal(decoder, state[fmt.word_embeddings]):
        raise ConversionError(f"{weights}: {fmt.decoder.format(kind='weight')} differs from the word embeddings "
                              f"(an untied decoder): megamlm's {fmt.prefix} ties them")
    full = hf_to_megamlm(state, cfg.model, fmt)
    heads = pair_head(state, fmt)
    rows, notes = None, []
    if sequence or bare:  # no MLM head (ModernBERT's `head` is the classification head's, not an MLM head's)
        full = {key: value for key, value in full.items() if not key.startswith(names.LM_HEAD_PREFIX)}
    if sequence:  # and the classification head
        head = hf_to_sequence_head(state, classifier.name, fmt)
        rows, notes = _label_rows(folder, values, classifier, len(head[f"{classifier.name}.out_proj.weight"]))
        heads = {key: value if rows is None or ".out_proj." not in key else value[rows] for key, value in head.items()}
    if generator is not None:
        full.update(_read_generator(generator, generator_values, values, cfg.model, state))
    if order is not None:
        full = permute_vocab(full, order)

    def reference(tokens: torch.Tensor, source: Path = folder, of: HFFormat = fmt) -> torch.Tensor:
        import transformers

        name = of.architecture if of is not fmt else (fmt.sequence_classification if sequence else
                                                      fmt.base_model if bare else fmt.architecture)
        model = getattr(transformers, name).from_pretrained(source, attn_implementation="eager")
        inputs = dict(attention_mask=tokens.ne(cfg.model.pad_token_id).long())
        inputs.update(input_ids=tokens if order is None else order[tokens])  # megamlm ids -> the vocabulary's
        if cfg.model.token_types:  # by the same rule as megamlm's
            inputs.update(token_type_ids=token_types(tokens, cfg.model))
        with torch.no_grad():
            output = model.float().eval()(**inputs)
        if bare and of is fmt:
            return output.last_hidden_state  # [b, s, h]
        logits = output.logits
        if sequence and of is fmt:
            return logits if rows is None else logits[:, rows]  # their classes -> the head's rows
        if order is None or not of.mlm_head:
            return logits
        return logits[..., order]  # the vocabulary's columns -> megamlm's

    generator_reference = None if generator is None else \
        (lambda tokens: reference(tokens, generator, ELECTRA_GENERATOR))
    return HFSource(cfg, full, reference, files, heads, generator_reference, classifier, notes)


def _read_generator(folder: Path, values: dict, discriminator: dict, model: ModelConfig,
                    state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The generator folder's tensors as megamlm's `generator.*` (HF vocabulary order), checked against the
    discriminator's config.json values, model section and state dict (hf_electra.py)."""
    generator = check_generator_config(folder / "config.json", values, discriminator, model)
    weights, generator_state = read_weights(folder)
    check_keys(weights, generator_state, expected_shapes(values, ELECTRA_GENERATOR), ELECTRA_GENERATOR)
    return generator_weights(generator, weights, generator_state, state)


def _sequence_classifier(folder: Path, values: dict, given: SequenceClassifier | None) -> SequenceClassifier:
    """The classification head a *ForSequenceClassification becomes: `given` (--classification-head), or named
    by config.json's finetuning_task (transformers' run_glue and megamlm's export write it)."""
    if given is not None:
        return given
    if not values.get("finetuning_task"):
        raise ConversionError(f"{folder}/config.json: a {values['architectures'][0]} without finetuning_task: name "
                              f"its classification head with --classification-head NAME (e.g. rte, which `megamlm "
                              f"glue --tasks RTE` starts from)")
    return SequenceClassifier(str(values["finetuning_task"]).lower())


def _label_rows(folder: Path, values: dict, classifier: SequenceClassifier,
                outputs: int) -> tuple[list[int] | None, list[str]]:
    """The checkpoint's classifier rows (`outputs` of them) in the order of `classifier.labels` (config.json's
    id2label names them), None when already in that order or when no names match (then a note says the order
    is kept); a head of another number of outputs than the labels is refused."""
    id2label = {int(i): str(name) for i, name in (values.get("id2label") or {}).items()}
    lowered = {i: name.lower() for i, name in id2label.items()}  # roberta-large-mnli's are CONTRADICTION, ...
    labels = classifier.labels
    if labels is None:
        return None, []
    if outputs != len(labels):
        raise ConversionError(f"{folder}: its classifier has {outputs} output(s), not the {len(labels)} labels "
                              f"{', '.join(labels)} of {classifier.name}; nothing was written")
    if sorted(lowered.values()) != sorted(label.lower() for label in labels):
        names_given = ", ".join(id2label[i] for i in sorted(id2label)) or "none: transformers' LABEL_<i>"
        return None, [f"{folder}/config.json: id2label ({names_given}) does not name {classifier.name}'s labels "
                      f"({', '.join(labels)}): the classifier's rows are kept in their order"]
    row_of = {name: i for i, name in lowered.items()}
    rows = [row_of[label.lower()] for label in labels]
    return (None if rows == sorted(rows) else rows), []


def _check_gpt2(folder: Path, vocab_size: int, zero_mask: bool) -> str:
    """The bundled tokenizer's name for a model of `vocab_size` GPT-2 rows (refused otherwise)."""
    bundled = len(Tokenizer.gpt2(zero_clap=zero_mask).dictionary)
    if vocab_size != bundled:
        raise ConversionError(f"{folder}/config.json: vocab_size={vocab_size}, not the GPT-2 BPE's {bundled} fairseq "
                              f"ids and no vocab.txt / tokenizer.json: other vocabularies are not supported yet")
    return "gpt2-zero-clap" if zero_mask else "gpt2"


def _read_megamlm_export(folder: Path, values: dict) -> HFSource:
    """megamlm's own export: config.json's `megamlm` section is the model section, the weights carry
    megamlm's names; the reference is the folder's modeling_megamlm.py run by transformers."""
    section = values.get("megamlm")
    if not isinstance(section, dict):
        raise ConversionError(f"{folder}/config.json: no 'megamlm' section: not written by `megamlm convert --to hf`")
    files = None
    if (folder / WordPieceTokenizer.VOCAB).is_file():  # exported in megamlm's id order (hf_export.py)
        files, _ = _vocabulary(folder, BERT, section.get("vocab_size", 0))
        tokenizer = "tokenizer"
    else:
        tokenizer = _check_gpt2(folder, section.get("vocab_size", 0), bool(section.get("zero_mask")))
    cfg = config_from_dict({"model": section, "data": {"tokenizer": tokenizer,
                                                       "seq_length": section.get("max_positions", 512)}},
                           origin=str(folder / "config.json"))
    _, state = read_weights(folder)
    full = {k: v.float() for k, v in state.items()}

    def reference(tokens: torch.Tensor) -> torch.Tensor:
        from transformers import AutoModelForMaskedLM

        model = AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True).float().eval()
        with torch.no_grad():
            return model(input_ids=tokens, attention_mask=tokens.ne(cfg.model.pad_token_id).long()).logits

    return HFSource(cfg, full, reference, files)
