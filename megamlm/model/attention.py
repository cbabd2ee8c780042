"""Bidirectional attention's backends, plugged into megatron-core's SelfAttention.

megatron-core's DotProductAttention needs CUDA (global memory buffer) and has no path for an
additive bias, so `BidirectionalAttention` (layer.py) replaces it in the layer spec. It receives this
rank's heads only, query/key/value [s, b, np, hn] (or the QKV projection unsplit, `split_qkv`), and
returns [s, b, np * hn]; the work is done by an `AttentionBackend` chosen by name (backends.py's
`ATTENTION_BACKENDS`, model.attention_backend):

    backend = ATTENTION_BACKENDS[name](position)    # one per encoder, shared by its layers
    layers = backend.prepare_layers(patterns, padding, documents, segments, dtype, host)   # once per forward
    out = backend.attend(q, k, v, layers[pattern].attention, dropout_p, scale)   # in every layer

Attention never crosses a sample (`segments`, packed rows) nor, when `documents` is given
(model.document_mask), a document; padded keys are never attended to; a local layer's pattern
(`LayerAttention`: a window, or BigBird's block-sparse pattern) narrows it further (patterns.py).

megatron's slots have one meaning each: `attention_mask` carries the prepared `LayerInputs` per
pattern (whatever the backend built: a bias tensor for sdpa, a BlockMask and score parameters for
flex; the RoPE rotation) and `attention_bias` is unused. A backend asks the position encoding for its
score term; padding, document boundaries and patterns are the backend's to express.

  sdpa   PyTorch scaled_dot_product_attention with one additive bias [b, np|1, s, s] (-inf on padded
         keys, other documents and outside the pattern, plus the position's score term), CPU and GPU;
         no bias at all when there is nothing to add (no score term, pattern or documents, no padded
         key in the batch: SDPA's flash / cuDNN path, CPU's fused kernel); with a score term alone,
         its one [1, np, s, s] viewed as [b, np, s, s] (b times less memory; CPU time the same). Packed rows are
         first gathered per sample into [n, np, L, hn] (L the longest sample), so nothing of size
         [T, T] is built for a row of T tokens and the bias is [n, np|1, L, L].
  eager  the same math unfused: softmax, then our dropout. sdpa runs it on CPU whenever attention
         dropout is on (torch's CPU SDPA then does this math with a slower dropout mask).
  flex   FlexAttention: the position's score term is a `score_mod`, key padding / documents / the
         pattern (BigBird's too) a BlockMask; nothing [s, s] is materialized and key blocks a query
         block cannot see are skipped; attention dropout in two passes (flex.py). CUDA only
         for training: torch 2.13 has no FlexAttention backward on CPU.
  varlen torch's variable-length FlashAttention (torch.nn.attention.varlen) over the real tokens only:
         every sample (or document) is one sequence of `cu_seqlens`, no padding is computed, padded
         or packed rows alike; a window is the kernel's window_size. CUDA only; no score term (not
         for ALiBi: use flex) and no attention dropout. On CPU a per-sequence SDPA stands in for the
         kernel (tests check the layout with it).
  alibi-flash  sdpa's layout with ALiBi (fixed slopes) as extra head dimensions of two causal flash
         passes instead of a bias (alibi_flash.py): O(s) memory, the key-padding mask as the only input.
  triton our Triton kernels (triton_attention.py): ALiBi (any mode), key padding, documents, packed
         samples, sliding windows and attention dropout in one FlashAttention-style pass; key blocks
         no query of a block can see (other samples, documents, outside the window) are skipped;
         padding queries see no key; no BigBird patterns; CUDA.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import AuxRequest

from megamlm.config import GLOBAL_ATTENTION, ConfigError, LayerAttention, ModelConfig, field_default
from megamlm.model.alibi_flash import AlibiTerms, alibi_flash_attention, alibi_terms, flash_kernel
from megamlm.model.dropout import dropout
from megamlm.model.flex import attend_with_dropout, compiled_flex_attention, draw_seed, kernel_options
from megamlm.model.patterns import flex_block_mask, pattern_sees, random_block_table
from megamlm.model.positions import POSITIONS, PositionEncoding, sample_positions, sample_starts
from megamlm.model.sequences import LayoutReads, PackedRows, attention_groups, varlen_attention
from megamlm.parallel import tensor_parallel_rng


def split_qkv(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., 3 · hn], each head's query, key and value side by side (the QKV projection's layout) -> q, k, v
    [..., hn], views of it."""
    return qkv.chunk(3, -1)


@dataclass
class LayerInputs:
    """What the layers of one attention pattern need, prepared once per forward."""

    attention: object
    """The backend's `prepare` for that pattern."""
    rotation: tuple[torch.Tensor, torch.Tensor] | None
    """RoPE's (cos, sin) [b|1, 1, s, hn] for those layers (local ones: rope_theta_local), or None."""


BACKEND_SETTINGS = {"flex_kernel_options": "flex", "triton_dq": "triton"}
"""The model.* keys that one attention backend reads -> its name (`AttentionBackend.from_config`)."""


class AttentionBackend:
    """sdpa: see the module docstring. Subclasses override `prepare` and `attend`."""

    name = "sdpa"
    additive_bias = True
    """Builds an additive bias [b, np|1, s, s] per attention pattern that needs one (`_bias`)."""
    keeps_scores = False
    """Keeps the scores [b, np, s, s] for the backward (unfused); False: a fused kernel on a GPU."""

    def __init__(self, position: PositionEncoding):
        self.position = position

    @classmethod
    def from_config(cls, model: ModelConfig, position: PositionEncoding) -> AttentionBackend:
        """The backend of an encoder built from `model`, with its settings (`with_settings`); another backend's
        setting away from its default gets a warning, not an error: a folder trained on one backend may run
        on another."""
        for key, backend in BACKEND_SETTINGS.items():
            value = getattr(model, key)
            if backend != cls.name and value != field_default(ModelConfig, key):
                warnings.warn(f"model.{key}={value!r} applies to model.attention_backend={backend} only; the "
                              f"{cls.name} backend ignores it")
        return cls.with_settings(model, position)

    @classmethod
    def with_settings(cls, model: ModelConfig, position: PositionEncoding) -> AttentionBackend:
        """The backend reading its settings, the keys BACKEND_SETTINGS gives it (none here)."""
        return cls(position)

    def prepare_layers(self, patterns, padding: torch.Tensor, documents: torch.Tensor | None,
                       segments: torch.Tensor | None, dtype: torch.dtype,
                       host: tuple | None = None) -> dict[LayerAttention, LayerInputs]:
        """Each pattern in use (ModelConfig.layer_attention) -> its LayerInputs (`prepare`, the rotation).
        host: (padding, documents, segments) on the CPU, what the layout's sizes are read from (LayoutReads)."""
        rotations = {}  # (cos, sin) for the global / local layers in use, computed once each
        if self.position.rotates:
            positions = sample_positions(segments, padding.size(1), padding.device)
            rotations = {local: self.position.rotation(positions, local)
                         for local in {pattern.window is not None for pattern in patterns}}
        reads = LayoutReads(padding, documents, segments, host)  # read once for all the patterns
        return {pattern: LayerInputs(self.prepare(padding, documents, segments, dtype, pattern, reads),
                                     rotations.get(pattern.window is not None))
                for pattern in set(patterns)}

    @staticmethod
    def unsupported_here(model: ModelConfig) -> str | None:
        """Why this machine or config cannot run the backend, or None (checked before any work)."""
        return None

    def prepare(self, padding: torch.Tensor, documents: torch.Tensor | None, segments: torch.Tensor | None,
                dtype: torch.dtype, pattern: LayerAttention = GLOBAL_ATTENTION, reads: LayoutReads | None = None):
        """padding [b, s] bool; documents [b, s] (document index, -1 on padding) or None when
        attention may span a whole sample; segments [b, s] (sample index in a packed row, -1 on
        padding) or None for one sample per row; pattern: the layers' (patterns.py); reads: the
        LayoutReads of the three that the preparations of one forward share (prepare_layers; None: read
        here) -> the additive bias [b, np|1, s, s] (None where every query may see every key of its
        row), or PackedRows."""
        reads = reads or LayoutReads(padding, documents, segments)
        if segments is not None:
            return self._prepare_packed(documents, segments, dtype, pattern, reads)
        return self._bias(padding, documents, dtype, pattern, reads.any_padding)

    def _bias(self, padding, documents, dtype, pattern: LayerAttention, any_padding) -> torch.Tensor | None:
        """any_padding(free_only=False) -> whether a key of `padding` is padded, or None (`LayoutReads.any_padding`;
        asked only where it decides)."""
        b, s = padding.shape
        score = self.position.score_bias(s, dtype)
        # no mask lets SDPA take its flash path, worth a device read; the score term's [1, np, s, s] shared by the
        # rows is asked for only where the answer waits for no device (a host copy of the layout)
        if documents is None and pattern.window is None and any_padding(free_only=score is not None) is False:
            # every query sees every key of its row: no mask, or the score term alone, [np, s, s] -> [b, np, s, s]
            return None if score is None else score.contiguous()[None].expand(b, -1, -1, -1)
        # [b, s] -> [b, 1, 1, s]: -inf on padded keys
        bias = torch.zeros(b, 1, 1, s, dtype=dtype, device=padding.device)
        bias = bias.masked_fill(padding[:, None, None, :], float("-inf"))
        if documents is not None:
            # [b, 1, s, 1] vs [b, 1, 1, s] -> [b, 1, s, s]: real queries see only their document
            query_doc, key_doc = documents[:, None, :, None], documents[:, None, None, :]
            bias = bias.masked_fill((query_doc >= 0) & (query_doc != key_doc), float("-inf"))
        if pattern.window is not None:
            # [s, 1] with [1, s] -> [s, s]; [b, 1, s, 1] & [s, s] -> [b, 1, s, s]: real queries see their
            # pattern (a padded query keeps every real key, so no row of the softmax is empty)
            index = torch.arange(s, device=padding.device)
            table = random_block_table(pattern, padding.device)
            outside = ~pattern_sees(pattern, index[:, None], index[None, :], table)
            bias = bias.masked_fill(~padding[:, None, :, None] & outside, float("-inf"))
        if score is not None:
            # [b, 1, s|1, s] + [1, np, s, s] -> [b, np, s, s], shared by all layers
            bias = bias + score[None]
        return bias

    def _prepare_packed(self, documents, segments, dtype, pattern, reads: LayoutReads) -> PackedRows:
        positions, sample, lengths, longest = reads.sequences(within_documents=False)
        starts = torch.cumsum(lengths, 0) - lengths
        slot = torch.arange(len(sample), device=segments.device) - starts[sample]
        n = len(lengths)
        index = torch.zeros(n, longest, dtype=torch.long, device=segments.device)
        filled = torch.zeros(n, longest, dtype=torch.bool, device=segments.device)
        index[sample, slot], filled[sample, slot] = positions, True
        # within each sample, the layout of one padded row per sample: [n, L] -> [n, np|1, L, L]
        docs = None if documents is None else documents.flatten()[index].masked_fill(~filled, -1)
        unequal = len(sample) < n * longest  # a sample shorter than the longest: [n, L] holds padding
        return PackedRows(index, positions, sample * longest + slot,
                          self._bias(~filled, docs, dtype, pattern, lambda free_only=False: unequal))

    def attend_unsplit(self, qkv: torch.Tensor, prepared, dropout_p: float, scale: float | None) -> torch.Tensor:
        """qkv [b, np, s, 3 · hn], each head's query, key and value side by side (the QKV projection's layout)
        -> `attend`'s [b, np, s, hn]. Here split into views: their gradients are concatenated in the backward,
        as after megatron's split; a backend whose kernels can write that layout overrides this."""
        return self.attend(*split_qkv(qkv), prepared, dropout_p, scale)

    def attend(self, q, k, v, prepared, dropout_p: float, scale: float | None) -> torch.Tensor:
        """q, k, v [b, np, s, hn] -> [b, np, s, hn]."""
        if isinstance(prepared, PackedRows):
            out = self._attend(*(prepared.gather(t) for t in (q, k, v)), prepared.bias, dropout_p, scale)
            return prepared.scatter(out, q)
        return self._attend(q, k, v, prepared, dropout_p, scale)

    def _attend(self, q, k, v, bias, dropout_p: float, scale: float | None) -> torch.Tensor:
        if dropout_p > 0 and q.device.type == "cpu":
            return _eager(q, k, v, bias, dropout_p, scale)
        # heads are sharded: each TP rank needs its own dropout stream
        with tensor_parallel_rng.fork(q.device) if dropout_p > 0 else contextlib.nullcontext(), \
                sdpa_kernels(q.device.type, k.size(-2), bias is not None):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale)


def sdpa_kernels(device_type: str, key_length: int, masked: bool):
    """SDPA's kernels for these keys: torch's choice, except cuDNN's where it is wrong. From torch 2.11
    on Hopper, cuDNN's backward with a mask returns NaN in dQ when the key length is 64 mod 128 and a
    query's log-sum-exp is below -88.7 (pytorch#196678), which ALiBi gives padded queries far from the
    real keys: every bf16 eager run on the H200 skipped update 23, whose micro-batch was 1,856 wide
    (BENCHMARKS.md). Such batches run on the memory-efficient kernel (exact, slower)."""
    if device_type == "cuda" and masked and key_length % 128 == 64:
        return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])
    return contextlib.nullcontext()


class EagerAttention(AttentionBackend):
    """softmax(q·kᵀ·scale + bias), our dropout, @ v: what SDPA computes on CPU with dropout."""

    name = "eager"
    keeps_scores = True

    def _attend(self, q, k, v, bias, dropout_p: float, scale: float | None) -> torch.Tensor:
        return _eager(q, k, v, bias, dropout_p, scale)


class FlexAttention(AttentionBackend):
    """FlexAttention with the position's score term as score_mod and a document BlockMask."""

    name = "flex"
    additive_bias = False

    def __init__(self, position: PositionEncoding, kernel_options: dict | None = None):
        super().__init__(position)
        self.kernel_options = kernel_options or None
        """FlexAttention's kernel_options (model.flex_kernel_options); None: torch's choice."""

    @classmethod
    def with_settings(cls, model: ModelConfig, position: PositionEncoding) -> FlexAttention:
        return cls(position, kernel_options(model.flex_kernel_options))

    @staticmethod
    def unsupported_here(model: ModelConfig) -> str | None:
        try:
            kernel_options(model.flex_kernel_options,
                           model.position if POSITIONS[model.position].score_term else None)
        except ConfigError as err:
            return str(err)
        if not torch.cuda.is_available():
            return ("model.attention_backend=flex needs a CUDA GPU (torch 2.13 has no FlexAttention "
                    "backward on CPU); use model.attention_backend=sdpa")
        return None

    def prepare(self, padding, documents, segments, dtype, pattern=GLOBAL_ATTENTION, reads=None):
        """(BlockMask over the rows as they are, packed or not; the position's score parameters or
        None). Distances in a packed row are distances within its samples (they never mix)."""
        groups = attention_groups(padding, documents, segments)
        starts = None if segments is None else sample_starts(segments)
        return flex_block_mask(groups, pattern, starts), self.position.score_params()

    def attend(self, q, k, v, prepared, dropout_p: float, scale: float | None) -> torch.Tensor:
        block_mask, params = prepared
        term = None if params is None else self.position.score_function()

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + term(params, h, q_idx, kv_idx).to(score.dtype)

        score_mod = None if params is None else score_mod
        flex = functools.partial(compiled_flex_attention(q.device.type), block_mask=block_mask, scale=scale,
                                 kernel_options=self.kernel_options)
        if dropout_p == 0:
            return flex(q, k, v, score_mod=score_mod)

        def attend_lse(q, k, v, score_mod):
            out, aux = flex(q, k, v, score_mod=score_mod, return_aux=AuxRequest(lse=True))
            return out, aux.lse

        # heads are sharded: the seed comes from this TP rank's stream (flex.py)
        return attend_with_dropout(attend_lse, q, k, v, score_mod, dropout_p, draw_seed(q.device))


@dataclass
class Sequences:
    """varlen's inputs: the real tokens of the batch as sequences end to end."""

    positions: torch.Tensor
    """[t] flat (b·s) positions of the real tokens, sequence after sequence."""
    cu_seqlens: torch.Tensor
    """[n + 1] int32 start of each sequence in the [t] stream, then t."""
    longest: int
    window: int | None


class VarlenAttention(AttentionBackend):
    """Variable-length FlashAttention over the real tokens (module docstring)."""

    name = "varlen"
    additive_bias = False

    @staticmethod
    def unsupported_here(model: ModelConfig) -> str | None:
        if model.local_attention == "bigbird":
            return ("model.attention_backend=varlen has no BigBird pattern (only windows); use "
                    "model.attention_backend=flex (or sdpa)")
        if model.position == "alibi":
            return ("model.attention_backend=varlen has no score term for ALiBi; use "
                    "model.attention_backend=flex (or sdpa)")
        if model.attention_dropout > 0:
            return "model.attention_backend=varlen has no attention dropout; set model.attention_dropout=0"
        if not torch.cuda.is_available():
            return "model.attention_backend=varlen needs a CUDA GPU (torch's varlen FlashAttention); use sdpa"
        return None

    def prepare(self, padding, documents, segments, dtype, pattern=GLOBAL_ATTENTION, reads=None) -> Sequences:
        reads = reads or LayoutReads(padding, documents, segments)
        positions, _, lengths, longest = reads.sequences()
        cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)
        return Sequences(positions, cu_seqlens, longest, pattern.window)

    def attend(self, q, k, v, prepared: Sequences, dropout_p: float, scale: float | None) -> torch.Tensor:
        if dropout_p > 0:
            raise ConfigError("model.attention_backend=varlen has no attention dropout; set model.attention_dropout=0")
        b, np_local, s, hn = q.shape

        def tokens(t):  # [b, np, s, hn] -> [b*s, np, hn] -> [t, np, hn]
            return t.transpose(1, 2).reshape(b * s, np_local, hn)[prepared.positions]

        cu, longest = prepared.cu_seqlens, prepared.longest
        half = -1 if prepared.window is None else prepared.window // 2  # keys each side; -1: unlimited
        out = varlen_attention(q.device.type)(tokens(q), tokens(k), tokens(v), cu, cu, longest, longest,
                                               scale=scale, window_size=(half, half))
        # [t, np, hn] -> [b*s, np, hn] (zeros on padding) -> [b, np, s, hn]
        full = out.new_zeros(b * s, np_local, hn).index_copy(0, prepared.positions, out)
        return full.view(b, s, np_local, hn).transpose(1, 2)


class AlibiFlashAttention(AttentionBackend):
    """ALiBi on two causal flash passes (module docstring); packed rows are gathered as sdpa gathers them."""

    name = "alibi-flash"
    additive_bias = False

    @staticmethod
    def unsupported_here(model: ModelConfig) -> str | None:
        if model.position != "alibi" or model.alibi_mode == "learned":
            return "model.attention_backend=alibi-flash needs model.alibi_mode symmetric or offset; use sdpa or flex"
        if model.local_window is not None or model.document_mask:
            return "model.attention_backend=alibi-flash has no local attention and no document mask; use sdpa or flex"
        return None if model.attention_dropout == 0 or torch.cuda.is_available() else (
            "model.attention_backend=alibi-flash with attention dropout needs a CUDA GPU (the CPU runs a "
            "reference pass without dropout); set model.attention_dropout=0 or use sdpa")

    def __init__(self, position: PositionEncoding, head_dim: int = 64):
        super().__init__(position)
        self.head_dim = head_dim

    @classmethod
    def from_config(cls, model: ModelConfig, position: PositionEncoding) -> AlibiFlashAttention:
        return cls(position, model.head_dim)

    def _bias(self, padding, documents, dtype, pattern, any_padding) -> AlibiTerms:
        """The extra head dimensions and log-sum-exp corrections every layer shares (padded keys: [b, s])."""
        flash_kernel(padding.device, dtype)  # chosen (a GPU's checked) here, before any compiled layer runs
        return alibi_terms(self.position.slopes, self.position.offset, padding if any_padding() else None,
                           padding.size(1), self.head_dim, dtype)

    def _attend(self, q, k, v, terms: AlibiTerms, dropout_p: float, scale: float | None) -> torch.Tensor:
        assert scale is None or scale == terms.scale, "alibi-flash prepares its terms for 1/sqrt(head dim)"
        with tensor_parallel_rng.fork(q.device) if dropout_p > 0 else contextlib.nullcontext():
            return alibi_flash_attention(q, k, v, terms, dropout_p, flash_kernel(q.device, q.dtype))


def _eager(q, k, v, bias, dropout_p: float, scale: float | None) -> torch.Tensor:
    """softmax(q·kᵀ·scale + bias), our dropout (the tensor-parallel stream), @ v."""
    scale = scale if scale is not None else q.size(-1) ** -0.5
    # [b, np, s, hn] x [b, np, hn, s] -> [b, np, s, s]
    scores = torch.matmul(q * scale, k.transpose(-2, -1))
    if bias is not None:
        scores.add_(bias)  # in place: a fresh [b, np, s, s] buffer costs more than the add
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        with tensor_parallel_rng.fork(q.device):
            probs = dropout(probs, dropout_p, training=True)
    # [b, np, s, s] x [b, np, s, hn] -> [b, np, s, hn]
    return torch.matmul(probs, v)
