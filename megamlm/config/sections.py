"""The config sections: one dataclass per YAML section, a docstring per field, checks on build
(the model section is in model.py, the train section in training.py)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Literal

import yaml

from megamlm.config.checks import ConfigError, _divisors, check_bounds, check_fields, unmet
from megamlm.config.model import ModelConfig
from megamlm.config.training import TrainConfig



@dataclass
class ParallelConfig:
    """How the world is split. World size = tensor_parallel × data parallel (derived)."""

    tensor_parallel: int = 1
    """Tensor-parallel degree: attention heads, FFN columns and the vocabulary are split."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; auto = nccl when CUDA is available, else gloo."""

    def __post_init__(self):
        check_fields(self, "parallel")
        if self.tensor_parallel < 1:
            raise ConfigError(f"parallel.tensor_parallel={self.tensor_parallel} must be >= 1")


@dataclass
class DataConfig:
    """Shards, sample construction and masking (fairseq masked_lm task)."""

    shards: str | None = None
    """Folder of shards built by `megamlm shards build` (train and valid splits)."""
    build_from: list[str] = field(default_factory=list)
    """Input files (jsonl or text, compressed with zstd, gzip, bzip2, xz or not, or Parquet; glob patterns such as
    `pile/train/*.jsonl.zst` expand to their files, sorted) built into `shards` on first use when it holds none."""
    tokenizer: str = "gpt2"
    """gpt2, a folder with encoder.json, vocab.bpe, dict.txt (`megamlm shards train-bpe`), or a
    WordPiece folder with vocab.txt (`megamlm shards train-wordpiece`, or an imported BERT's); the
    zero-clap dictionary (no <mask> row) is chosen automatically with model.zero_mask."""
    seq_length: int = 512
    """Tokens per sample including `<s>` (the reference's tokens_per_sample)."""
    block_mode: Literal["complete", "contiguous"] = "complete"
    """complete: whole documents packed per sample (the reference); contiguous: a token stream cut
    every seq_length - 1 tokens."""
    long_docs: Literal["drop", "truncate", "split"] = "drop"
    """Documents longer than a sample when building: drop (the reference), truncate, split."""
    text_mode: Literal["paragraphs", "lines"] = "paragraphs"
    """Plain-text inputs: one document per blank-line-separated block, or per line."""
    valid_fraction: float = 0.01
    """Share of documents put in the valid split when building."""
    shuffle_window: int = 10000
    """Samples are shuffled within consecutive windows of this many (after a per-epoch shard
    permutation); larger mixes more, 1 keeps the shard order."""
    loader_workers: int = 0
    """DataLoader worker processes per rank (0: read in the training process)."""
    masking: Literal["token", "whole_word", "span"] = "token"
    """What is masked (data/masking.py): token (fairseq, the reference), whole_word (a word's tokens
    all or none), span (SpanBERT: geometric spans of whole words)."""
    mask_prob: float = 0.15
    """Fraction of tokens selected for prediction (token, span; whole_word: of words)."""
    leave_unmasked_prob: float = 0.1
    """Of the selected tokens, the share left unchanged."""
    random_token_prob: float = 0.1
    """Of the selected tokens, the share replaced by a random ordinary token."""
    span_p: float = 0.2
    """span: parameter of the geometric span-length law (in words)."""
    span_max_words: int = 10
    """span: longest span in words (longer draws are redrawn; mean 3.8 words with span_p 0.2)."""
    packing: Literal["padded", "packed"] = "padded"
    """padded: a micro-batch is train.micro_batch_size samples, one per row, right-padded to the
    longest (fairseq); packed: whole samples end to end in one row of data.tokens_per_micro_batch
    tokens (best-fit within each shuffle window, data/packing.py), positions and attention per
    sample, so almost no compute goes to padding. An update is then a number of packed rows."""
    tokens_per_micro_batch: int | None = None
    """packed: the tokens of one micro-batch; null = train.micro_batch_size x data.seq_length."""

    def __post_init__(self):
        check_fields(self, "data")
        if self.seq_length < 3:
            raise ConfigError(f"data.seq_length={self.seq_length} must be >= 3")
        if not 0.0 < self.mask_prob < 1.0:
            raise ConfigError(f"data.mask_prob={self.mask_prob} must be in (0, 1)")
        if self.leave_unmasked_prob + self.random_token_prob > 1.0:
            raise ConfigError(
                f"data.leave_unmasked_prob + data.random_token_prob = "
                f"{self.leave_unmasked_prob + self.random_token_prob} must be <= 1")
        check_bounds(self, "data", {"valid_fraction": "[0, 1)", "shuffle_window": ">= 1", "loader_workers": ">= 0",
                                    "leave_unmasked_prob": "[0, 1]", "random_token_prob": "[0, 1]"})
        if not 0.0 < self.span_p < 1.0:
            raise ConfigError(f"data.span_p={self.span_p} must be in (0, 1)")
        if self.span_max_words < 1:
            raise ConfigError(f"data.span_max_words={self.span_max_words} must be >= 1")
        if self.tokens_per_micro_batch is not None and self.tokens_per_micro_batch < self.seq_length:
            raise ConfigError(f"data.tokens_per_micro_batch={self.tokens_per_micro_batch} is below "
                              f"data.seq_length={self.seq_length}: a sample must fit a packed micro-batch")
        if self.build_from and self.shards is None:
            raise ConfigError("data.build_from needs data.shards: the folder to build the shards into")


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule (reference: betas (0.9, 0.98), eps 1e-6, wd 0.01)."""

    lr: float = 6e-4
    """Peak learning rate."""
    min_lr: float = 6e-5
    """Cosine and wsd floor; warm-up starts here (fairseq warmup_init_lr = min_lr)."""
    schedule: Literal["cosine", "polynomial", "warmup_times_polynomial", "constant", "wsd"] = "cosine"
    """cosine (pretraining, fairseq cosine), polynomial (fine-tuning, fairseq polynomial_decay),
    warmup_times_polynomial (TF BERT/ELECTRA: the decay from update 0 times the warm-up ramp),
    constant (after warm-up), wsd (warm-up, stable at optim.lr, then optim.decay_steps of decay to
    optim.min_lr: ModernBERT's trapezoid; a run continued with more train.steps stays at the peak
    until its new decay); formulas in train/schedule.py."""
    warmup_steps: int = 10000
    """Linear warm-up updates."""
    period_steps: int | None = None
    """Cosine period after warm-up; null = 1.1 × train.steps (the reference ran 133082 of 146390)."""
    decay_steps: int | None = None
    """wsd: the decay's updates, the run's last ones; null = a fifth of train.steps (Hägele et al. 2024:
    a 20% decay matches cosine)."""
    decay_shape: Literal["1-sqrt", "linear", "cosine"] = "1-sqrt"
    """wsd: the decay's shape over its progress p in [0, 1]: 1 - sqrt(p) (ModernBERT's, the best in Hägele
    et al. 2024), 1 - p, or ½(1 + cos πp) (transformers' get_wsd_schedule names them alike)."""
    end_lr: float = 0.0
    """Polynomial decay's final learning rate."""
    power: float = 1.0
    """Polynomial decay's power."""
    betas: tuple[float, float] = (0.9, 0.98)
    """Adam betas."""
    eps: float = 1e-6
    """Adam epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay (applied to every parameter, as fairseq does)."""
    clip_grad: float = 0.0
    """Gradient-norm clipping threshold; 0 = off (the reference)."""

    def __post_init__(self):
        check_fields(self, "optim")
        if self.lr <= 0:
            raise ConfigError(f"optim.lr={self.lr} must be positive")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"optim.min_lr={self.min_lr} must be in [0, optim.lr={self.lr}]")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        if self.period_steps is not None and self.period_steps < 1:
            raise ConfigError(f"optim.period_steps={self.period_steps} must be >= 1")
        if self.decay_steps is not None and self.decay_steps < 1:
            raise ConfigError(f"optim.decay_steps={self.decay_steps} must be >= 1")
        check_bounds(self, "optim", {"end_lr": ">= 0", "power": "> 0", "betas": "[0, 1)", "eps": "> 0",
                                     "weight_decay": ">= 0", "clip_grad": ">= 0"})

    def wsd_decay_steps(self, total_steps: int) -> int:
        """schedule=wsd: the updates of its decay in a run of `total_steps` (optim.decay_steps, or its default)."""
        return self.decay_steps or max(1, round(total_steps / 5))

    def adamw(self) -> dict:
        """AdamW's settings (keyword arguments and parameter-group keys) besides the learning rate, which the
        schedule sets at every update."""
        return {"betas": tuple(self.betas), "eps": self.eps, "weight_decay": self.weight_decay}


@dataclass
class ObjectiveConfig:
    """The pretraining objective (megamlm/objectives/; the masking rates are in the data section)."""

    name: str = "mlm"
    """A registered objective: mlm (masked language modeling, the reference's) | electra (replaced-token
    detection, Clark et al. 2020) | nsp (MLM + BERT's next-sentence prediction) | sop (MLM + ALBERT's
    sentence-order prediction)."""
    generator_size: float = 0.25
    """electra: the generator's width as a fraction of the discriminator's (heads, hidden and FFN size
    scale together, same depth, same head size); Clark et al. found 1/4 to 1/2 best."""
    rtd_weight: float = 50.0
    """electra: λ in loss = generator MLM + λ · replaced-token detection (the paper's 50)."""
    export_generator: bool = False
    """electra: also write the generator into exported model folders (<run_dir>/final); training
    checkpoints always hold it. Without it the folder is the discriminator alone."""

    def __post_init__(self):
        check_fields(self, "objective")
        if not 0.0 < self.generator_size <= 1.0:
            raise ConfigError(f"objective.generator_size={self.generator_size} must be in (0, 1]: the "
                              f"generator is a fraction of the discriminator, never larger")
        if self.rtd_weight <= 0:
            raise ConfigError(f"objective.rtd_weight={self.rtd_weight} must be > 0 (the paper's λ is 50)")


@dataclass
class Config:
    """A whole experiment."""

    model: ModelConfig = field(default_factory=ModelConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self):
        model, tp = self.model, self.parallel.tensor_parallel
        if model.num_attention_heads % tp:
            raise ConfigError(
                f"parallel.tensor_parallel={tp} does not divide model.num_attention_heads="
                f"{model.num_attention_heads}; allowed: {_divisors(model.num_attention_heads)}"
            )
        if model.ffn_hidden_size % tp:
            raise ConfigError(
                f"parallel.tensor_parallel={tp} does not divide model.ffn_hidden_size="
                f"{model.ffn_hidden_size}; allowed: {_divisors(model.ffn_hidden_size, upto=64)}"
            )
        if model.position == "learned" and self.data.seq_length > model.max_positions:
            raise ConfigError(
                f"data.seq_length={self.data.seq_length} exceeds model.max_positions="
                f"{model.max_positions} of the learned position table; raise max_positions "
                f"or use position=alibi|sinusoidal|rope|none"
            )
        if self.train.compile_head:
            train = self.train
            asks = unmet((("parallel.tensor_parallel", tp, tp == 1),
                          ("model.head_loss", model.head_loss, model.head_loss == "unfused"),
                          ("train.zero_stage", train.zero_stage, train.engine == "flat" or train.zero_stage < 3),
                          ("objective.name", self.objective.name, self.objective.name != "electra")))
            if asks:
                raise ConfigError(f"train.compile_head=true compiles MaskedLM's unfused head and loss at TP=1 "
                                  f"below ZeRO-3; {asks} needs train.compile_head=false")
        optim, steps = self.optim, self.train.steps
        if optim.schedule == "wsd" and optim.warmup_steps + optim.wsd_decay_steps(steps) > steps:
            decay = optim.decay_steps or f"null ({optim.wsd_decay_steps(steps)}: a fifth of the run)"
            raise ConfigError(f"optim.schedule=wsd: optim.warmup_steps={optim.warmup_steps} + optim.decay_steps="
                              f"{decay} exceed train.steps={steps}; lower them or raise train.steps")
        if model.local_window is not None and model.local_window > self.data.seq_length:
            raise ConfigError(
                f"model.local_window={model.local_window} is larger than data.seq_length={self.data.seq_length}: "
                f"the local layers would attend globally; use a window below the sequence length or null"
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        """The resolved config as YAML that load_config reads back to an equal Config."""
        return yaml.safe_dump(plain(self.to_dict()), sort_keys=False)

    def changes_since(self, before: dict) -> dict[str, tuple]:
        """"section.key" -> (value in `before`, value now) for every value that differs; `before`: another
        config's to_dict (e.g. a checkpoint's, through JSON). Keys `before` lacks (written before they existed)
        are left out."""
        now = plain(self.to_dict())
        return {f"{section}.{key}": (old, now[section][key]) for section, values in before.items() if section in now
                for key, old in values.items() if key in now[section] and plain(old) != now[section][key]}


def plain(obj):
    """Dicts, lists and scalars only (tuples as lists): how YAML and JSON hold a config."""
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    return [plain(v) for v in obj] if isinstance(obj, (tuple, list)) else obj


def as_yaml(value) -> str:
    """A value as a config file or an override writes it (YAML's flow style: null, true, [0.9, 0.98])."""
    return yaml.safe_dump(plain(value), default_flow_style=True, width=1 << 16).removesuffix("\n...\n").strip()


SECTIONS: dict[str, type] = typing.get_type_hints(Config)
"""The config's sections: each YAML section's name -> its dataclass, in Config's order."""
SECTION_KEYS: dict[str, list[str]] = {name: [f.name for f in dataclasses.fields(cls)] for name, cls in SECTIONS.items()}
"""Each section's keys, in their dataclass's order."""
