"""Hugging Face export: the RoBERTa-shaped variant as `RobertaForMaskedLM`, every other variant as
megamlm's own modeling file registered through `auto_map` (trust_remote_code), plus tokenizer files
whose ids are the fairseq dictionary's (as RoBERTa's vocab.json on the Hub)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from megamlm.config import ModelConfig
from megamlm.convert.fairseq import ConversionError
from megamlm.convert.hf import megamlm_to_hf_roberta, roberta_config_values
from megamlm.convert.parity import compare
from megamlm.data.tokenizer import Tokenizer, TokenizerError
from megamlm.files import staged_output

MODELING_FILE = Path(__file__).parent / "hf_modeling" / "modeling_megamlm.py"


def is_roberta(model: ModelConfig) -> bool:
    """Exactly what transformers' RobertaForMaskedLM computes (the baseline variant)."""
    return (model.position == "learned" and model.embedding_layernorm and model.head == "roberta"
            and model.layernorm == "post" and model.tie_embeddings and not model.scale_embeddings
            and not model.normalize_embeddings and not model.zero_mask and model.pad_token_id == 1)


def _roberta_config(model: ModelConfig):
    from transformers import RobertaConfig

    return RobertaConfig(**roberta_config_values(model))


def write_tokenizer(spec: str, zero_mask: bool, folder: Path) -> bool:
    """vocab.json (BPE token -> fairseq id) + merges.txt + tokenizer config; False if the model's
    tokenizer has no BPE files (a converted checkpoint with only a dict.txt)."""
    from transformers import AddedToken, RobertaTokenizer

    try:
        tokenizer = Tokenizer.load(spec, zero_clap=zero_mask)
    except (TokenizerError, OSError):
        return False
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
             overwrite: bool = False) -> None:
    """Write `model` (a pipeline.Model) as a transformers folder, load it back, compare logits."""
    from transformers import AutoModelForMaskedLM, RobertaForMaskedLM
    from safetensors.torch import save_file


    cfg = model.cfg.model
    with staged_output(out, "hf", overwrite) as tmp:
        if is_roberta(cfg):
            hf = RobertaForMaskedLM(_roberta_config(cfg))
            missing, unexpected = hf.load_state_dict(megamlm_to_hf_roberta(model.full, cfg), strict=False)
            if unexpected or [k for k in missing if not k.endswith("position_ids")]:
                raise ConversionError(f"RobertaForMaskedLM keys: missing {missing}, unexpected {unexpected}")
            hf.save_pretrained(tmp)
            kind, remote = "RobertaForMaskedLM", False
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
            kind, remote = "MegamlmForMaskedLM (trust_remote_code)", True
        if not write_tokenizer(model.cfg.data.tokenizer, cfg.zero_mask, tmp):
            report["warning"] = "no tokenizer files: the model's tokenizer has no BPE files"
        loaded = AutoModelForMaskedLM.from_pretrained(tmp, trust_remote_code=remote).eval()
        with torch.no_grad():
            theirs = loaded(input_ids=tokens, attention_mask=tokens.ne(cfg.pad_token_id).long()).logits
        report["max_diff"][f"transformers {kind}"] = compare(ours, theirs, tokens, cfg.pad_token_id,
                                                             f"transformers' {kind}", tolerance)
