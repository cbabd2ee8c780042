"""Hugging Face `RobertaForMaskedLM` / `BertForMaskedLM` <-> megamlm key tables (full TP=1 tensors).

One declarative table per format maps each HF key to a megamlm key (`HFFormat.keys`); the only
non-renaming steps are written next to it:
- megatron's fused QKV (per head [q_h; k_h; v_h] rows) <-> HF's separate query / key / value;
- positions: megamlm's table has fairseq's layout (row 2 is the first token's, `POSITION_OFFSET`).
  RoBERTa's table is that layout already; BERT's row 0 is the first token's, so its rows go to
  rows 2... and rows 0-1 (padding's) are zero;
- token types: RoBERTa has a single type whose row is a constant added everywhere (folded into the
  position table); BERT's two rows are megamlm's `model.token_types` table;
- vocabulary rows: RoBERTa's ids are fairseq's; BERT's WordPiece ids are permuted into megamlm's
  (data/tokenizer.py: WordPieceTokenizer.vocab_order), by the importer / exporter, which hold the vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megamlm.config import ModelConfig
from megamlm.model import names
from megamlm.model.names import weight_and_bias

# RoBERTa and BERT are post-LN: megatron's post-LN slots
POST_LN = {"attention": names.ATTENTION_NORM.replace("{attn_norm}", names.LAYER_NORM_SLOTS["post"]["attn_norm"]),
           "mlp": names.MLP_NORM.replace("{mlp_norm}", names.LAYER_NORM_SLOTS["post"]["mlp_norm"])}
POSITION_OFFSET = 2
"""megamlm's (fairseq's) position table has max_positions + 2 rows: rows 0-1 unused, padding_idx 1."""


def _body(prefix: str) -> list[tuple[str, str]]:
    """(HF key, megamlm key) of the encoder shared by RobertaModel and BertModel; {i}: the layer."""
    layer = f"{prefix}.encoder.layer.{{i}}"
    return [
        (f"{prefix}.embeddings.word_embeddings.weight", names.WORD_EMBEDDINGS),
        *weight_and_bias(f"{prefix}.embeddings.LayerNorm.{{kind}}", names.EMBEDDING_NORM),
        *weight_and_bias(f"{layer}.attention.output.dense.{{kind}}", names.ATTENTION_OUT),
        *weight_and_bias(f"{layer}.attention.output.LayerNorm.{{kind}}", POST_LN["attention"]),
        *weight_and_bias(f"{layer}.intermediate.dense.{{kind}}", names.FC1),
        *weight_and_bias(f"{layer}.output.dense.{{kind}}", names.FC2),
        *weight_and_bias(f"{layer}.output.LayerNorm.{{kind}}", POST_LN["mlp"]),
    ]


@dataclass(frozen=True)
class HFFormat:
    """One transformers masked-LM class in megamlm terms."""

    architecture: str
    """The class name config.json's `architectures` gives."""
    prefix: str
    """The encoder's attribute (roberta, bert)."""
    keys: list[tuple[str, str]]
    """(HF key, megamlm key) pairs that are pure renames; {i}: the layer, {kind}: weight | bias."""
    head: str
    """The MLM head's prefix; its decoder (`{head}.decoder`) is tied to the word embeddings."""
    position_rows_dropped: int
    """megamlm position rows before HF's row 0 (RoBERTa 0: same layout; BERT 2)."""
    fixed: dict
    """config.json values the format must have for megamlm to compute the same function."""

    @property
    def qkv(self) -> str:
        return f"{self.prefix}.encoder.layer.{{i}}.attention.self.{{part}}.{{kind}}"

    @property
    def positions(self) -> str:
        return f"{self.prefix}.embeddings.position_embeddings.weight"

    @property
    def token_types(self) -> str:
        return f"{self.prefix}.embeddings.token_type_embeddings.weight"

    @property
    def decoder(self) -> str:
        return f"{self.head}.decoder.{{kind}}"


ROBERTA = HFFormat(
    "RobertaForMaskedLM", "roberta",
    _body("roberta") + [*weight_and_bias("lm_head.dense.{kind}", names.LM_HEAD_DENSE),
                        *weight_and_bias("lm_head.layer_norm.{kind}", names.LM_HEAD_NORM),
                        ("lm_head.bias", names.LM_HEAD_BIAS)],
    head="lm_head", position_rows_dropped=0,
    fixed={"hidden_act": "gelu", "type_vocab_size": 1, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
           "tie_word_embeddings": True})
BERT = HFFormat(
    "BertForMaskedLM", "bert",
    _body("bert") + [*weight_and_bias("cls.predictions.transform.dense.{kind}", names.LM_HEAD_DENSE),
                     *weight_and_bias("cls.predictions.transform.LayerNorm.{kind}", names.LM_HEAD_NORM),
                     ("cls.predictions.bias", names.LM_HEAD_BIAS)],
    head="cls.predictions", position_rows_dropped=POSITION_OFFSET,
    fixed={"hidden_act": "gelu", "tie_word_embeddings": True})
HF_FORMATS = {f.architecture: f for f in (ROBERTA, BERT)}

# (transformers config attribute, megamlm ModelConfig field): the same names in RobertaConfig and BertConfig
HF_CONFIG: list[tuple[str, str]] = [
    ("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"), ("num_hidden_layers", "num_layers"),
    ("num_attention_heads", "num_attention_heads"), ("intermediate_size", "ffn_hidden_size"),
    ("hidden_dropout_prob", "hidden_dropout"), ("attention_probs_dropout_prob", "attention_dropout"),
    ("layer_norm_eps", "layernorm_epsilon"),
]


def hf_config_values(model: ModelConfig, fmt: HFFormat) -> dict:
    """RobertaConfig / BertConfig keyword arguments for a megamlm model of that shape."""
    values = {theirs: getattr(model, ours) for theirs, ours in HF_CONFIG}
    values["max_position_embeddings"] = model.max_positions + POSITION_OFFSET - fmt.position_rows_dropped
    if fmt is BERT:
        values.update(type_vocab_size=model.token_types, pad_token_id=0)
    return {**values, **fmt.fixed}


def max_positions(values: dict, fmt: HFFormat) -> int:
    """model.max_positions of a config.json (its max_position_embeddings)."""
    return values["max_position_embeddings"] - POSITION_OFFSET + fmt.position_rows_dropped


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


def _rename(state: dict[str, torch.Tensor], pairs, num_layers: int) -> dict[str, torch.Tensor]:
    """Apply (source key, target key) pairs; pairs with {i} once per layer."""
    return {dst.format(i=i): state[src.format(i=i)] for src, dst in pairs
            for i in (range(num_layers) if "{i}" in src else [None])}


def hf_to_megamlm(hf_state: dict[str, torch.Tensor], model: ModelConfig,
                  fmt: HFFormat = ROBERTA) -> dict[str, torch.Tensor]:
    """A RobertaForMaskedLM / BertForMaskedLM state dict (HF vocabulary order) -> full megamlm tensors."""
    out = _rename(hf_state, fmt.keys, model.num_layers)
    for i in range(model.num_layers):
        for kind in ("weight", "bias"):
            q, k, v = (hf_state[fmt.qkv.format(i=i, part=p, kind=kind)] for p in ("query", "key", "value"))
            out[names.QKV.format(i=i, kind=kind)] = fuse_qkv(q, k, v, model.num_attention_heads)
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
    out = _rename(full, [(ours, theirs) for theirs, ours in fmt.keys], model.num_layers)
    for i in range(model.num_layers):
        for kind in ("weight", "bias"):
            parts = split_qkv(full[names.QKV.format(i=i, kind=kind)], model.num_attention_heads)
            for name, tensor in zip(("query", "key", "value"), parts):
                out[fmt.qkv.format(i=i, part=name, kind=kind)] = tensor
    out[fmt.positions] = full[names.POSITION_TABLE][fmt.position_rows_dropped:]
    out[fmt.token_types] = full.get(names.TOKEN_TYPES, torch.zeros(1, model.hidden_size))
    out[fmt.decoder.format(kind="weight")] = full[names.WORD_EMBEDDINGS]
    out[fmt.decoder.format(kind="bias")] = full[names.LM_HEAD_BIAS]
    return out


VOCAB_ROWS = (names.WORD_EMBEDDINGS, names.LM_HEAD_BIAS, names.LM_HEAD_WEIGHT)
"""The full tensors whose rows are vocabulary ids."""


def permute_vocab(full: dict[str, torch.Tensor], order: torch.Tensor) -> dict[str, torch.Tensor]:
    """Reorder the vocabulary rows: new row k = old row order[k] (HF -> megamlm: WordPiece's vocab_order;
    back: its inverse)."""
    return {k: (v[order] if k in VOCAB_ROWS else v) for k, v in full.items()}
