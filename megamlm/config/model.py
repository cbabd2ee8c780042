"""The model section: the encoder's architecture and how it executes (one dataclass, a docstring per field)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from megamlm.config.checks import ARCHITECTURE, ConfigError, _divisors, check_bounds, check_fields


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's queries may see within their sample (and document, with document_mask):
    every key, a sliding window, or BigBird's block-sparse pattern (window + global tokens + random
    key blocks, Zaheer et al. 2020). Hashable: the encoder prepares each distinct pattern once."""

    window: int | None = None
    """Keys within window // 2 positions of the query (None: every key, a global layer)."""
    global_tokens: int = 0
    """The sample's first global_tokens positions see, and are seen by, every token."""
    random_blocks: int = 0
    """Key blocks (of block_size positions in the sample) each query block also sees, drawn at random."""
    block_size: int = 128
    table_blocks: int = 1
    """Blocks the random draw covers (max_positions / block_size; the pattern repeats beyond)."""
    seed: int = 0
    """The random blocks' draw: the layer's index, so every layer has its own (0 without random blocks:
    one pattern for every local layer)."""

    def keys_per_query(self, seq_length: int) -> int:
        """Keys a query attends to at most (the FLOPs count): s in a global layer; the window + 1,
        the global tokens and the random blocks in a local one (overlaps counted twice: an upper bound)."""
        if self.window is None:
            return seq_length
        return min(seq_length, self.window + 1 + self.global_tokens + self.random_blocks * self.block_size)


GLOBAL_ATTENTION = LayerAttention()
"""A global layer's pattern: every key of the sample."""


@dataclass
class ModelConfig:
    """Encoder architecture. fairseq `roberta` knob names are given where they differ. Fields with
    ARCHITECTURE metadata decide which weights a model has and what they mean: a folder's weights
    load into a model only if these agree (`architecture_fields`)."""

    num_layers: int = field(default=12, metadata=ARCHITECTURE)
    """Transformer layers (fairseq `encoder_layers`)."""
    hidden_size: int = field(default=768, metadata=ARCHITECTURE)
    """Model width h (fairseq `encoder_embed_dim`)."""
    num_attention_heads: int = field(default=12, metadata=ARCHITECTURE)
    """Attention heads; must divide hidden_size and be divisible by parallel.tensor_parallel."""
    ffn_hidden_size: int = field(default=3072, metadata=ARCHITECTURE)
    """Feed-forward inner width (fairseq `encoder_ffn_embed_dim`)."""
    embedding_size: int | None = field(default=None, metadata=ARCHITECTURE)
    """ALBERT's factorized embedding E: the token (and position, token-type) tables are V × E, a
    linear layer maps E -> hidden_size, and the MLM head projects back to E before the tied table.
    None: E = hidden_size, no projection (RoBERTa, BERT)."""
    share_layers: bool = field(default=False, metadata=ARCHITECTURE)
    """ALBERT's cross-layer sharing: one layer's parameters applied num_layers times (compute as
    num_layers layers, parameters of one; post-LN only)."""
    activation: Literal["gelu", "gelu_tanh", "silu"] = field(default="gelu", metadata=ARCHITECTURE)
    """The FFN's and the MLM head's activation: exact erf GELU (fairseq, BERT, ModernBERT), its tanh
    approximation (ALBERT's `gelu_new`) or SiLU (SwiGLU with gated_ffn)."""
    gated_ffn: bool = field(default=False, metadata=ARCHITECTURE)
    """Gated linear unit FFN (megatron-core's gated_linear_unit): the first linear maps to 2 ×
    ffn_hidden_size and the FFN computes activation(first half) * second half (GeGLU with gelu,
    ModernBERT; SwiGLU with silu)."""
    bias: bool = field(default=True, metadata=ARCHITECTURE)
    """Biases in the linear layers and norms (encoder, embedding norm, MLM head's dense and norm).
    ModernBERT has none; the MLM head's vocabulary bias is kept either way (its decoder_bias)."""
    normalization: Literal["layernorm", "rmsnorm"] = field(default="layernorm", metadata=ARCHITECTURE)
    """Every norm of the model: LayerNorm, or RMSNorm (a scale only, no centering, no bias)."""
    vocab_size: int = field(default=50265, metadata=ARCHITECTURE)
    """Real vocabulary size = len(fairseq dictionary): 50265 for GPT-2 BPE with `<mask>`,
    50262 for zero-clap (no `<mask>` row, the two last madeupwords removed)."""
    pad_token_id: int = 1
    """Padding id (fairseq `<pad>` = 1). Padded keys are never attended to."""
    make_vocab_size_divisible_by: int = 128
    """The embedding is padded to a multiple of this × tensor_parallel rows; padded rows get
    logit -inf, so they never win a softmax or take probability mass."""
    max_positions: int = field(default=512, metadata=ARCHITECTURE)
    """Longest sequence the learned position table holds (it has max_positions + 2 rows, fairseq
    layout). Other position kinds accept any length."""
    position: Literal["learned", "sinusoidal", "none", "alibi", "rope"] = field(default="learned",
                                                                               metadata=ARCHITECTURE)
    """Positional encoding: learned absolute (fairseq), sinusoidal (fairseq), none, ALiBi, or rotary
    (RoPE, Su et al.: queries and keys of every head rotated by their position; ModernBERT)."""
    rope_theta: float | None = None
    """RoPE's base θ in the global layers (only with position=rope; default 10,000, ModernBERT 160,000).
    Not an architecture field: continued pretraining may raise it to extend the context."""
    rope_theta_local: float | None = None
    """RoPE's θ in the local (sliding-window) layers; null: rope_theta (ModernBERT 10,000)."""
    local_window: int | None = None
    """Sliding-window attention in the local layers: a query sees the keys within local_window / 2
    positions on each side (ModernBERT's local_attention = 128: 64 each side). null: every layer global."""
    global_every: int = 1
    """With local_window: layer i attends globally when i % global_every == 0, through the window
    otherwise (ModernBERT: 3, so layers 0, 3, 6, ... are global)."""
    local_attention: Literal["window", "bigbird"] = "window"
    """How the local layers attend: their window (ModernBERT), or BigBird's block-sparse pattern: the
    window plus bigbird_global_tokens and bigbird_random_blocks (flex, sdpa, eager; not varlen)."""
    bigbird_global_tokens: int = 2
    """bigbird: the first tokens of each sample that see and are seen by every token (BigBird ITC's
    global tokens: [CLS] and the next)."""
    bigbird_random_blocks: int = 1
    """bigbird: random key blocks each query block also sees, drawn per layer."""
    bigbird_block_size: int = 64
    """bigbird: positions per random block (BigBird's 64; FlexAttention's BlockMask blocks are 128)."""
    alibi_mode: Literal["symmetric", "offset", "learned"] | None = field(default=None, metadata=ARCHITECTURE)
    """ALiBi variant (only with position=alibi; default offset, the blog's choice): symmetric
    `-m|i-j|`; offset: keys after the query get `-m(|i-j|-0.5)`; learned: separate learnable
    slopes for keys before/after the query, initialized from Press et al."""
    layernorm: Literal["post", "pre"] = field(default="post", metadata=ARCHITECTURE)
    """post: LayerNorm after each residual add, no final LayerNorm (RoBERTa); pre: before each
    sublayer plus a final LayerNorm."""
    layernorm_epsilon: float = 1e-5
    """LayerNorm epsilon (fairseq 1e-5)."""
    embedding_layernorm: bool = field(default=True, metadata=ARCHITECTURE)
    """LayerNorm on the summed input embeddings (fairseq `layernorm_embedding`)."""
    first_layer_norm: bool = field(default=True, metadata=ARCHITECTURE)
    """pre-LN: layer 0's norm before attention. ModernBERT has none there (the embedding norm has just
    normalized layer 0's input)."""
    token_types: int = field(default=0, metadata=ARCHITECTURE)
    """Token-type (segment) embeddings added to the input: 2 for BERT, 0 for none (RoBERTa). A
    token's type is the number of separators (separator_token_id) before it in its sample, capped at
    token_types - 1: BERT's `[CLS] A [SEP] B [SEP]` gives A type 0 and B type 1, so no id tensor
    beside the tokens is needed."""
    separator_token_id: int = 2
    """The separator between a sample's segments (fairseq `</s>` = 2; BERT's [SEP] is mapped to it)."""
    scale_embeddings: bool = False
    """Multiply token embeddings by sqrt(hidden_size) (fairseq `no_scale_embedding: false`)."""
    normalize_embeddings: bool = False
    """L2-normalize input token embeddings (CLAP variants, fairseq `l2norm_embedding`)."""
    zero_mask: bool = False
    """zero-clap: token id == vocab_size is the mask token and is embedded as the zero vector."""
    head: Literal["roberta", "clap"] = field(default="roberta", metadata=ARCHITECTURE)
    """roberta: dense -> GELU -> LayerNorm -> tied weight + bias; clap: beta * <h, normalize(E)>."""
    tie_embeddings: bool = field(default=True, metadata=ARCHITECTURE)
    """Share the output projection with the input embedding (always true in the reference)."""
    clap_initial_beta: float = 1.0
    """Initial inverse temperature of the CLAP head (fairseq `initial_beta`)."""
    hidden_dropout: float = 0.1
    """Dropout on embeddings and sublayer outputs (fairseq `dropout`)."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities (fairseq `attention_dropout`)."""
    document_mask: bool = False
    """Attention stays within each document of a packed sample (data.block_mode=complete packs
    several); off = fairseq's behaviour, attention spans the whole sample."""
    attention_backend: Literal["sdpa", "eager", "flex", "varlen", "alibi-flash", "triton"] = "sdpa"
    """sdpa: PyTorch scaled_dot_product_attention with a cached additive bias (CPU and GPU);
    eager: the same math unfused (softmax, dropout, matmul; what sdpa runs on CPU with attention
    dropout), for debugging; flex: FlexAttention with the ALiBi score_mod, no materialized bias,
    memory linear in length, attention dropout in two passes (CUDA only; batches are padded to
    data.seq_length so the compiled kernel sees one shape); varlen: torch's variable-length
    FlashAttention over the real tokens only (CUDA; no ALiBi, no attention dropout); alibi-flash:
    ALiBi (fixed slopes) as extra head dimensions of two causal flash passes, no bias, memory linear
    in length (model/alibi_flash.py; attention dropout on CUDA only); triton: our Triton kernel, ALiBi
    (any mode), padding, documents, packed samples, sliding windows and attention dropout in one
    FlashAttention-style pass, skipping the key blocks no query sees (CUDA; no BigBird;
    model/triton_attention.py). model/attention.py's ATTENTION_BACKENDS."""
    flex_kernel_options: str = ""
    """FlexAttention's Triton kernel options, comma-separated NAME=VALUE (e.g. "BLOCK_M=128,BLOCK_N=64,
    num_warps=8,num_stages=3"; fwd_/bwd_ prefixes apply to one pass); empty: torch's defaults.
    `benchmarks/attention.py --flex-sweep` measures candidates (model/flex.py). Other backends ignore it,
    with a warning."""
    triton_dq: Literal["recompute", "atomic"] = "recompute"
    """How model.attention_backend=triton's backward forms dQ. recompute: a kernel of its own over each block
    of queries recomputes the scores, probabilities and dP that the dK/dV kernel had (7 matmuls per score in
    the two; deterministic); atomic: the dK/dV kernel adds each block pair's share of dQ into an fp32 sum with
    atomic adds (FlashAttention-2's way: 5 matmuls, one exponential, ~1/4 fewer instructions per score
    (benchmarks/triton_static.py); on a GPU the sum's order, and so its last bits, vary from run to run).
    Other backends ignore it, with a warning."""
    head_loss: Literal["unfused", "fused"] = "unfused"
    """How training computes the MLM loss. unfused: the head's logits [n, V_local] over the masked
    positions, then megatron's vocab-parallel cross-entropy (which copies them to fp32 and keeps the
    softmax); fused: the head's vocabulary projection and the cross-entropy in chunks of positions,
    gradients formed per chunk, so no [n, V_local] tensor is kept (model/head_loss.py; equal to
    unfused up to floating-point order). Evaluation, inference and ELECTRA's generator (which samples
    from its logits) always form the logits."""
    head_loss_chunk: int = 1 << 21
    """Logit elements per chunk of the fused head loss (8 MiB in fp32: 41 positions at V_local =
    50,304). Smaller chunks hold less, larger ones run larger matmuls (GPU: measure with
    benchmarks/head_memory.py --set model.head_loss_chunk=...)."""
    bias_activation: Literal["torch", "triton"] = "torch"
    """How the FFN applies its first linear's bias and the activation (model/bias_activation.py). torch:
    megatron-core's MLP, the add then the activation, autograd's backward (in a compiled layer Inductor's:
    on the H200 two passes over [n, f] that each recompute the activation's derivative); triton: the same
    forward, the backward (the activation's input gradient and the bias's) in one pass of a Triton kernel
    (CUDA; needs model.bias=true and model.gated_ffn=false)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialization (BERT's init; `init` may scale it per weight)."""
    init: Literal["bert", "modernbert"] = "bert"
    """How weights are drawn (model/init.py INIT_SCHEMES). bert: every weight and embedding ~
    N(0, init_std) (fairseq's init_bert_params); modernbert: transformers' ModernBERT init, a normal cut
    at ±2σ with σ = init_std for the embeddings, QKV and the first FFN linear and σ = init_std /
    sqrt(2 · num_layers) for each layer's output projections (attention out, second FFN linear) and the
    MLM head's dense layer. Biases 0 and norms 1 in both."""
    classifier: Literal["pooler", "dense_gelu", "dense_relu", "mlm_head", "linear"] = "pooler"
    """The sentence-classification head fine-tuning puts on the encoder (`megamlm glue`;
    objectives/classification.py CLASSIFIER_HEADS). pooler: dense -> tanh -> out_proj (fairseq's
    RobertaClassificationHead; BERT's pooler + classifier, dense started from the folder's pretrained
    pooler when it has one, else drawn); dense_gelu / dense_relu: the same with GELU (transformers'
    ElectraForSequenceClassification) / ReLU (DistilBertForSequenceClassification); mlm_head: the MLM
    head's transform (dense ->
    activation -> norm), started from the folder's pretrained MLM head, -> out_proj (transformers'
    ModernBertForSequenceClassification, whose `head` is the masked-LM model's); linear: out_proj alone
    (ELECTRA's fine-tuning code)."""
    classifier_pooling: Literal["cls", "mean"] = "cls"
    """The features the classification head reads: the first token's (`<s>`, [CLS]), or the mean over
    the sequence's tokens, specials included (ModernBERT's classifier_pooling)."""

    def __post_init__(self):
        check_fields(self, "model")
        for key in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                    "vocab_size", "max_positions", "make_vocab_size_divisible_by", "head_loss_chunk"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"model.{key}={getattr(self, key)} must be positive")
        check_bounds(self, "model", {"layernorm_epsilon": "> 0", "init_std": "> 0"})
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}; "
                f"allowed head counts: {_divisors(self.hidden_size, upto=64)}"
            )
        if self.alibi_mode is not None and self.position != "alibi":
            raise ConfigError(
                f"model.alibi_mode={self.alibi_mode} needs model.position=alibi, got "
                f"position={self.position} (ALiBi replaces positional embeddings, as in fairseq)"
            )
        if self.position == "alibi" and self.alibi_mode is None:
            self.alibi_mode = "offset"
        if not self.first_layer_norm and self.layernorm != "pre":
            raise ConfigError("model.first_layer_norm=false needs model.layernorm=pre (post-LN layers have no "
                              f"norm before attention), got layernorm={self.layernorm}")
        if self.embedding_size is not None and self.embedding_size <= 0:
            raise ConfigError(f"model.embedding_size={self.embedding_size} must be positive (or null: hidden_size)")
        if self.head == "clap" and self.embedding_dim != self.hidden_size:
            raise ConfigError(f"model.head=clap needs model.embedding_size=null (or {self.hidden_size}): the CLAP "
                              f"head projects hidden states onto the embedding table, got {self.embedding_size}")
        if self.share_layers and self.layernorm != "post":
            raise ConfigError("model.share_layers=true needs model.layernorm=post (ALBERT's layer); got "
                              f"layernorm={self.layernorm}")
        if self.head == "clap" and not self.tie_embeddings:
            raise ConfigError(
                "model.tie_embeddings=false is impossible with model.head=clap: the CLAP head "
                "projects onto the normalized input embedding; allowed: tie_embeddings=true"
            )
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ConfigError(
                f"model.pad_token_id={self.pad_token_id} must be in [0, model.vocab_size="
                f"{self.vocab_size})"
            )
        if self.token_types < 0 or not 0 <= self.separator_token_id < self.vocab_size:
            raise ConfigError(f"model.token_types={self.token_types} must be >= 0 and model.separator_token_id="
                              f"{self.separator_token_id} in [0, model.vocab_size={self.vocab_size})")
        for key in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"model.{key}={getattr(self, key)} must be in [0, 1)")
        if self.bias_activation == "triton" and (self.gated_ffn or not self.bias):
            raise ConfigError(f"model.bias_activation=triton fuses the FFN's first bias into its activation's "
                              f"backward: it needs model.bias=true and model.gated_ffn=false, got bias={self.bias}, "
                              f"gated_ffn={self.gated_ffn} (without that bias the backward is one pass anyway); "
                              "use model.bias_activation=torch")
        self._check_rope_and_window()

    def _check_rope_and_window(self) -> None:
        rope_set = [f"model.{key}={getattr(self, key)}" for key in ("rope_theta", "rope_theta_local")
                    if getattr(self, key) is not None]
        if rope_set and self.position != "rope":
            raise ConfigError(f"{', '.join(rope_set)} needs model.position=rope, got position={self.position} "
                              "(one position encoding at a time: RoPE replaces the position table / score term)")
        if self.position == "rope":
            self.rope_theta = self.rope_theta or 10000.0
            self.rope_theta_local = self.rope_theta_local or self.rope_theta
            if min(self.rope_theta, self.rope_theta_local) <= 1:
                raise ConfigError(f"model.rope_theta={self.rope_theta} and rope_theta_local="
                                  f"{self.rope_theta_local} must be > 1")
            if self.head_dim % 2:
                raise ConfigError(f"model.position=rope needs an even head size (rotates pairs of "
                                  f"dimensions), got hidden_size / num_attention_heads = {self.head_dim}")
        if self.global_every < 1 or self.global_every > self.num_layers:
            raise ConfigError(f"model.global_every={self.global_every} must be in [1, model.num_layers="
                              f"{self.num_layers}] (layer i is global when i % global_every == 0)")
        if self.local_window is None:
            if self.local_attention != "window":
                raise ConfigError(f"model.local_attention={self.local_attention} needs model.local_window (the "
                                  "window of its local layers) and model.global_every")
            if self.global_every > 1:
                raise ConfigError(f"model.global_every={self.global_every} needs model.local_window "
                                  "(the window of the other layers), e.g. 128")
            return
        if self.local_window <= 0 or self.local_window % 2:
            raise ConfigError(f"model.local_window={self.local_window} must be a positive even number "
                              "(a query sees local_window / 2 keys on each side)")
        if self.global_every == 1:
            raise ConfigError(f"model.local_window={self.local_window} needs model.global_every >= 2 "
                              "(with 1 every layer is global), e.g. 3")
        if self.share_layers:
            raise ConfigError("model.local_window needs layers of their own; model.share_layers=true applies "
                              "one layer everywhere")
        if min(self.bigbird_global_tokens, self.bigbird_random_blocks) < 0 or self.bigbird_block_size <= 0:
            raise ConfigError(f"model.bigbird_global_tokens={self.bigbird_global_tokens} and bigbird_random_blocks="
                              f"{self.bigbird_random_blocks} must be >= 0, bigbird_block_size="
                              f"{self.bigbird_block_size} positive")

    def modern_parts(self) -> list[str]:
        """The ModernBERT-era parts this model uses, as `model.key=value` (fairseq's RoBERTa and megamlm's
        own HF modeling file have none of them)."""
        plain = {"gated_ffn": False, "bias": True, "normalization": "layernorm", "first_layer_norm": True,
                 "local_window": None, "local_attention": "window"}
        used = ["model.position=rope"] if self.position == "rope" else []
        return used + [f"model.{key}={getattr(self, key)}" for key, value in plain.items()
                       if getattr(self, key) != value]

    def layer_attention(self) -> list[LayerAttention]:
        """Each layer's attention pattern: global for layer i % global_every == 0 (or without
        local_window), the window (or BigBird's pattern) otherwise."""
        if self.local_attention == "bigbird":
            local = dict(global_tokens=self.bigbird_global_tokens, random_blocks=self.bigbird_random_blocks,
                         block_size=self.bigbird_block_size,
                         table_blocks=-(-self.max_positions // self.bigbird_block_size))
        else:
            local = {}
        # only a random draw differs between layers; otherwise every local layer has one pattern, so
        # the backends prepare it (a bias, a BlockMask) once per forward, not once per layer
        drawn = local.get("random_blocks", 0) > 0
        return [LayerAttention() if self.local_window is None or i % self.global_every == 0 else
                LayerAttention(window=self.local_window, seed=i if drawn else 0, **local)
                for i in range(self.num_layers)]

    @property
    def embedding_dim(self) -> int:
        """Width of the embedding tables: embedding_size, or hidden_size when it is null."""
        return self.embedding_size or self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tensor_parallel: int) -> int:
        """Embedding rows: vocab_size rounded up to a multiple of divisible_by × tensor_parallel."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return -(-self.vocab_size // multiple) * multiple

    @classmethod
    def architecture_fields(cls) -> tuple[str, ...]:
        """The fields whose values must agree for weights to carry over (train.init_from)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("architecture"))

    def architecture_differences(self, other: dict) -> dict[str, tuple]:
        """"model.key" -> (this model's value, `other`'s) for the `architecture_fields` where `other`, another
        model section as a dict, differs; a key it lacks (written before the key existed) agrees."""
        return {f"model.{key}": (getattr(self, key), other[key]) for key in self.architecture_fields()
                if key in other and getattr(self, key) != other[key]}
