"""megamlm's parameter names, written once: the checkpoint format's key tables (convert/fairseq.py,
convert/hf_formats.py) and the TP shard table (model/tp.py) are built from these templates. They are wave 1's
names (initialization also seeds each parameter by its name), so they never change.

Templates: {i} the layer index, {kind} weight | bias, {attn_norm} / {mlp_norm} the LayerNorm slot of
megatron's layer for the configured LayerNorm order (LAYER_NORM_SLOTS).
"""

from __future__ import annotations

import re

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
POSITION_TABLE = "embedding.positions.weight"
TOKEN_TYPES = "embedding.token_types.weight"
EMBEDDING_NORM = "embedding.layernorm.{kind}"
EMBEDDING_PROJECTION = "embedding_projection.{kind}"
ALIBI_SLOPES = "alibi.log_slopes"
QKV = "encoder.layers.{i}.self_attention.linear_qkv.{kind}"
ATTENTION_OUT = "encoder.layers.{i}.self_attention.linear_proj.{kind}"
ATTENTION_NORM = "encoder.layers.{i}.{attn_norm}.{kind}"
FC1 = "encoder.layers.{i}.mlp.linear_fc1.{kind}"
FC2 = "encoder.layers.{i}.mlp.linear_fc2.{kind}"
MLP_NORM = "encoder.layers.{i}.{mlp_norm}.{kind}"
FINAL_NORM = "encoder.final_layernorm.{kind}"
LM_HEAD_PREFIX = "lm_head."
"""The masked-LM head's parameters (LM_HEAD_* below)."""
LM_HEAD_WEIGHT = "lm_head.weight"
LM_HEAD_BIAS = "lm_head.bias"
LM_HEAD_DENSE = "lm_head.dense.{kind}"
LM_HEAD_NORM = "lm_head.layernorm.{kind}"
CLAP_BETA = "lm_head.beta"
DISCRIMINATOR_DENSE = "discriminator_head.dense.{kind}"
DISCRIMINATOR_PREDICTION = "discriminator_head.prediction.{kind}"
CLASSIFICATION_HEADS = "classification_heads."
"""fairseq's prefix of its named classification heads (`classification_heads.<name>.dense.weight`); a
model folder keeps them in their own file, and fine-tuning reads them under this prefix."""
GENERATOR_PREFIX = "generator."
"""ELECTRA's generator: an encoder's names (and its head's lm_head.*) under this prefix."""

LAYER_NORM_SLOTS = {"post": {"attn_norm": "post_attention_layernorm", "mlp_norm": "post_mlp_layernorm"},
                    "pre": {"attn_norm": "input_layernorm", "mlp_norm": "pre_mlp_layernorm"}}
"""model.layernorm -> megatron's LayerNorm slots (PostLNTransformerLayer adds the post ones)."""


def pattern(template: str) -> re.Pattern:
    """The names a template stands for ({i}: any layer, {kind}: weight | bias), also under ELECTRA's
    generator prefix (a second encoder's names)."""
    escaped = re.escape(template).replace(r"\{i\}", r"\d+").replace(r"\{kind\}", "(weight|bias)")
    return re.compile(f"({re.escape(GENERATOR_PREFIX)})?{escaped}$")


def weight_and_bias(theirs: str, ours: str) -> list[tuple[str, str]]:
    """A (their key, our key) pair of templates with {kind} -> the weight pair, then the bias pair."""
    return [(theirs.replace("{kind}", kind), ours.replace("{kind}", kind)) for kind in ("weight", "bias")]
