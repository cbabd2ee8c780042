"""Hugging Face export: the RoBERTa-shaped variant as `RobertaForMaskedLM`, the BERT-shaped one (token
types) as `BertForMaskedLM`, the ALBERT-shaped one (factorized embedding, shared layer) as
`AlbertForMaskedLM`, the ModernBERT-shaped one (RoPE, GeGLU, pre-LN without layer 0's norm) as
`ModernBertForMaskedLM`, a BERT-shaped ELECTRA discriminator as `ElectraForPreTraining` (its generator,
with --generator, as `ElectraForMaskedLM` in a folder of its own, as the Hub keeps the two), every other
masked-LM variant as megamlm's own modeling file registered through `auto_map`
(trust_remote_code; not for the ModernBERT parts, which are refused there), plus tokenizer files: GPT-2
BPE whose ids are the fairseq dictionary's (as RoBERTa's vocab.json on the Hub), BERT's vocab.txt or
ALBERT's / ModernBERT's tokenizer.json in their own id order (the model's vocabulary rows permuted
back, convert/hf.py)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from megamlm.config import ModelConfig
from megamlm.convert.fairseq import ConversionError
from megamlm.convert.hf import (ACTIVATIONS, hf_config_values, megamlm_to_hf, pair_head_to_hf, permute_vocab,
                                sequence_head_to_hf)
from megamlm.convert.hf_formats import (ALBERT, BERT, DISTILBERT, ELECTRA, ELECTRA_GENERATOR, MODERNBERT, ROBERTA,
                                        ROBERTAS, SEQUENCE_CLASSIFIERS, TOKENIZER_FORMATS, HFFormat)
from megamlm.convert.hf_electra import HEAD_ACTIVATION
from megamlm.convert.parity import compare, megamlm_logits, without_padding_column
from megamlm.data.dictionary import TokenizerError
from megamlm.data.pieces import JsonTokenizer, WordPieceTokenizer
from megamlm.data.tokenizer import Tokenizer
from megamlm.files import staged_output
from megamlm.model import names
from megamlm.model.embedding import token_types
from megamlm.objectives.electra import generator_config, has_generator

MODELING_FILE = Path(__file__).parent / "hf_modeling" / "modeling_megamlm.py"


def hf_format(model: ModelConfig, objective: str = "mlm") -> HFFormat | None:
    """The transformers class that computes exactly what `model` does (baseline: RoBERTa; baseline +
    token types: BERT; + a factorized embedding and a shared layer: ALBERT; the modernbert variant:
    ModernBERT; ELECTRA's discriminator of BERT's shape, any embedding width: ELECTRA), or None (masked
    LM: megamlm's own modeling file)."""
    common = (model.embedding_layernorm and model.head == "roberta" and model.tie_embeddings
              and not model.scale_embeddings and not model.normalize_embeddings and not model.zero_mask
              and model.pad_token_id == 1 and model.normalization == "layernorm")
    if common and model.position == "rope" and objective != ELECTRA.objective:
        modern = (model.layernorm == "pre" and not model.first_layer_norm and model.gated_ffn
                  and model.local_attention == "window"
                  and not model.token_types and model.embedding_size in (None, model.hidden_size)
                  and not model.share_layers)
        return MODERNBERT if modern else None
    if not (common and model.position == "learned" and model.layernorm == "post" and model.bias
            and not model.gated_ffn and model.local_window is None):
        return None
    bert_tokens = model.token_types and model.separator_token_id == 2
    if objective == ELECTRA.objective:  # the discriminator: BERT's encoder, an embedding projection if E != h
        return ELECTRA if bert_tokens and not model.share_layers else None
    if model.share_layers:  # ALBERT's embedding always has its own width (a projection follows)
        return ALBERT if bert_tokens and model.embedding_size else None
    if model.embedding_size not in (None, model.hidden_size):
        return None
    if model.token_types:
        return BERT if bert_tokens else None
    return ROBERTA


@dataclass(frozen=True)
class SequenceClassifier:
    """What `convert --classification-head` exports: the folder's head `name` and its classes' names."""

    name: str
    labels: tuple[str, ...] | None = None
    """The classes in output order (a GLUE task's labels); None: transformers' LABEL_<i> (1 output: a
    regression)."""

    def config_values(self, outputs: int) -> dict:
        """config.json's num_labels, id2label / label2id and problem_type for a head of `outputs` logits."""
        if self.labels is not None and len(self.labels) != outputs:
            raise ConversionError(f"classification head {self.name!r} has {outputs} output(s), not the "
                                  f"{len(self.labels)} labels {', '.join(self.labels)}")
        values = {"num_labels": outputs, "finetuning_task": self.name,
                  "problem_type": "regression" if outputs == 1 else "single_label_classification"}
        if self.labels is not None and outputs > 1:
            values["id2label"] = dict(enumerate(self.labels))
            values["label2id"] = {label: i for i, label in enumerate(self.labels)}
        return values


def _check_sequence_head(fmt: HFFormat | None, model: ModelConfig, name: str) -> None:
    """Refuse, in one line, a classification head no transformers class computes the same way."""
    if fmt is None or fmt.sequence_head is None:
        what = "this model has no transformers class" if fmt is None else f"{fmt.architecture} has none"
        raise ConversionError(f"--classification-head {name}: exports as a *ForSequenceClassification with the "
                              f"same function, and {what} for model.classifier={model.classifier} ("
                              + ", ".join(f"{cls}: `{f.sequence_head[0]}`" for cls, f in SEQUENCE_CLASSIFIERS.items())
                              + "); nothing was written")
    if fmt.sequence_head[0] != model.classifier:
        raise ConversionError(f"--classification-head {name}: {fmt.sequence_classification} computes "
                              f"model.classifier={fmt.sequence_head[0]}, this folder's head is "
                              f"{model.classifier}; nothing was written")


def _load_tokenizer(spec: str, zero_mask: bool):
    try:
        return Tokenizer.load(spec, zero_clap=zero_mask)
    except (TokenizerError, OSError):
        return None


def write_tokenizer(tokenizer, folder: Path, wordpiece_order: bool = True) -> bool:
    """transformers tokenizer files: WordPiece's vocab.txt (BertTokenizer; lines in WordPiece order,
    or in megamlm's id order for a model that keeps megamlm's rows), a tokenizer.json
    (AlbertTokenizer, ModernBERT's PreTrainedTokenizerFast; its own order only), or vocab.json (BPE token ->
    fairseq id) + merges.txt (RobertaTokenizer); False if there are none (a converted checkpoint with
    only a dict.txt)."""
    from transformers import AddedToken, BertTokenizer, RobertaTokenizer

    if tokenizer is None:
        return False
    if isinstance(tokenizer, JsonTokenizer):
        if not wordpiece_order:
            return False  # a tokenizer.json's ids cannot be renumbered into megamlm's order here
        shutil.copyfile(tokenizer.folder / tokenizer.TOKENIZER, folder / "tokenizer.json")
        names = json.loads((tokenizer.folder / tokenizer.SPECIAL_NAMES).read_text())
        cls, pad, sep, unk = names["specials"]
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": tokenizer.tokenizer_class, "cls_token": cls, "bos_token": cls, "pad_token": pad,
             "sep_token": sep, "eos_token": sep, "unk_token": unk, "mask_token": names["mask"]}, indent=1))
        return True
    if isinstance(tokenizer, WordPieceTokenizer):
        pieces = (tokenizer.folder / tokenizer.VOCAB).read_text(encoding="utf-8").splitlines()
        lines = pieces if wordpiece_order else [pieces[i] for i in tokenizer.vocab_order]
        (folder / "vocab.txt").write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
        BertTokenizer(vocab=str(folder / "vocab.txt"), do_lower_case=tokenizer.lowercase).save_pretrained(folder)
        return True
    bpe_ids = json.loads(tokenizer.encoder_json.read_text(encoding="utf-8"))
    token_of = {i: token for token, i in bpe_ids.items()}
    vocab = {}
    for fairseq_id, symbol in enumerate(tokenizer.dictionary.symbols):
        vocab[token_of[int(symbol)] if symbol.isdigit() else symbol] = fairseq_id
    vocab["<mask>"] = tokenizer.dictionary.mask_id  # = vocab size for zero-clap (embedded as zeros)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    shutil.copyfile(tokenizer.vocab_bpe, folder / "merges.txt")
    # lstrip: "is <mask>." -> "is" + " Paris", as fairseq's fill_mask and roberta-base on the Hub
    mask = AddedToken("<mask>", lstrip=True, rstrip=False, normalized=False, special=True)
    RobertaTokenizer(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"),
                     mask_token=mask).save_pretrained(folder)
    return True


def write_hf(model, out: Path, tokens: torch.Tensor, ours: torch.Tensor, tolerance: float, report: dict,
             overwrite: bool = False, classifier: SequenceClassifier | None = None,
             generator: Path | None = None) -> None:
    """Write `model` (a pipeline.Model) as a transformers folder, load it back, compare logits (with
    `classifier`: its classification head as the format's *ForSequenceClassification, `ours` its logits;
    with `generator`: an ELECTRA folder's generator also, as ElectraForMaskedLM there)."""
    import transformers
    from safetensors.torch import save_file

    cfg = model.cfg.model
    objective = model.cfg.objective.name
    tokenizer = _load_tokenizer(model.cfg.data.tokenizer, cfg.zero_mask)
    fmt = _export_format(cfg, objective, tokenizer, classifier is not None)
    if classifier is not None:
        _check_sequence_head(fmt, cfg, classifier.name)
    if fmt is None and objective == ELECTRA.objective:
        raise ConversionError("objective.name=electra: conversion to hf writes the discriminator as "
                              "ElectraForPreTraining, which has BERT's shape (learned positions, token types, "
                              "post-LN, biases, layer norms, separate layers); this model differs")
    if fmt is None and cfg.modern_parts():
        raise ConversionError(f"{', '.join(cfg.modern_parts())}: only the modernbert variant's mix of these "
                              f"exports (as ModernBertForMaskedLM); megamlm's own modeling file has none of them")
    order = getattr(tokenizer, "vocab_order", None)  # megamlm id -> WordPiece row
    order = None if order is None else torch.from_numpy(order)
    with staged_output(out, "hf", overwrite) as tmp:
        if fmt is not None:
            pad = cfg.pad_token_id if order is None else int(order[cfg.pad_token_id])  # in the exported vocabulary
            full = model.full if order is None else permute_vocab(model.full, torch.argsort(order))  # its row order
            values = hf_config_values(cfg, fmt, pad)
            if fmt in ROBERTAS and order is not None:  # the vocabulary's own <s> and </s> (CamemBERT's 5 and 6)
                values.update(bos_token_id=int(order[0]), eos_token_id=int(order[2]))
            state = megamlm_to_hf(full, cfg, fmt)
            if classifier is not None:  # the classification head replaces the MLM head (unused keys: dropped)
                hf = fmt.build({**values, **classifier.config_values(ours.shape[-1])}, classifier=True)
                state = {**state, **sequence_head_to_hf(model.heads, classifier.name, fmt)}
                state = {key: value for key, value in state.items() if key in hf.state_dict()}
            else:
                pair = pair_head_to_hf(model.heads, fmt)  # kept: the pretraining class, as bert-base's folder
                hf = fmt.build(values, pretraining=bool(pair))
                state = {**state, **pair}
            missing, unexpected = hf.load_state_dict(state, strict=False)
            if unexpected or [k for k in missing if not k.endswith(("position_ids", "token_type_ids"))]:
                raise ConversionError(f"{type(hf).__name__} keys: missing {missing}, unexpected {unexpected}")
            hf.save_pretrained(tmp)
            kind, remote = fmt.sequence_classification if classifier else fmt.architecture, False
        else:
            config = {"model_type": "megamlm", "architectures": ["MegamlmForMaskedLM"],
                      "auto_map": {"AutoConfig": "modeling_megamlm.MegamlmConfig",
                                   "AutoModelForMaskedLM": "modeling_megamlm.MegamlmForMaskedLM"},
                      "megamlm": model.cfg.to_dict()["model"], "pad_token_id": cfg.pad_token_id,
                      "bos_token_id": 0, "eos_token_id": 2}
            (tmp / "config.json").write_text(json.dumps(config, indent=1))
            shutil.copyfile(MODELING_FILE, tmp / MODELING_FILE.name)
            save_file({k: v.contiguous() for k, v in model.full.items()}, tmp / "model.safetensors",
                      metadata={"format": "pt"})
            kind, remote, order = "MegamlmForMaskedLM (trust_remote_code)", True, None
        if not write_tokenizer(tokenizer, tmp, wordpiece_order=order is not None):
            report["warning"] = "no tokenizer files: the model's tokenizer cannot be written for this model"
        masked_lm = fmt is None or fmt.mlm_head
        auto = transformers.AutoModelForMaskedLM if masked_lm else transformers.AutoModelForPreTraining
        if classifier is not None:
            auto, masked_lm = transformers.AutoModelForSequenceClassification, False
        loaded = auto.from_pretrained(tmp, trust_remote_code=remote).eval()
        theirs = _transformers_logits(loaded, cfg, tokens, order, fmt is not None and cfg.token_types, masked_lm)
        report["max_diff"][f"transformers {kind}"] = compare(ours, theirs, tokens, cfg.pad_token_id,
                                                             f"transformers' {kind}", tolerance, classifier is not None)
        if generator is not None:  # (ELECTRA: fmt is set) inside: a generator that fails leaves nothing written
            _write_generator(model, full, pad, generator, tokenizer, order, tokens, tolerance, report, overwrite)


def _transformers_logits(loaded, cfg: ModelConfig, tokens: torch.Tensor, order: torch.Tensor | None,
                         with_token_types: bool, vocabulary_columns: bool) -> torch.Tensor:
    """A transformers model's logits on megamlm's probe tokens [b, s] (`order`: megamlm id -> the exported
    vocabulary's row; `vocabulary_columns`: the logits have a column per symbol, put back in megamlm's order)."""
    inputs = dict(input_ids=tokens if order is None else order[tokens],
                  attention_mask=tokens.ne(cfg.pad_token_id).long())
    if with_token_types:
        inputs["token_type_ids"] = token_types(tokens, cfg)
    with torch.no_grad():
        theirs = loaded(**inputs).logits
    return theirs[..., order] if order is not None and vocabulary_columns else theirs  # their columns -> ours


def _export_format(model: ModelConfig, objective: str, tokenizer, classifier: bool) -> HFFormat | None:
    """hf_format's class, refined by the tokenizer where the same model came as another class: XLM-R's and
    CamemBERT's (the class their tokenizer names) and DistilBERT's (a BERT vocabulary and its LayerNorm eps:
    RoBERTa's positions would read id 1 as padding) for the masked LM and its own classifier (dense_relu;
    a `pooler` head goes out as RoBERTa's classifier, the same function)."""
    fmt = hf_format(model, objective)
    if fmt is not ROBERTA:
        return fmt
    fmt = TOKENIZER_FORMATS.get(getattr(tokenizer, "tokenizer_class", None), ROBERTA)
    if (fmt is ROBERTA and (not classifier or model.classifier == DISTILBERT.sequence_head[0])
            and isinstance(tokenizer, WordPieceTokenizer)
            and model.layernorm_epsilon == DISTILBERT.variant["layernorm_epsilon"]):
        return DISTILBERT
    return fmt


def _write_generator(model, full: dict[str, torch.Tensor], pad: int, out: Path, tokenizer,
                     order: torch.Tensor | None, tokens: torch.Tensor, tolerance: float, report: dict,
                     overwrite: bool) -> None:
    """An ELECTRA folder's generator as transformers' ElectraForMaskedLM in `out` (the embedding module
    copied from the discriminator's, as the Hub's generator folders hold it), loaded back and compared;
    `full`, `pad`: the folder's tensors and padding id in the exported vocabulary's order."""
    import transformers

    cfg = model.cfg.model
    if not has_generator(model.full):
        raise ConversionError("--generator: this folder has no generator (exported with "
                              "objective.export_generator=false); nothing was written")
    if cfg.activation != ACTIVATIONS[HEAD_ACTIVATION]:
        raise ConversionError(f"--generator: model.activation={cfg.activation}, and transformers' ElectraForMaskedLM "
                              f"head applies {HEAD_ACTIVATION!r} whatever hidden_act says; nothing was written")
    generator = generator_config(cfg, model.cfg.objective.generator_size)
    values = {**hf_config_values(generator, ELECTRA_GENERATOR, pad), "embedding_size": cfg.embedding_dim}
    own = {key.removeprefix(names.GENERATOR_PREFIX): value for key, value in full.items()
           if key.startswith(names.GENERATOR_PREFIX) or key.startswith("embedding.")}
    hf = ELECTRA_GENERATOR.build(values)
    missing, unexpected = hf.load_state_dict(megamlm_to_hf(own, generator, ELECTRA_GENERATOR), strict=False)
    if unexpected or [k for k in missing if not k.endswith(("position_ids", "token_type_ids"))]:
        raise ConversionError(f"ElectraForMaskedLM keys: missing {missing}, unexpected {unexpected}")
    with staged_output(out, "hf", overwrite) as tmp:
        hf.save_pretrained(tmp)
        write_tokenizer(tokenizer, tmp, wordpiece_order=order is not None)
        loaded = transformers.AutoModelForMaskedLM.from_pretrained(tmp).eval()
        ours = megamlm_logits(model.cfg, model.full, tokens, generator=True)
        theirs = _transformers_logits(loaded, cfg, tokens, order, True, True)
        report.setdefault("symbols", {})["transformers ElectraForMaskedLM"] = ours.shape[-1]
        report["max_diff"]["transformers ElectraForMaskedLM"] = compare(
            ours, without_padding_column(theirs, cfg.pad_token_id), tokens, cfg.pad_token_id,
            "transformers' ElectraForMaskedLM (the generator)", tolerance)
