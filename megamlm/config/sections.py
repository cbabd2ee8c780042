"""The config sections: one dataclass per YAML section, a docstring per field, checks on build
(the model section is in model.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import yaml

from megamlm.config.checks import ConfigError, _divisors, check_bounds, check_fields
from megamlm.config.model import ModelConfig



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
    """Input files (.jsonl, .jsonl.zst, .txt) built into `shards` on first use when it holds none."""
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
    """Cosine floor; warm-up starts here (fairseq warmup_init_lr = min_lr)."""
    schedule: Literal["cosine", "polynomial", "warmup_times_polynomial", "constant"] = "cosine"
    """cosine (pretraining, fairseq cosine), polynomial (fine-tuning, fairseq polynomial_decay),
    warmup_times_polynomial (TF BERT/ELECTRA: the decay from update 0 times the warm-up ramp),
    constant (after warm-up); formulas in train/schedule.py."""
    warmup_steps: int = 10000
    """Linear warm-up updates."""
    period_steps: int | None = None
    """Cosine period after warm-up; null = 1.1 × train.steps (the reference ran 133082 of 146390)."""
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
        check_bounds(self, "optim", {"end_lr": ">= 0", "power": "> 0", "betas": "[0, 1)", "eps": "> 0",
                                     "weight_decay": ">= 0", "clip_grad": ">= 0"})

    def adamw(self) -> dict:
        """AdamW's settings (keyword arguments and parameter-group keys) besides the learning rate, which the
        schedule sets at every update."""
        return {"betas": tuple(self.betas), "eps": self.eps, "weight_decay": self.weight_decay}


@dataclass
class TrainConfig:
    """The run: batch arithmetic, engine, evaluation, checkpoints, guards."""

    seed: int = 1
    """Seed for initialization, dropout, data order and masking; results do not depend on TP."""
    micro_batch_size: int = 8
    """Sequences per forward pass on one data-parallel rank."""
    global_batch_size: int | None = None
    """Sequences per update over all ranks = micro × accumulation × DP; null = micro × DP."""
    steps: int = 20
    """Optimizer updates."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """fp32, bf16, or fp16 with dynamic loss scaling (the reference)."""
    engine: Literal["deepspeed", "flat"] = "deepspeed"
    """What steps the optimizer. deepspeed: DeepSpeed's engine at train.zero_stage. flat: megamlm's own
    ZeRO-1 (train/flat.py): weights and gradients as views of flat buffers, one fused AdamW over this
    data-parallel rank's range, 14-49 host operations per optimizer step instead of DeepSpeed's
    1,300-3,300 at 12 layers (benchmarks/loop_ops.py); fp32, bf16 or fp16 (its dynamic loss scale on
    the device, DeepSpeed's rule; also on a CPU), train.zero_stage 0 or 1 (its optimizer state is cut
    over DP either way). Its checkpoints are in DeepSpeed's stage-0 layout:
    they resume on either engine at any layout and convert as any other."""
    fp32_grad_accumulation: bool = False
    """train.engine=flat, bf16 / fp16: add each micro-batch's gradients to the fp32 buffer that the
    update reduces over DP anyway, instead of summing an update's micro-batches in the weights' dtype
    (false: DeepSpeed's ZeRO-1 default, which the flat engine matches bit for bit). megatron accumulates
    bf16 gradients in fp32 always: a 16-bit running sum keeps 8 (bf16) or 11 (fp16) significant bits of
    each addend, and the Pile recipes accumulate 16-32 micro-batches (BENCHMARKS.md, "Gradient
    accumulation"). Costs an add and a zero over the gradient buffer per micro-batch, no memory."""
    overlap_grad_reduce: bool = False
    """train.engine=flat, DP > 1: reduce-scatter the gradients over DP in buckets (train.grad_bucket_size),
    each as soon as the update's last backward has finished it (megatron-core's overlap_grad_reduce),
    instead of in one collective after the backward. The same sums; the norm adds its rows in another order."""
    grad_bucket_size: int = 40_000_000
    """Gradient elements per reduce-scatter under train.overlap_grad_reduce (megatron-core's default)."""
    zero_stage: int = 1
    """DeepSpeed ZeRO stage 0-3 (optimizer states / + gradients / + parameters sharded over DP). An
    fp32 run on one data-parallel rank runs at stage 0 whatever this says (`engine_zero_stage`)."""
    skip_nonfinite_updates: bool = True
    """bf16: DeepSpeed scans every gradient for inf / NaN before each update and skips an update that
    has one (its `check_grad_overflow`). The scan costs about 1,900 host operations and two waits for
    the device per update at 12 layers (benchmarks/loop_ops.py). false: no scan, no wait; a non-finite
    gradient then reaches the weights, the next loss is non-finite and the spike guard rolls back to
    the last checkpoint (before the first one, the run stops: "no checkpoint to roll back to"). fp16
    always scans (its loss scale needs it); fp32 never does."""
    deepspeed_config: str | None = None
    """A DeepSpeed JSON file used instead of the one generated from this config (batch sizes must agree)."""
    run_dir: str = "runs/default"
    """Checkpoints, TensorBoard events and logs go here."""
    init_from: str | None = None
    """A model folder (a trained <run_dir>/final or `megamlm convert` output) whose weights start the
    run; its model section must describe the same architecture. Ignored when resuming a checkpoint."""
    log_interval: int = 10
    """Updates between log lines."""
    eval_interval: int = 100
    """Updates between validation runs (also before the first and after the last update)."""
    eval_batches: int = 50
    """Validation micro-batches per rank (fewer if the valid split is smaller)."""
    save_interval: int = 500
    """Updates between checkpoints (also at the end and on SIGTERM/SIGUSR1)."""
    activation_checkpointing: bool = False
    """Recompute each encoder layer's activations in the backward pass (long sequences: less
    memory, about one more forward of compute)."""
    compile: bool = False
    """torch.compile each encoder layer (fuses its elementwise chain: bias, dropout, residual,
    LayerNorm, GELU); batches are then padded to data.seq_length so that every batch has one
    shape. roberta.base at 2048 in the training loop on an H200: 163-185k tokens/s against 151-166k
    eager (BENCHMARKS.md); measure before turning it on. The first update compiles; its time is logged
    once (event "compile", first_update_s) so that the cost of compiling is visible next to the later
    updates."""
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    """torch.compile's mode under train.compile. reduce-overhead: Inductor also records each layer as a
    CUDA graph (no per-kernel launch cost; train.compile's one batch shape makes that possible);
    max-autotune: also searches matmul / Triton configurations, FlexAttention's kernels among them
    (minutes of compilation), with CUDA graphs; max-autotune-no-cudagraphs: the search alone. GPU
    options, to be measured (benchmarks/train_throughput.py --compile --compile-mode); on CPU they
    compile as default."""
    compile_head: bool = False
    """torch.compile the MLM head and its loss (MaskedLM.loss_sum), dynamic in the number of masked positions
    (one compilation for every batch): Inductor fuses the eager passes over the [n, V] logits (the fp32 copy,
    max, exp, sums, the softmax gradient; ~8 kernels of 0.3-0.6 ms per micro-batch on an H200 at base/2048,
    BENCHMARKS.md). TP=1, model.head_loss=unfused, ZeRO stage < 3, MLM-family objectives. Off by default
    until a GPU measures it (gpu.sh: loop-2048-flat-compiled-micro16-head)."""
    profile_updates: int = 0
    """Updates to record with torch.profiler after two warm-up updates (rank 0; 0: none): prints the
    operator table (by device time on a GPU), writes it to run_dir/profile.txt and logs a `profile`
    event with the time per update and the share of it the GPU was busy (train/profiling.py)."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are deleted."""
    spike_factor: float = 3.0
    """A loss above spike_factor × the running median is a spike."""
    spike_patience: int = 5
    """Consecutive spiking updates that trigger a rollback (a non-finite loss triggers at once)."""
    spike_window: int = 100
    """Updates in the running median."""
    max_rollbacks: int = 3
    """Rollbacks to the last good checkpoint (with a new data seed) before giving up."""

    def __post_init__(self):
        check_fields(self, "train")
        for key in ("micro_batch_size", "steps", "log_interval", "eval_interval", "save_interval",
                    "keep_last", "spike_patience", "spike_window"):
            if getattr(self, key) < 1:
                raise ConfigError(f"train.{key}={getattr(self, key)} must be >= 1")
        if self.profile_updates < 0:
            raise ConfigError(f"train.profile_updates={self.profile_updates} must be >= 0 (0: no profile)")
        check_bounds(self, "train", {"seed": ">= 0", "global_batch_size": ">= 1", "eval_batches": ">= 1",
                                     "spike_factor": "> 1", "max_rollbacks": ">= 0",
                                     "grad_bucket_size": ">= 1"})
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"train.zero_stage={self.zero_stage} is invalid; allowed: 0 | 1 | 2 | 3")
        if not self.skip_nonfinite_updates and self.precision == "fp16":
            raise ConfigError("train.skip_nonfinite_updates=false needs train.precision=bf16: fp16's loss "
                              "scale is set from the scan it turns off")
        if self.engine == "flat":
            asks = [f"train.{key}={value}" for key, value, ok in (
                ("zero_stage", self.zero_stage, self.zero_stage in (0, 1)),
                ("deepspeed_config", self.deepspeed_config, self.deepspeed_config is None)) if not ok]
            if asks:
                raise ConfigError(f"train.engine=flat runs ZeRO-1 without a DeepSpeed JSON; "
                                  f"{', '.join(asks)} needs train.engine=deepspeed")
        for key, deepspeed in (("overlap_grad_reduce", "DeepSpeed's engine overlaps with zero_optimization."
                                "overlap_comm in a JSON given as train.deepspeed_config"),
                               ("fp32_grad_accumulation", "DeepSpeed's ZeRO-1 sums micro-batches in the weights' "
                                "dtype (its fp32 option is another optimizer, with another checkpoint layout)")):
            if getattr(self, key) and self.engine != "flat":
                raise ConfigError(f"train.{key}=true needs train.engine=flat: {deepspeed}")
        if self.global_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                f"train.micro_batch_size={self.micro_batch_size}")

    def engine_zero_stage(self, dp_size: int) -> int:
        """The ZeRO stage the engine runs: zero_stage, but 0 for fp32 on one data-parallel rank, where
        partitioning over a group of one saves nothing and its flattening and bucketing cost ~18% of a
        CPU step (DeepSpeed then steps torch's fused AdamW on the parameters; the losses are bit-identical).
        bf16/fp16 keep the stage: DeepSpeed's stage-0 mixed-precision optimizer accumulates differently.
        train.engine=flat: 0, the layout of its checkpoint files (train/flat.py)."""
        if self.engine == "flat":
            return 0
        return 0 if dp_size == 1 and self.precision == "fp32" else self.zero_stage

    def accumulation_steps(self, dp_size: int) -> int:
        """global = micro × accumulation × DP, checked against the world actually launched."""
        if self.global_batch_size is None:
            return 1
        per_step = self.micro_batch_size * dp_size
        if self.global_batch_size % per_step:
            raise ConfigError(
                f"train.global_batch_size={self.global_batch_size} is not divisible by "
                f"train.micro_batch_size × data-parallel size = {self.micro_batch_size} × {dp_size}; "
                f"choose a multiple of {per_step}")
        return self.global_batch_size // per_step


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
            asks = [f"{key}={value}" for key, value, ok in (
                ("parallel.tensor_parallel", tp, tp == 1),
                ("model.head_loss", model.head_loss, model.head_loss == "unfused"),
                ("train.zero_stage", train.zero_stage, train.engine == "flat" or train.zero_stage < 3),
                ("objective.name", self.objective.name, self.objective.name != "electra")) if not ok]
            if asks:
                raise ConfigError(f"train.compile_head=true compiles MaskedLM's unfused head and loss at TP=1 "
                                  f"below ZeRO-3; {', '.join(asks)} needs train.compile_head=false")
        if model.local_window is not None and model.local_window > self.data.seq_length:
            raise ConfigError(
                f"model.local_window={model.local_window} is larger than data.seq_length={self.data.seq_length}: "
                f"the local layers would attend globally; use a window below the sequence length or null"
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        """The resolved config as YAML that load_config reads back to an equal Config."""
        return yaml.safe_dump(_plain(self.to_dict()), sort_keys=False)

    def changes_since(self, before: dict) -> dict[str, tuple]:
        """"section.key" -> (value in `before`, value now) for every value that differs; `before`: another
        config's to_dict (e.g. a checkpoint's, through JSON). Keys `before` lacks (written before they existed)
        are left out."""
        now = _plain(self.to_dict())
        return {f"{section}.{key}": (old, now[section][key]) for section, values in before.items() if section in now
                for key, old in values.items() if key in now[section] and _plain(old) != now[section][key]}


def _plain(obj):
    """Dicts, lists and scalars only (tuples as lists): how YAML and JSON hold a config."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return [_plain(v) for v in obj] if isinstance(obj, (tuple, list)) else obj


