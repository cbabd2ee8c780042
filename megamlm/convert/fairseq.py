"""fairseq RoBERTa checkpoints (upstream and the EIFY/fairseq ALiBi/CLAP fork) <-> megamlm tensors.

The architecture is read from the checkpoint's `cfg["model"]` (or `args` in pre-hydra files) with
fairseq's own defaults; the state dict is translated by one declarative table. The only steps that
are not renames: fairseq's separate q/k/v projections <-> megatron's fused per-head QKV, the tied
`lm_head.weight` copy, and classification heads kept beside the model (GLUE fine-tuning uses them).
Layout and quirks: ../shared/reference/fairseq-alibi-clap.md sections 2, 3, 7, 8.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from megamlm.errors import MegamlmError
from megamlm.config import ModelConfig
from megamlm.convert.hf import fuse_qkv, split_qkv
from megamlm.model import names
from megamlm.model.names import weight_and_bias


class ConversionError(MegamlmError):
    """A checkpoint that cannot be converted faithfully; the message says which key or knob."""


ENCODER = "encoder."
"""Prefix of every model key in current fairseq; old RoBERTa releases used `decoder.`."""

# (fairseq key below the encoder prefix, megamlm key); {i} = layer index, {attn_norm}/{mlp_norm} =
# megatron's LayerNorm slot for the configured order (see names.LAYER_NORM_SLOTS)
# megamlm key None: a bookkeeping tensor fairseq saves (no weights), kept verbatim for the way back
FAIRSEQ_KEYS: list[tuple[str, str | None]] = [
    ("sentence_encoder.version", None),
    ("sentence_encoder.embed_tokens.weight", names.WORD_EMBEDDINGS),
    ("sentence_encoder.embed_positions.weight", names.POSITION_TABLE),
    ("sentence_encoder.embed_positions._float_tensor", None),  # sinusoidal positions
    *weight_and_bias("sentence_encoder.layernorm_embedding.{kind}", names.EMBEDDING_NORM),
    *weight_and_bias("sentence_encoder.layers.{i}.self_attn.out_proj.{kind}", names.ATTENTION_OUT),
    *weight_and_bias("sentence_encoder.layers.{i}.self_attn_layer_norm.{kind}", names.ATTENTION_NORM),
    *weight_and_bias("sentence_encoder.layers.{i}.fc1.{kind}", names.FC1),
    *weight_and_bias("sentence_encoder.layers.{i}.fc2.{kind}", names.FC2),
    *weight_and_bias("sentence_encoder.layers.{i}.final_layer_norm.{kind}", names.MLP_NORM),
    *weight_and_bias("sentence_encoder.layer_norm.{kind}", names.FINAL_NORM),  # pre-LN only
    ("lm_head.beta", names.CLAP_BETA),
    ("lm_head.weight", names.LM_HEAD_WEIGHT),  # tied: the embedding table itself (same storage)
    ("lm_head.bias", names.LM_HEAD_BIAS),
    *weight_and_bias("lm_head.dense.{kind}", names.LM_HEAD_DENSE),
    *weight_and_bias("lm_head.layer_norm.{kind}", names.LM_HEAD_NORM),
]
FAIRSEQ_QKV = "sentence_encoder.layers.{i}.self_attn.{part}_proj.{kind}"
SCALARS = {names.CLAP_BETA}
"""0-dim in fairseq, shape [1] in megamlm (see ClapHead)."""
CLASSIFICATION_PREFIX = names.CLASSIFICATION_HEADS


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


_TABLE = [(_pattern(src), dst) for src, dst in FAIRSEQ_KEYS]


@dataclass
class FairseqSource:
    """What a fairseq checkpoint holds besides the weights, kept for the exact way back."""

    cfg: dict
    """The checkpoint's cfg (plain dict; a pre-hydra `args` Namespace becomes {"model": vars(args)})."""
    dtype: str = "float32"
    """Dtype of the stored floating-point weights (fp16-trained checkpoints store float16)."""
    old_names: bool = False
    """Keys used `decoder.*` / `emb_layer_norm` (old RoBERTa releases)."""
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    """The bookkeeping tensors of FAIRSEQ_KEYS (no megamlm counterpart) found in the file, verbatim."""


def fairseq_model_cfg(ckpt: dict) -> dict:
    """cfg['model'] of a hydra checkpoint or vars(args) of a pre-hydra one."""
    cfg = ckpt.get("cfg")
    if isinstance(cfg, dict) and isinstance(cfg.get("model"), dict):
        return cfg["model"]
    args = ckpt.get("args")
    if args is not None:
        return dict(vars(args))
    raise ConversionError("the checkpoint has neither cfg['model'] nor args: not a fairseq checkpoint")


def _knob(model_cfg: dict, name: str, default):
    value = model_cfg.get(name)
    if value is None and isinstance(model_cfg.get("encoder"), dict):  # hydra's nested encoder.* form
        value = model_cfg["encoder"].get(name.removeprefix("encoder_"))
    return default if value is None else value


def model_config_from_fairseq(model_cfg: dict, state: dict[str, torch.Tensor]) -> ModelConfig:
    """ModelConfig from fairseq's knobs (RoBERTa defaults where absent), checked against the weights."""
    for knob in ("encoder_layers", "encoder_embed_dim", "encoder_attention_heads", "encoder_ffn_embed_dim"):
        if _knob(model_cfg, knob, None) is None:
            raise ConversionError(f"cfg.model.{knob} is missing: not a RoBERTa encoder checkpoint")
    if _knob(model_cfg, "activation_fn", "gelu") != "gelu":
        raise ConversionError(f"cfg.model.activation_fn={model_cfg['activation_fn']}: megamlm's encoder "
                              f"uses GELU (RoBERTa); allowed: gelu")
    if float(_knob(model_cfg, "mask_prob", 0.0)) > 0:
        raise ConversionError(f"cfg.model.mask_prob={model_cfg['mask_prob']}: model-level self-masking "
                              f"(random zero-masking inside the model, also at evaluation) is not implemented")
    clap = bool(_knob(model_cfg, "contrastive_pretraining", False))
    if clap and not _knob(model_cfg, "l2norm_embedding", True):
        raise ConversionError("cfg.model.contrastive_pretraining with l2norm_embedding=false: megamlm's "
                              "CLAP head always normalizes the embedding rows")
    if _knob(model_cfg, "encoder_alibi", False):
        position, alibi_mode = "alibi", ("offset" if _knob(model_cfg, "encoder_alibi_asymmetrical", False)
                                         else "symmetric")
    elif _knob(model_cfg, "no_token_positional_embeddings", False):
        position, alibi_mode = "none", None
    else:
        position = "learned" if _knob(model_cfg, "encoder_learned_pos", True) else "sinusoidal"
        alibi_mode = None
    embed = f"{ENCODER}sentence_encoder.embed_tokens.weight"
    if embed not in state:
        raise ConversionError(f"{embed} missing from the state dict")
    max_positions = int(_knob(model_cfg, "max_positions", _knob(model_cfg, "max_source_positions", 512)))
    model = ModelConfig(
        num_layers=int(_knob(model_cfg, "encoder_layers", 0)),
        hidden_size=int(_knob(model_cfg, "encoder_embed_dim", 0)),
        num_attention_heads=int(_knob(model_cfg, "encoder_attention_heads", 0)),
        ffn_hidden_size=int(_knob(model_cfg, "encoder_ffn_embed_dim", 0)),
        vocab_size=state[embed].shape[0],
        pad_token_id=1,
        max_positions=max_positions,
        position=position,
        alibi_mode=alibi_mode,
        layernorm="pre" if _knob(model_cfg, "encoder_normalize_before", False) else "post",
        embedding_layernorm=bool(_knob(model_cfg, "layernorm_embedding", True)),
        scale_embeddings=not _knob(model_cfg, "no_scale_embedding", True),
        normalize_embeddings=clap,
        zero_mask=bool(_knob(model_cfg, "zero_masking", False)),
        head="clap" if clap else "roberta",
        tie_embeddings=not _knob(model_cfg, "untie_weights_roberta", False),
        clap_initial_beta=float(_knob(model_cfg, "initial_beta", 1.0)),
        hidden_dropout=float(_knob(model_cfg, "dropout", 0.1)),
        attention_dropout=float(_knob(model_cfg, "attention_dropout", 0.1)),
    )
    _check_against_weights(model, state)
    return model


def _check_against_weights(model: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    """The cfg must describe the weights: a mismatch means the cfg was edited or is not this model's."""
    def has(key):
        return f"{ENCODER}{key}" in state
    checks = [
        ("sentence_encoder.embed_positions.weight", model.position == "learned", "model.position=learned"),
        ("sentence_encoder.layernorm_embedding.weight", model.embedding_layernorm, "layernorm_embedding"),
        ("sentence_encoder.layer_norm.weight", model.layernorm == "pre", "encoder_normalize_before"),
        ("lm_head.beta", model.head == "clap", "contrastive_pretraining"),
        ("sentence_encoder.layers.0.fc1.weight", True, "encoder_layers >= 1"),
    ]
    for key, expected, knob in checks:
        if has(key) != expected:
            raise ConversionError(f"{ENCODER}{key} is {'missing' if expected else 'present'} but the cfg "
                                  f"says {knob}={expected}: the cfg does not describe these weights")
    if model.position == "learned":
        rows = state[f"{ENCODER}sentence_encoder.embed_positions.weight"].shape[0]
        if rows != model.max_positions + 2:
            raise ConversionError(f"embed_positions has {rows} rows, cfg max_positions={model.max_positions} "
                                  f"implies {model.max_positions + 2} (fairseq: max_positions + pad + 1)")
    layers = {int(m.group(1)) for k in state if (m := re.match(r"encoder\.sentence_encoder\.layers\.(\d+)\.", k))}
    if layers != set(range(model.num_layers)):
        raise ConversionError(f"the state dict has layers {sorted(layers)[:3]}..{max(layers)} but cfg.model."
                              f"encoder_layers={model.num_layers}")


def fairseq_to_megamlm(state: dict[str, torch.Tensor], model: ModelConfig):
    """fairseq state dict (current names) -> (megamlm full fp32 tensors, classification heads, constants)."""
    slots = names.LAYER_NORM_SLOTS[model.layernorm]
    out: dict[str, torch.Tensor] = {}
    heads: dict[str, torch.Tensor] = {}
    constants: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        if key.startswith(CLASSIFICATION_PREFIX):
            heads[key.removeprefix(CLASSIFICATION_PREFIX)] = value.float()
            continue
        if not key.startswith(ENCODER):
            raise ConversionError(f"unrecognized key {key!r} (expected encoder.* or classification_heads.*)")
        inner = key.removeprefix(ENCODER)
        m = re.match(r"sentence_encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)$", inner)
        if m:
            qkv.setdefault((int(m.group(1)), m.group(3)), {})[m.group(2)] = value.float()
            continue
        if inner == "lm_head.weight" and model.tie_embeddings:
            if not torch.equal(value, state[f"{ENCODER}sentence_encoder.embed_tokens.weight"]):
                raise ConversionError(f"{key} differs from embed_tokens but the cfg says the weights are tied "
                                      f"(untie_weights_roberta=false)")
            continue
        for pattern, target in _TABLE:
            if match := pattern.match(inner):
                if target is None:
                    constants[inner] = value
                else:
                    out[target.format(i=match.groupdict().get("i"), **slots)] = (
                        value.float().reshape(1) if target in SCALARS else value.float())
                break
        else:
            raise ConversionError(f"unrecognized key {key!r}: not in the fairseq key table "
                                  f"(megamlm/convert/fairseq.py FAIRSEQ_KEYS)")
    for (i, kind), parts in sorted(qkv.items()):
        if set(parts) != {"q", "k", "v"}:
            raise ConversionError(f"layer {i}: self_attn has {sorted(parts)} {kind} projections, need q, k, v")
        out[names.QKV.format(i=i, kind=kind)] = fuse_qkv(parts["q"], parts["k"], parts["v"],
                                                           model.num_attention_heads)
    return out, heads, constants


def megamlm_to_fairseq(full: dict[str, torch.Tensor], model: ModelConfig, source: FairseqSource,
                       heads: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """megamlm full tensors -> a fairseq state dict in fairseq's key order and the source's dtype."""
    if model.position == "alibi" and model.alibi_mode == "learned":
        raise ConversionError("model.alibi_mode=learned has no fairseq counterpart (the fork's ALiBi "
                              "slopes are fixed); allowed: symmetric, offset")
    beyond = [f"model.{key}={value}" for key, value, plain in (
        ("token_types", model.token_types, 0), ("embedding_size", model.embedding_size, None),
        ("share_layers", model.share_layers, False), ("activation", model.activation, "gelu")) if value != plain]
    beyond += model.modern_parts()
    if beyond:  # BERT / ALBERT / ModernBERT parts
        raise ConversionError(f"{', '.join(beyond)} has no fairseq counterpart (fairseq's RoBERTa); --to hf "
                              f"writes it")
    dtype = getattr(torch, source.dtype)
    slots = names.LAYER_NORM_SLOTS[model.layernorm]
    remaining = dict(full)
    state: dict[str, torch.Tensor] = {}

    def put(key: str, value: torch.Tensor) -> None:
        state[ENCODER + key] = value.to(dtype) if value.is_floating_point() else value

    def put_mapped(entries, i=None) -> None:
        for src, dst in entries:
            if dst is None:
                if src in source.constants:
                    state[ENCODER + src] = source.constants[src]  # verbatim, dtype included
                continue
            target = dst.format(i=i, **slots)
            if target in remaining:
                value = remaining.pop(target)
                put(src.format(i=i), value.reshape(()) if target in SCALARS else value)
            elif src == "lm_head.weight" and model.tie_embeddings:
                state[ENCODER + src] = state[f"{ENCODER}sentence_encoder.embed_tokens.weight"]

    layer_entries = [e for e in FAIRSEQ_KEYS if "{i}" in e[0]]
    first, last = FAIRSEQ_KEYS.index(layer_entries[0]), FAIRSEQ_KEYS.index(layer_entries[-1])
    put_mapped(FAIRSEQ_KEYS[:first])
    for i in range(model.num_layers):
        parts = {kind: dict(zip("qkv", split_qkv(remaining.pop(names.QKV.format(i=i, kind=kind)),
                                                   model.num_attention_heads))) for kind in ("weight", "bias")}
        for part in "kvq":  # fairseq's module order
            for kind in ("weight", "bias"):
                put(FAIRSEQ_QKV.format(i=i, part=part, kind=kind), parts[kind][part])
        put_mapped(layer_entries, i)
    put_mapped(FAIRSEQ_KEYS[last + 1:])
    remaining.pop(names.ALIBI_SLOPES, None)
    if remaining:
        raise ConversionError(f"megamlm keys with no fairseq counterpart: {sorted(remaining)}")
    for name, value in (heads or {}).items():
        state[CLASSIFICATION_PREFIX + name] = value.to(dtype)
    if source.old_names:
        state = {_old_name(k): v for k, v in state.items()}
    return state


def normalize_names(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool]:
    """Old RoBERTa key names -> current ones; returns (state, whether any were old)."""
    old = any(k.startswith("decoder.") or ".emb_layer_norm." in k for k in state)
    if not old:
        return state, False
    renamed = {}
    for key, value in state.items():
        if key.startswith("decoder."):
            key = ENCODER + key.removeprefix("decoder.")
        renamed[key.replace(".emb_layer_norm.", ".layernorm_embedding.")] = value
    return renamed, True


def _old_name(key: str) -> str:
    if key.startswith(ENCODER):
        key = "decoder." + key.removeprefix(ENCODER)
    return key.replace(".layernorm_embedding.", ".emb_layer_norm.")


def fairseq_cfg_for(model: ModelConfig) -> dict:
    """A fairseq cfg describing `model` (for megamlm-trained weights going to fairseq)."""
    return {
        "model": {
            "_name": "roberta", "arch": "roberta", "encoder_layers": model.num_layers,
            "encoder_embed_dim": model.hidden_size, "encoder_attention_heads": model.num_attention_heads,
            "encoder_ffn_embed_dim": model.ffn_hidden_size, "max_positions": model.max_positions,
            "activation_fn": "gelu", "dropout": model.hidden_dropout,
            "attention_dropout": model.attention_dropout, "activation_dropout": 0.0, "pooler_dropout": 0.0,
            "encoder_normalize_before": model.layernorm == "pre",
            "layernorm_embedding": model.embedding_layernorm,
            "no_scale_embedding": not model.scale_embeddings,
            "no_token_positional_embeddings": model.position in ("none", "alibi"),
            "encoder_learned_pos": model.position == "learned",
            "encoder_alibi": model.position == "alibi",
            "encoder_alibi_asymmetrical": model.alibi_mode == "offset",
            "contrastive_pretraining": model.head == "clap", "initial_beta": model.clap_initial_beta,
            "l2norm_embedding": True, "zero_masking": model.zero_mask, "mask_prob": 0.0,
            "untie_weights_roberta": not model.tie_embeddings,
        },
        "task": {"_name": "masked_lm", "omit_mask": model.zero_mask,
                 "tokens_per_sample": model.max_positions},
    }


def fairseq_checkpoint(state: dict[str, torch.Tensor], cfg: dict) -> dict:
    """The top-level structure fairseq's trainer writes (no optimizer state)."""
    return {"args": None, "cfg": cfg, "model": state, "criterion": None,
            "optimizer_history": [{"criterion_name": "MaskedLmLoss", "optimizer_name": "FairseqAdam",
                                   "lr_scheduler_state": {}, "num_updates": 0}],
            "task_state": {}, "extra_state": {}, "last_optimizer_state": None}
