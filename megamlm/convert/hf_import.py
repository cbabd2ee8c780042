"""Hugging Face import: a `RobertaForMaskedLM` folder (config.json + model.safetensors or
pytorch_model.bin, saved locally) -> megamlm's baseline variant, for continued pretraining.

The key table and the config table are `megamlm.convert.hf`'s (the export's, read the other way).
RoBERTa's vocabulary is GPT-2 BPE with fairseq's dictionary ids (`vocab.json` of roberta-base is
fairseq's dict.txt order): a 50,265-row model takes megamlm's bundled tokenizer unchanged. The
reference side of the parity check is transformers' own forward of the folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from megamlm.config import Config, load_config
from megamlm.convert.fairseq import ConversionError
from megamlm.convert.hf import (HF_DECODER, HF_ROBERTA_CONFIG, HF_ROBERTA_FIXED, POSITION_OFFSET,
                                hf_roberta_to_megamlm)
from megamlm.data.tokenizer import Tokenizer

SUPPORTED = ("RobertaForMaskedLM",)
"""Architectures `convert --from hf` reads (BertForMaskedLM, AlbertForMaskedLM: issue 18, to come)."""
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
BASELINE = Path(__file__).resolve().parents[2] / "configs" / "variants" / "baseline.yaml"


@dataclass
class HFSource:
    cfg: Config
    full: dict[str, torch.Tensor]
    reference: object
    """tokens [b, s] -> logits [b, s, V]: transformers' forward of the folder (pad masked)."""


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ConversionError(f"{folder}: no config.json: not a Hugging Face model folder")
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConversionError(f"{path}: not valid JSON ({err})") from None
    architectures = values.get("architectures") or [values.get("model_type", "unknown")]
    if architectures[0] not in SUPPORTED:
        raise ConversionError(f"{path}: architecture {architectures[0]} is not supported; "
                              f"--from hf reads {', '.join(SUPPORTED)}")
    differ = [f"{key}={values.get(key)!r} (needs {want!r})" for key, want in HF_ROBERTA_FIXED.items()
              if key in values and values[key] != want and not (key == "type_vocab_size" and values[key] >= 1)]
    if values.get("position_embedding_type", "absolute") != "absolute":
        differ.append(f"position_embedding_type={values['position_embedding_type']!r} (needs 'absolute')")
    if differ:
        raise ConversionError(f"{path}: {'; '.join(differ)}: megamlm's RoBERTa computes another function")
    return values


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        path = folder / name
        if path.is_file():
            try:
                if name.endswith(".safetensors"):
                    from safetensors.torch import load_file

                    return load_file(path)
                return torch.load(path, map_location="cpu", weights_only=True)
            except Exception as err:  # safetensors / pickle errors have no common base
                raise ConversionError(f"{path}: cannot read the weights ({type(err).__name__}: {err})") from None
    raise ConversionError(f"{folder}: no weights ({' or '.join(WEIGHT_FILES)}); sharded checkpoints: "
                          f"save them unsharded first (save_pretrained(..., max_shard_size='100GB'))")


def _check_keys(path: Path, state: dict[str, torch.Tensor], expected: dict[str, torch.Size]) -> None:
    """Every key the model needs, at its shape (the decoder, tied to the embedding, may be absent)."""
    optional = {HF_DECODER.format(kind="weight"), HF_DECODER.format(kind="bias"), "roberta.embeddings.position_ids",
                "roberta.embeddings.token_type_embeddings.weight"}
    missing = sorted(k for k in expected if k not in state and k not in optional)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ConversionError(f"{path}: missing {', '.join(missing[:3])}{more} for the shape config.json gives")
    for key, shape in expected.items():
        if key in state and tuple(state[key].shape) != tuple(shape):
            raise ConversionError(f"{path}: {key} has shape {tuple(state[key].shape)}, config.json gives "
                                  f"{tuple(shape)}")


def read_hf(folder: str | Path) -> HFSource:
    """A RobertaForMaskedLM folder in megamlm terms (checked: architecture, weights, keys, shapes)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConversionError(f"{folder}: not a folder (--from hf reads a save_pretrained folder)")
    values = _read_config(folder)
    overrides = [f"model.{ours}={values[theirs]}" for theirs, ours in HF_ROBERTA_CONFIG if theirs in values]
    max_positions = values["max_position_embeddings"] - POSITION_OFFSET
    overrides += [f"model.max_positions={max_positions}", f"data.seq_length={max_positions}"]
    bundled = len(Tokenizer.gpt2().dictionary)
    if values["vocab_size"] != bundled:
        raise ConversionError(f"{folder}/config.json: vocab_size={values['vocab_size']}, not RoBERTa's GPT-2 "
                              f"BPE ({bundled} fairseq ids): other vocabularies are not supported yet")
    cfg = load_config(BASELINE, overrides)
    state = _read_weights(folder)
    weights = next(folder / n for n in WEIGHT_FILES if (folder / n).is_file())
    _check_keys(weights, state, _expected_shapes(values))
    state = {k: v.float() for k, v in state.items()}
    decoder = state.get(HF_DECODER.format(kind="weight"))
    if decoder is not None and not torch.equal(decoder, state["roberta.embeddings.word_embeddings.weight"]):
        raise ConversionError(f"{weights}: lm_head.decoder.weight differs from the word embeddings (an untied "
                              f"decoder): megamlm's RoBERTa ties them")
    full = hf_roberta_to_megamlm(state, cfg.model)

    def reference(tokens: torch.Tensor) -> torch.Tensor:
        from transformers import RobertaForMaskedLM

        model = RobertaForMaskedLM.from_pretrained(folder, attn_implementation="eager").float().eval()
        with torch.no_grad():
            return model(input_ids=tokens, attention_mask=tokens.ne(cfg.model.pad_token_id).long()).logits

    return HFSource(cfg, full, reference)


def _expected_shapes(values: dict) -> dict[str, torch.Size]:
    """The state dict's shapes transformers gives this config.json (a model on the meta device)."""
    from transformers import RobertaConfig, RobertaForMaskedLM

    with torch.device("meta"):
        model = RobertaForMaskedLM(RobertaConfig(**values))
    return {key: tensor.shape for key, tensor in model.state_dict().items()}
