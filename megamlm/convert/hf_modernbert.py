"""transformers' ModernBertConfig <-> megamlm's model section: the ModernBERT recipe's knobs.

ModernBERT names a layer's attention by type (`layer_types`: full_attention / sliding_attention, older
config.json files `global_attn_every_n_layers`), its window by the total width (`local_attention`;
keys within local_attention // 2 on each side: megamlm's model.local_window), RoPE's θ per type
(`rope_parameters`, older files `global_rope_theta` / `local_rope_theta`) and its biases one by one
(megamlm's model.bias sets them together). transformers' ModernBertConfig reads every form; this
module reads its attributes. Dropouts: ModernBERT drops after the embedding norm (embedding_dropout =
model.hidden_dropout), on attention probabilities and after Wo (attention_dropout) and inside the MLP
(mlp_dropout, not in megamlm); its recipe trains with all of them 0, and parity is checked in eval mode.
Sequence classification (`classifier_pooling`: cls | mean) is model.classifier_pooling; its head is the
masked-LM head (the modernbert variant's model.classifier: mlm_head).
"""

from __future__ import annotations

from megamlm.config import ModelConfig

GLOBAL, LOCAL = "full_attention", "sliding_attention"
BIASES = ("attention_bias", "mlp_bias", "norm_bias", "classifier_bias")
"""ModernBertConfig's bias switches, all model.bias (its decoder_bias is the MLM head's vocabulary bias)."""


def modernbert_config_values(model: ModelConfig, activation: str, pad_token_id: int) -> dict:
    """ModernBertConfig keyword arguments for `model` (`activation`: transformers' name of model.activation)."""
    return dict(
        vocab_size=model.vocab_size, hidden_size=model.hidden_size, num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads, intermediate_size=model.ffn_hidden_size,
        hidden_activation=activation, classifier_activation=activation, max_position_embeddings=model.max_positions,
        norm_eps=model.layernorm_epsilon, decoder_bias=True, **{key: model.bias for key in BIASES},
        classifier_pooling=model.classifier_pooling,
        embedding_dropout=model.hidden_dropout, attention_dropout=model.attention_dropout, mlp_dropout=0.0,
        layer_types=[GLOBAL if layer.window is None else LOCAL for layer in model.layer_attention()],
        local_attention=model.local_window or model.max_positions,
        rope_parameters={GLOBAL: {"rope_type": "default", "rope_theta": model.rope_theta},
                         LOCAL: {"rope_type": "default", "rope_theta": model.rope_theta_local}},
        pad_token_id=pad_token_id)


def _global_every(layer_types: list[str]) -> int | None:
    """k when layer i is global exactly when i % k == 0 (1: every layer), else None."""
    for k in range(1, len(layer_types) + 1):
        if layer_types == [GLOBAL if i % k == 0 else LOCAL for i in range(len(layer_types))]:
            return k
    return None


def _config(values: dict):
    from transformers import ModernBertConfig

    return ModernBertConfig.from_dict(values)


def modernbert_problems(values: dict, activations: dict[str, str]) -> list[str]:
    """What in a ModernBertForMaskedLM config.json megamlm's modernbert variant cannot compute."""
    config = _config(values)
    problems = []
    if config.hidden_activation not in activations:
        problems.append(f"hidden_activation={config.hidden_activation!r} (needs one of {', '.join(activations)})")
    elif activations.get(config.classifier_activation) != activations[config.hidden_activation]:
        problems.append(f"classifier_activation={config.classifier_activation!r} differs from hidden_activation="
                        f"{config.hidden_activation!r} (megamlm's head uses the model's activation)")
    if len({getattr(config, key) for key in BIASES}) > 1:
        problems.append(", ".join(f"{key}={getattr(config, key)}" for key in BIASES)
                        + " (megamlm's model.bias switches them together)")
    kinds = {kind: (config.rope_parameters.get(kind) or {}) for kind in (GLOBAL, LOCAL)}
    problems += [f"rope_parameters.{kind}.rope_type={params.get('rope_type')!r} (needs 'default')"
                 for kind, params in kinds.items() if params.get("rope_type", "default") != "default"]
    every = _global_every(list(config.layer_types))
    if every is None:
        problems.append(f"layer_types={config.layer_types} (megamlm needs every k-th layer global, from layer 0)")
    elif every > 1 and config.local_attention % 2:
        problems.append(f"local_attention={config.local_attention} (megamlm's windows are even: "
                        f"local_attention // 2 keys on each side)")
    return problems


def modernbert_model_values(values: dict, activations: dict[str, str]) -> dict:
    """A ModernBertForMaskedLM config.json's values (without problems) -> ModelConfig values."""
    config = _config(values)
    kinds = {kind: (config.rope_parameters.get(kind) or {}) for kind in (GLOBAL, LOCAL)}
    every = _global_every(list(config.layer_types))
    windowed = every > 1
    return dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, ffn_hidden_size=config.intermediate_size,
        activation=activations[config.hidden_activation], max_positions=config.max_position_embeddings,
        layernorm_epsilon=config.norm_eps, bias=config.attention_bias,
        hidden_dropout=float(config.embedding_dropout), attention_dropout=float(config.attention_dropout),
        local_window=config.local_attention if windowed else None, global_every=every,
        rope_theta=float(kinds[GLOBAL].get("rope_theta", 160000.0)),
        rope_theta_local=float(kinds[LOCAL].get("rope_theta", 10000.0)), classifier_pooling=config.classifier_pooling)
