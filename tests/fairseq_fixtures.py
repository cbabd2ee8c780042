"""fairseq checkpoints built from the documented layout (reference section 7), small and random.

Knobs per variant are the fork's configs (section 3): what the cfg says decides which keys exist.
"""

import argparse

import torch

VARIANT_KNOBS = {
    "baseline": {},
    "learned-clap": {"contrastive_pretraining": True, "layernorm_embedding": False, "initial_beta": 1.0},
    "alibi": {"encoder_alibi": True, "encoder_alibi_asymmetrical": True, "no_token_positional_embeddings": True},
    "alibi-symmetric": {"encoder_alibi": True, "no_token_positional_embeddings": True},
    "zero-clap": {"contrastive_pretraining": True, "layernorm_embedding": False, "encoder_alibi": True,
                  "encoder_alibi_asymmetrical": True, "no_token_positional_embeddings": True,
                  "zero_masking": True, "no_scale_embedding": False},
    "sinusoidal": {"encoder_learned_pos": False},
    "no-positions": {"no_token_positional_embeddings": True},
    "pre-ln-untied": {"encoder_normalize_before": True, "untie_weights_roberta": True},
}


def fairseq_checkpoint(variant: str, dtype=torch.float32, old_names=False, hydra=True, vocab=120,
                       layers=2, dim=32, heads=4, ffn=64, max_positions=20, classification_head=False,
                       seed=0) -> dict:
    knobs = VARIANT_KNOBS[variant]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    def norm():
        return {"weight": 1 + rand(dim, scale=0.1), "bias": rand(dim, scale=0.05)}

    model_cfg = {"_name": "roberta", "arch": "roberta_base", "encoder_layers": layers, "encoder_embed_dim": dim,
                 "encoder_attention_heads": heads, "encoder_ffn_embed_dim": ffn, "max_positions": max_positions,
                 "activation_fn": "gelu", "dropout": 0.1, "attention_dropout": 0.1, **knobs}
    p = "encoder.sentence_encoder."
    state = {p + "version": torch.tensor([3.0])}
    state[p + "embed_tokens.weight"] = embed = rand(vocab, dim)
    if not knobs.get("no_token_positional_embeddings"):
        if knobs.get("encoder_learned_pos", True):
            positions = rand(max_positions + 2, dim)
            positions[1] = 0  # the padding position row
            state[p + "embed_positions.weight"] = positions
        else:
            state[p + "embed_positions._float_tensor"] = torch.zeros(1)
    if knobs.get("layernorm_embedding", True):
        state.update({p + f"layernorm_embedding.{k}": v for k, v in norm().items()})
    for i in range(layers):
        layer = f"{p}layers.{i}."
        for part in "kvq":
            state[f"{layer}self_attn.{part}_proj.weight"] = rand(dim, dim)
            state[f"{layer}self_attn.{part}_proj.bias"] = rand(dim, scale=0.05)
        state[f"{layer}self_attn.out_proj.weight"] = rand(dim, dim)
        state[f"{layer}self_attn.out_proj.bias"] = rand(dim, scale=0.05)
        state.update({f"{layer}self_attn_layer_norm.{k}": v for k, v in norm().items()})
        state[f"{layer}fc1.weight"], state[f"{layer}fc1.bias"] = rand(ffn, dim), rand(ffn, scale=0.05)
        state[f"{layer}fc2.weight"], state[f"{layer}fc2.bias"] = rand(dim, ffn), rand(dim, scale=0.05)
        state.update({f"{layer}final_layer_norm.{k}": v for k, v in norm().items()})
    if knobs.get("encoder_normalize_before"):
        state.update({p + f"layer_norm.{k}": v for k, v in norm().items()})
    if knobs.get("contrastive_pretraining"):
        state["encoder.lm_head.beta"] = torch.tensor(3.5)
        state["encoder.lm_head.weight"] = embed
    else:
        state["encoder.lm_head.weight"] = rand(vocab, dim) if knobs.get("untie_weights_roberta") else embed
        state["encoder.lm_head.bias"] = rand(vocab, scale=0.05)
        state["encoder.lm_head.dense.weight"], state["encoder.lm_head.dense.bias"] = rand(dim, dim), rand(dim)
        state.update({f"encoder.lm_head.layer_norm.{k}": v for k, v in norm().items()})
    if classification_head:
        head = "classification_heads.sentence_classification_head."
        state[head + "dense.weight"], state[head + "dense.bias"] = rand(dim, dim), rand(dim)
        state[head + "out_proj.weight"], state[head + "out_proj.bias"] = rand(3, dim), rand(3)
    if dtype != torch.float32:
        converted = {}
        for key, value in state.items():
            converted[key] = value if key.endswith("version") else value.to(dtype)
        converted["encoder.lm_head.weight"] = (converted[p + "embed_tokens.weight"]
                                               if state["encoder.lm_head.weight"] is embed
                                               else converted["encoder.lm_head.weight"])
        state = converted
    if old_names:
        state = {("decoder." + k.removeprefix("encoder.") if k.startswith("encoder.") else k)
                 .replace(".layernorm_embedding.", ".emb_layer_norm."): v for k, v in state.items()}
    task = {"_name": "masked_lm", "omit_mask": bool(knobs.get("zero_masking"))}
    ckpt = {"model": state, "optimizer_history": [{"num_updates": 10}], "extra_state": {"epoch": 1}}
    if hydra:
        common = {"fp16": dtype != torch.float32}
        ckpt.update({"args": None, "cfg": {"model": model_cfg, "task": task, "common": common}})
    else:
        ckpt["args"] = argparse.Namespace(**model_cfg)
    return ckpt
