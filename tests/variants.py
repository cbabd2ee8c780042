"""The model variants every behavioural test runs on, as config files + overrides (tiny sizes)."""

from pathlib import Path

from megamlm.config import load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

# tiny and deterministic; vocab 1100 is padded to 1152 at TP=1 and 1280 at TP=2
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.ffn_hidden_size=128", "model.vocab_size=1100", "model.max_positions=64",
        "data.seq_length=64", "model.hidden_dropout=0", "model.attention_dropout=0"]

VARIANTS = {
    "baseline": ("baseline", []),
    "learned-clap": ("learned-clap", []),
    "alibi": ("alibi", []),
    "alibi-symmetric": ("alibi", ["model.alibi_mode=symmetric"]),
    "alibi-learned": ("alibi", ["model.alibi_mode=learned"]),
    "zero-clap": ("zero-clap", []),
    "sinusoidal": ("sinusoidal", []),
    "pre-ln": ("baseline", ["model.layernorm=pre"]),
    "untied": ("baseline", ["model.tie_embeddings=false"]),
    "no-positions": ("baseline", ["model.position=none"]),
    "bert": ("bert", []),
    "albert": ("albert", ["model.embedding_size=24", "model.num_layers=3"]),
    # layer 0 global, layer 1 through a 16-token window (each side 8); 64-token samples
    "modernbert": ("modernbert", ["model.local_window=16", "model.global_every=2"]),
    # the other ModernBERT-era mix: SwiGLU, RMSNorm, biases kept (a gated fc1 bias is sharded too)
    "rope-swiglu-rmsnorm": ("modernbert", ["model.local_window=16", "model.global_every=2", "model.activation=silu",
                                           "model.normalization=rmsnorm", "model.bias=true"]),
    # BigBird's local layers: the window + 2 global tokens + 1 random block of 8 per query block
    "bigbird": ("modernbert", ["model.local_window=16", "model.global_every=2", "model.local_attention=bigbird",
                               "model.bigbird_block_size=8"]),
}


def variant_config(name: str, extra: list[str] = ()):
    file, overrides = VARIANTS[name]
    return load_config([CONFIGS / "variants" / f"{file}.yaml"], TINY + overrides + list(extra))
