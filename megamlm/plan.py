"""`megamlm plan`: the layout, batch arithmetic, memory per GPU, the gradients' reduction, the checkpoints'
size on disk and wall time of a run, before submitting it.

Memory per GPU (bytes; P = parameters, TP/DP the parallel degrees, w = 2 for bf16/fp16, 4 for fp32):
  weights      P/TP · w                 (ZeRO-3: / DP)
  gradients    P/TP · w                 (ZeRO-2/3: / DP)
  optimizer    P/TP · (8 + 4 master if w == 2)   Adam moments (+ fp32 master copy)  (ZeRO-1+: / DP)
  activations  L · s · b · h · (34 + 5 · a · s / h) · w/2 / TP   (Korthikanti et al. 2022); the
               5·a·s/h term is the scores, softmax and dropout mask [b, a, s, s], which only the eager
               backend keeps: sdpa (flash / cuDNN / memory-efficient on a GPU), flex and varlen are
               fused kernels that keep O(s) per head. train.activation_checkpointing: each layer keeps
               its input (L · s · b · h · w) and one layer's activations exist at a time.
  attention bias  sdpa's (and eager's) additive bias, built once per forward and attention pattern and shared by
               its layers: b · s² · w per pattern with a window or model.document_mask, b · a/TP · s² · w
               with a score term (ALiBi); at most that for packed rows (one [L, L] block per sample)
Wall time = flops/token (the objective's) · token slots · updates / (GPUs · peak · MFU), with the MFU
megamlm's loop measured for the run's train.engine and train.compile (train.flops.LOOP_MFU), or for the
fastest settings where the run has every one of configs/gpu/fastest.yaml's (train.flops.FASTEST_LOOP_MFU),
unless --mfu gives one; the line says which it assumed, on which GPU. Of the slots,
the fill (real tokens / slots) trains: measured 0.99 for data.packing=packed (best fit) and 0.745 padded
(the reference's `complete` samples of Pile-like documents at 2048; BENCHMARKS.md); the training log's
`fill` column gives a run's own.
Reduction: the dtype the gradients are summed in over DP (the flat engine: fp32 unless
train.grad_reduce_in_fp32=false; DeepSpeed: its communication_data_type, the weights' dtype unless a
train.deepspeed_config JSON names another), with a note from REDUCE16_OVER_BACKWARD_DP ranks on in 16 bits.
Checkpoints: one folder's bytes (`train.checkpoint.checkpoint_bytes`: 12-16 bytes a parameter by engine,
precision and ZeRO stage), train.keep_last + 1 of them at once while a save is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megamlm.config import Config, ConfigError, load_config_and_origins
from megamlm.errors import check_ranges, did_you_mean
from megamlm.model.backends import ATTENTION_BACKENDS
from megamlm.model.positions import POSITIONS
from megamlm.objectives import get_objective
from megamlm.parallel import check_world_size
from megamlm.train.checkpoint import checkpoint_bytes
from megamlm.train.engine import deepspeed_config
from megamlm.train.flops import FASTEST_LOOP_MFU, GPU_PEAKS, LOOP_MFU, LOOP_MFU_MEASURED_ON

FASTEST_SETTINGS = Path("configs/gpu/fastest.yaml")
"""The overlay of the fastest settings measured (FASTEST_LOOP_MFU), in the repository beside the package; an
install without configs/ has none, and the plan assumes LOOP_MFU's."""

FILL = {"packed": 0.99, "padded": 0.745}
"""Default fill by data.packing (see the module docstring)."""

FP32_NAMES = ("fp32", "float32", "float", "torch.float32")
"""DeepSpeed's names for fp32 as a communication_data_type (its DtypeEnum)."""

REDUCE16_OVER_BACKWARD_DP = 32
"""From this DP on, a 16-bit reduction of the gradients errs more than the 16-bit backward that made them
(BENCHMARKS.md "How the 16-bit reduction's error grows with DP": about √DP, 3.7-6.8x at 128 ranks)."""


def parameter_count(cfg: Config) -> int:
    """Parameters of the objective's model, from the architecture alone (vocabulary padding excluded)."""
    return get_objective(cfg).parameter_count()


@dataclass
class Plan:
    gpus: int
    tp: int
    dp: int
    micro: int
    accumulation: int
    global_batch: int
    tokens_per_update: int
    """Token slots (real tokens + padding)."""
    fill: float
    """Real tokens / slots assumed."""
    updates: int
    memory: dict  # name -> bytes per GPU
    hours: float
    gpu: str
    """The --gpu whose peak the wall time divides by."""
    mfu: float
    assumed: str
    """Where `mfu` comes from, as the wall-time line says it."""
    reduction: str
    """The dtype the gradients are summed in over DP, and whose rule that is (`reduction`)."""
    checkpoint: int
    """Bytes of one checkpoint folder (every rank's files)."""
    keep_last: int
    """train.keep_last: complete checkpoints kept (one more exists while a save is written)."""

    def table(self, budget_gib: float) -> str:
        gib = {k: v / 2**30 for k, v in self.memory.items()}
        rows = [
            f"layout        {self.gpus} GPUs = TP {self.tp} x DP {self.dp}",
            f"batch         micro {self.micro} x accumulation {self.accumulation} x DP {self.dp} "
            f"= {self.global_batch} sequences per update",
            f"tokens        {self.tokens_per_update:,} slots per update, ~{self.fill * self.tokens_per_update:,.0f}"
            f" real at fill {self.fill:.3g}: {self.fill * self.tokens_per_update * self.updates / 1e9:.2f}B real"
            f" in {self.updates:,} updates",
            "memory / GPU  " + ", ".join(f"{k} {v:.2f}" for k, v in gib.items() if k != "total")
            + f" -> total {gib['total']:.2f} GiB of {budget_gib:g}",
            f"reduction     {self.reduction}",
            f"checkpoints   {self.checkpoint / 2**30:.2f} GiB each, up to {self.keep_last + 1} at once "
            f"(train.keep_last {self.keep_last} + 1 being written): "
            f"{(self.keep_last + 1) * self.checkpoint / 2**30:.2f} GiB in the run's checkpoints/",
            f"wall time     {_duration(self.hours)}: {self.gpus} {self.gpu} at MFU {self.mfu * 100:.3g}% "
            f"({self.assumed})",
        ]
        return "\n".join(rows)


def _duration(hours: float) -> str:
    if hours < 1:
        return f"{hours * 3600:.0f} s" if hours < 1 / 60 else f"{hours * 60:.0f} min"
    return f"{hours:.1f} h ({hours / 24:.1f} days)"


def make_plan(cfg: Config, nodes: int, gpus_per_node: int, gpu: str, mfu: float | None = None,
              fill: float | None = None) -> Plan:
    """`mfu` None: the loop's measured MFU for the run's engine (LOOP_MFU)."""
    check_ranges([(f"--nodes {nodes}", nodes, ">= 1"), (f"--gpus-per-node {gpus_per_node}", gpus_per_node, ">= 1"),
                  (f"--mfu {mfu}", mfu, "(0, 1]"), (f"--fill {fill}", fill, "(0, 1]")], ConfigError)
    gpus = nodes * gpus_per_node
    tp = cfg.parallel.tensor_parallel
    check_world_size(cfg.parallel, gpus, f"{nodes} node{'s' * (nodes > 1)} x {gpus_per_node} GPUs")
    dp = gpus // tp
    train, s = cfg.train, cfg.data.seq_length
    accumulation = train.accumulation_steps(dp)
    # token slots of one micro-batch: micro rows of s, or one packed row of its budget
    micro_tokens = train.micro_batch_size * s
    if cfg.data.packing == "packed":
        micro_tokens = cfg.data.tokens_per_micro_batch or micro_tokens
    params = parameter_count(cfg)
    w = 4 if train.precision == "fp32" else 2
    stage = 1 if train.engine == "flat" else train.zero_stage  # flat: the optimizer state is cut over DP
    # the flat engine reduces gradients in an fp32 copy of the whole flat buffer, or (16-bit reduction)
    # copies this rank's part of it (train/flat.py)
    fp32_copy = 0 if train.engine != "flat" or w == 4 else 4 if train.grad_reduce_in_fp32 else 4 / dp
    memory = {
        "weights": params / tp * w / (dp if stage >= 3 else 1),
        "gradients": params / tp * (w + fp32_copy) / (dp if stage >= 2 else 1),
        "optimizer": params / tp * (8 + (4 if w == 2 else 0)) / (dp if stage >= 1 else 1),
        **activations(cfg, micro_tokens, w, tp),
    }
    memory["total"] = sum(memory.values())
    if gpu not in GPU_PEAKS:
        raise ConfigError(f"--gpu {gpu}; known: {', '.join(GPU_PEAKS)}{did_you_mean(gpu, GPU_PEAKS)}")
    peak = GPU_PEAKS[gpu][train.precision]
    tokens = micro_tokens * accumulation * dp
    fill = FILL[cfg.data.packing] if fill is None else fill
    mfu, assumed = (mfu, "--mfu") if mfu is not None else _measured_mfu(cfg)
    seconds = get_objective(cfg).flops_per_token(s) * tokens * train.steps / (gpus * peak * mfu)
    return Plan(gpus, tp, dp, train.micro_batch_size, accumulation, train.global_batch(dp), tokens, fill,
                train.steps, memory, seconds / 3600, gpu, mfu, assumed, reduction(cfg, dp),
                checkpoint_bytes(cfg, params, dp), train.keep_last)


def _measured_mfu(cfg: Config) -> tuple[float, str]:
    """The loop's measured MFU for this run's settings (the fastest's, or its engine's and compilation's), and the
    words that say so."""
    if _has_settings(cfg, FASTEST_SETTINGS):
        return FASTEST_LOOP_MFU, (f"megamlm's loop as measured with {FASTEST_SETTINGS}'s settings, "
                                  f"{LOOP_MFU_MEASURED_ON}; --mfu")
    train = cfg.train
    how = f"train.engine={train.engine}, {'compiled' if train.compile else 'eager'}"
    return LOOP_MFU[train.engine, train.compile], f"megamlm's loop as measured for {how}, {LOOP_MFU_MEASURED_ON}; --mfu"


def _has_settings(cfg: Config, overlay: Path) -> bool:
    """Whether `cfg` has every value the overlay file (under the repository) sets; False where it is absent."""
    path = Path(__file__).resolve().parents[1] / overlay
    if not path.is_file():
        return False
    wanted, origins = load_config_and_origins([path])
    have, values = cfg.to_dict(), wanted.to_dict()
    return all(have[section][key] == values[section][key]
               for section, _, key in (dotted.partition(".") for dotted in origins))


def reduction(cfg: Config, dp: int) -> str:
    """The dtype the gradients are summed in over `dp` ranks, whose rule chose it, and from
    REDUCE16_OVER_BACKWARD_DP ranks on in 16 bits what that costs."""
    train = cfg.train
    if dp == 1:
        return "none (DP 1)"
    if train.engine == "flat":
        dtype = "fp32" if train.grad_reduce_in_fp32 else train.precision  # (false needs bf16 / fp16)
        rule = "train.grad_reduce_in_fp32"
    else:  # the weights' dtype, unless a user's DeepSpeed JSON names another
        dtype = deepspeed_config(cfg, dp).get("communication_data_type", train.precision)
        rule = "DeepSpeed's communication_data_type"
    text = f"gradients summed over DP {dp} in {dtype} ({rule})"
    if dtype not in FP32_NAMES and dp >= REDUCE16_OVER_BACKWARD_DP:
        text += (f": from DP {REDUCE16_OVER_BACKWARD_DP} on, 16-bit sums err more than the 16-bit backward "
                 f"(BENCHMARKS.md)")
    return text


def activations(cfg: Config, micro_tokens: int, w: int, tp: int) -> dict[str, float]:
    """Bytes per GPU of one micro-batch's activations and sdpa's attention bias (module docstring)."""
    m, s = cfg.model, cfg.data.seq_length
    backend = ATTENTION_BACKENDS[m.attention_backend]
    per_token = 34 * m.hidden_size
    if backend.keeps_scores:
        per_token += 5 * m.num_attention_heads * s
    layer = micro_tokens * per_token * w / 2 / tp
    if cfg.train.activation_checkpointing:
        stored = m.num_layers * micro_tokens * m.hidden_size * w + layer
    else:
        stored = m.num_layers * layer
    biased = []  # the distinct patterns that get a bias [b, np|1, s, s] = micro_tokens · (np|1) · s
    score = POSITIONS[m.position].score_term
    if backend.additive_bias:
        biased = [p for p in set(m.layer_attention()) if score or p.window is not None or m.document_mask]
    heads = m.num_attention_heads / tp if score else 1
    return {"activations": stored, "attention bias": len(biased) * micro_tokens * heads * s * w}


def check_budget(plan: Plan, budget_gib: float) -> None:
    check_ranges([(f"--gpu-memory {budget_gib:g}", budget_gib, "> 0 (GiB per GPU)")], ConfigError)
    total = plan.memory["total"] / 2**30
    if total > budget_gib:
        raise ConfigError(
            f"the plan needs {total:.1f} GiB per GPU, over the {budget_gib:g} GiB budget; lower "
            f"train.micro_batch_size (raising accumulation), raise train.zero_stage or "
            f"parallel.tensor_parallel")
