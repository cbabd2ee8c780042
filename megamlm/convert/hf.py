"""Hugging Face <-> megamlm tensors and config values, by the tables of convert/hf_formats.py: key renames, the
fused QKV, the position and token-type layouts, the sentence-pair and sequence-classification heads, and the
vocabulary's row order."""

from __future__ import annotations

import torch

from megamlm.config import ModelConfig
from megamlm.convert.hf_formats import MODERNBERT, POSITION_OFFSET, ROBERTA, ROBERTAS, HFFormat
from megamlm.convert.hf_modernbert import modernbert_config_values, modernbert_model_values
from megamlm.model import names

ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu",
               "swish": "silu"}
"""config.json's hidden_act -> model.activation (the first name of each is what export writes)."""

# (transformers config attribute, megamlm ModelConfig field): the same names in RobertaConfig and BertConfig
HF_CONFIG: list[tuple[str, str]] = [
    ("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"), ("num_hidden_layers", "num_layers"),
    ("num_attention_heads", "num_attention_heads"), ("intermediate_size", "ffn_hidden_size"),
    ("hidden_dropout_prob", "hidden_dropout"), ("attention_probs_dropout_prob", "attention_dropout"),
    ("layer_norm_eps", "layernorm_epsilon"),
]


def hf_config_values(model: ModelConfig, fmt: HFFormat, pad_token_id: int) -> dict:
    """The format's config keyword arguments for a megamlm model of that shape; `pad_token_id`: the
    padding's row in the exported vocabulary."""
    activation = next(theirs for theirs, ours in ACTIVATIONS.items() if ours == model.activation)
    if fmt is MODERNBERT:
        return {**modernbert_config_values(model, activation, pad_token_id), **fmt.fixed}
    values = {theirs: getattr(model, ours) for theirs, ours in HF_CONFIG + list(fmt.config)}
    if "embedding_size" in values:  # null in megamlm: the hidden size
        values["embedding_size"] = model.embedding_dim
    values["max_position_embeddings"] = model.max_positions + POSITION_OFFSET - fmt.position_rows_dropped
    values["hidden_act"] = activation
    values.update(type_vocab_size=model.token_types or 1, pad_token_id=pad_token_id)
    renamed = dict(fmt.config_names)
    values = {renamed.get(key, key): value for key, value in values.items() if renamed.get(key, key) is not None}
    return {**values, **fmt.fixed}


def standard_values(values: dict, fmt: HFFormat) -> dict:
    """config.json's values with HF_CONFIG's names (and hidden_act's) where the format names them otherwise."""
    return {**values, **{ours: values[theirs] for ours, theirs in fmt.config_names if theirs in values}}


def model_values(values: dict, fmt: HFFormat) -> dict:
    """The ModelConfig values a config.json gives (the inverse of hf_config_values)."""
    if fmt is MODERNBERT:
        return modernbert_model_values(values, ACTIVATIONS)
    values = standard_values(values, fmt)
    out = {ours: values[theirs] for theirs, ours in HF_CONFIG + list(fmt.config) if theirs in values}
    out["max_positions"] = values["max_position_embeddings"] - POSITION_OFFSET + fmt.position_rows_dropped
    out["activation"] = ACTIVATIONS[values.get("hidden_act", "gelu")]
    if fmt not in ROBERTAS:  # RoBERTa's one type is folded into the positions
        out["token_types"] = values.get("type_vocab_size", 2)
    return {**out, **fmt.variant}


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Separate q, k, v ([h, ...] rows, heads contiguous) -> megatron's fused per-head layout."""
    # [h, ...] -> [np, hn, ...] each; stack -> [np, 3, hn, ...] -> [3h, ...]
    parts = [t.reshape(num_heads, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.stack(parts, dim=1).reshape(-1, *q.shape[1:])


def split_qkv(qkv: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron's fused per-head QKV -> separate q, k, v ([h, ...] rows, heads contiguous)."""
    # [3h, ...] -> [np, 3, hn, ...]; each [:, j] -> [h, ...]
    grouped = qkv.reshape(num_heads, 3, -1, *qkv.shape[1:])
    return tuple(grouped[:, j].reshape(-1, *qkv.shape[1:]) for j in range(3))


def _rename(state: dict[str, torch.Tensor], pairs, layers: int) -> dict[str, torch.Tensor]:
    """Apply (source key, target key) pairs; pairs with {i} once per layer. Keys the source does not
    have are left out (biases of a model without, ModernBERT's layer-0 norm): the importer checks the
    HF state against transformers' own keys, and loading into megamlm's model checks the rest."""
    return {dst.format(i=i): state[src.format(i=i)] for src, dst in pairs
            for i in (range(layers) if "{i}" in src else [None]) if src.format(i=i) in state}


def _layers(model: ModelConfig) -> int:
    """Layers with parameters of their own (a shared layer: one)."""
    return 1 if model.share_layers else model.num_layers


def hf_to_megamlm(hf_state: dict[str, torch.Tensor], model: ModelConfig,
                  fmt: HFFormat = ROBERTA) -> dict[str, torch.Tensor]:
    """A RobertaForMaskedLM / BertForMaskedLM state dict (HF vocabulary order) -> full megamlm tensors."""
    out = _rename(hf_state, fmt.keys, _layers(model))
    for i in range(_layers(model)):
        for kind in ("weight", "bias") if model.bias else ("weight",):
            if fmt.fused_qkv:  # [3h, ...] -> [h, ...] each
                q, k, v = hf_state[fmt.qkv.format(i=i, kind=kind)].chunk(3)
            else:
                q, k, v = (hf_state[fmt.qkv.format(i=i, part=p, kind=kind)] for p in fmt.qkv_parts)
            out[names.QKV.format(i=i, kind=kind)] = fuse_qkv(q, k, v, model.num_attention_heads)
    if fmt.mlm_head and names.LM_HEAD_BIAS not in out:  # a decoder without bias (ModernBERT's decoder_bias: false)
        out[names.LM_HEAD_BIAS] = torch.zeros(out[names.WORD_EMBEDDINGS].shape[0])
    if not fmt.position_table:
        return out
    table = hf_state[fmt.positions]
    out[names.POSITION_TABLE] = torch.cat([table.new_zeros(fmt.position_rows_dropped, table.shape[1]), table])
    types = hf_state.get(fmt.token_types)
    if model.token_types:
        out[names.TOKEN_TYPES] = types
    elif types is not None:  # RoBERTa's one type: a constant on every position
        out[names.POSITION_TABLE] = out[names.POSITION_TABLE] + types[0]
    return out


def megamlm_to_hf(full: dict[str, torch.Tensor], model: ModelConfig,
                  fmt: HFFormat = ROBERTA) -> dict[str, torch.Tensor]:
    """The inverse: full megamlm tensors -> the format's state dict (tied decoder included)."""
    out = _rename(full, [(ours, theirs) for theirs, ours in fmt.keys], _layers(model))
    for i in range(_layers(model)):
        for kind in ("weight", "bias") if model.bias else ("weight",):
            parts = split_qkv(full[names.QKV.format(i=i, kind=kind)], model.num_attention_heads)
            if fmt.fused_qkv:
                out[fmt.qkv.format(i=i, kind=kind)] = torch.cat(parts)
                continue
            for name, tensor in zip(fmt.qkv_parts, parts):
                out[fmt.qkv.format(i=i, part=name, kind=kind)] = tensor
    if fmt.position_table:
        out[fmt.positions] = full[names.POSITION_TABLE][fmt.position_rows_dropped:]
        if fmt.token_type_table:
            out[fmt.token_types] = full.get(names.TOKEN_TYPES, torch.zeros(1, model.embedding_dim))
    if fmt.mlm_head and names.LM_HEAD_BIAS in full:  # (a folder read from a sequence classifier has none)
        out[fmt.decoder.format(kind="weight")] = full[names.WORD_EMBEDDINGS]
        out[fmt.decoder.format(kind="bias")] = full[names.LM_HEAD_BIAS]
    return out


def _pair_keys(fmt: HFFormat) -> dict[str, str]:
    """The sentence-pair head's keys: megamlm's classification head (`nsp.dense.weight`, ...) -> HF's."""
    kind, pooler, classifier = fmt.pair_head
    return {f"{kind}.{ours}.{k}": theirs.format(kind=k)
            for ours, theirs in (("dense", pooler), ("out_proj", classifier)) for k in ("weight", "bias")}


def pair_head(hf_state: dict[str, torch.Tensor], fmt: HFFormat) -> dict[str, torch.Tensor]:
    """The pretrained sentence-pair head of a pretraining checkpoint as a classification head in fairseq's
    form, named by its objective (`nsp.dense.*` the pooler, `nsp.out_proj.*` the 2-way classifier: the
    same dense -> tanh -> linear function); empty when the checkpoint has none."""
    keys = _pair_keys(fmt) if fmt.pair_head else {}
    if not keys or not all(theirs in hf_state for theirs in keys.values()):
        return {}
    return {ours: hf_state[theirs] for ours, theirs in keys.items()}


def pair_head_to_hf(heads: dict[str, torch.Tensor], fmt: HFFormat) -> dict[str, torch.Tensor]:
    """The inverse: a folder's classification head of the format's pair objective -> the pretraining
    class's keys; empty when the folder has none."""
    keys = _pair_keys(fmt) if fmt.pair_head else {}
    if not keys or not all(ours in heads for ours in keys):
        return {}
    return {theirs: heads[ours] for ours, theirs in keys.items()}


def sequence_head_to_hf(heads: dict[str, torch.Tensor], name: str, fmt: HFFormat) -> dict[str, torch.Tensor]:
    """A folder's classification head `name` (`<name>.dense.weight`, ...) -> the format's sequence-classification
    keys (a head without biases: those keys are absent)."""
    return {theirs.format(kind=kind): heads[f"{name}.{ours.format(kind=kind)}"]
            for ours, theirs in fmt.sequence_head[1] for kind in ("weight", "bias")
            if f"{name}.{ours.format(kind=kind)}" in heads}


def hf_to_sequence_head(hf_state: dict[str, torch.Tensor], name: str, fmt: HFFormat) -> dict[str, torch.Tensor]:
    """The inverse of sequence_head_to_hf: a *ForSequenceClassification's head -> the classification head `name`."""
    return {f"{name}.{ours.format(kind=kind)}": hf_state[theirs.format(kind=kind)]
            for ours, theirs in fmt.sequence_head[1] for kind in ("weight", "bias")
            if theirs.format(kind=kind) in hf_state}


VOCAB_ROWS = (names.WORD_EMBEDDINGS, names.LM_HEAD_BIAS, names.LM_HEAD_WEIGHT,
              names.GENERATOR_PREFIX + names.LM_HEAD_BIAS)
"""The full tensors whose rows are vocabulary ids."""


def permute_vocab(full: dict[str, torch.Tensor], order: torch.Tensor) -> dict[str, torch.Tensor]:
    """Reorder the vocabulary rows: new row k = old row order[k] (HF -> megamlm: WordPiece's vocab_order;
    back: its inverse)."""
    return {k: (v[order] if k in VOCAB_ROWS else v) for k, v in full.items()}
