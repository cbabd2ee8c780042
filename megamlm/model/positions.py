"""Position encodings as parts: each one says what it adds to the input embeddings and/or to the
attention scores, and the encoder and the attention backend ask it (`POSITIONS` by config name).

    embed(tokens) -> [b, s, h]             input term (learned, sinusoidal): `input_term = True`
    score_bias(length, dtype) -> [np, s, s] score term, materialized (the sdpa backend)
    score_params() -> tensor, score_function()(params, h, q_idx, kv_idx)
                                           the same score term element by element (flex's score_mod)
    rotation(positions, local) -> (cos, sin) queries and keys rotated by position (RoPE): `rotates = True`

fairseq numbers positions from `pad_token_id + 1` (= 2): position ids are
`cumsum(not_pad) * not_pad + pad_token_id`, so padding gets the (zero) pad row and the first real
token gets row 2. Both tables below follow that layout so fairseq checkpoints map one to one.

ALiBi (Press et al.) adds `-m_h * distance` to the attention scores of head h. For an encoder the
distance must be defined on both sides of the query:
  symmetric  bias[h, i, j] = -m_h |i - j|
  offset     keys after the query (j > i) get -m_h (j - i - 0.5)   ("nonsymmetric with offset")
  learned    separate learnable slopes for keys before / after the query ("option 3")
Every tensor-parallel rank builds the bias only for the heads it owns.
"""

from __future__ import annotations

import math

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from torch import nn

from megamlm.config import ModelConfig
from megamlm.errors import MegamlmError


class PositionEncoding(nn.Module):
    """No position information (model.position=none); the base of every encoding."""

    input_term: bool = False
    """True: adds `embed(tokens)` to the token embeddings (registered in the embedding as
    `embedding.positions`); False: acts on attention scores (registered as `alibi`, wave 1's name)."""
    rotates: bool = False
    """True: rotates each layer's queries and keys (`rotation`, RoPE) before the backend attends."""
    score_term: bool = False
    """True: adds a term per head to every attention score (`score_params`, `score_bias`: ALiBi)."""

    @classmethod
    def from_config(cls, model: ModelConfig, tp_rank: int, tp_size: int) -> PositionEncoding:
        return cls()

    def embed(self, tokens: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        """[b, s] -> [b, s, h]; `segments` (packed rows): positions restart at each sample."""
        raise NotImplementedError(f"{type(self).__name__} has no input term")

    def score_params(self) -> torch.Tensor | None:
        """Tensors the score term needs, computed once per forward; None: no score term."""
        return None

    def score_function(self):
        """fn(params, h, q_idx, kv_idx): the term added to q·kᵀ/√hn for head h (of this rank),
        query q_idx, key kv_idx; broadcasts. A plain function of its arguments and constants (no
        module attributes): FlexAttention traces it into its kernel."""
        raise NotImplementedError(f"{type(self).__name__} has no score term")

    def rotation(self, positions: torch.Tensor, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [b|1, s] (sample_positions) -> (cos, sin) [b|1, 1, s, hn] for `apply_rotation`."""
        raise NotImplementedError(f"{type(self).__name__} does not rotate")

    def score_bias(self, length: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The score term for every (head, query, key) of a `length` sample: [np, s, s], or None."""
        params = self.score_params()
        if params is None:
            return None
        heads = torch.arange(params.size(-1), device=params.device)[:, None, None]
        positions = torch.arange(length, device=params.device)
        # [np, 1, 1], [s, 1], [1, s] -> [np, s, s]
        return self.score_function()(params, heads, positions[:, None], positions[None, :]).to(dtype)


def fairseq_position_ids(tokens: torch.Tensor, pad_token_id: int,
                         segments: torch.Tensor | None = None) -> torch.Tensor:
    """[b, s] token ids -> [b, s] position ids; pads get pad_token_id, real tokens pad_id+1, +2, ...
    With `segments` [b, s] (packed rows: the sample of each position, -1 on padding) the count
    restarts at every sample."""
    if segments is None:
        not_pad = tokens.ne(pad_token_id).int()
        return (torch.cumsum(not_pad, dim=1) * not_pad).long() + pad_token_id
    return torch.where(segments >= 0, sample_positions(segments, segments.size(1), segments.device) + pad_token_id + 1,
                       pad_token_id)


def sample_starts(segments: torch.Tensor) -> torch.Tensor:
    """[b, s] sample of each position (packed rows) -> [b, s] the index where its sample starts."""
    index = torch.arange(segments.size(1), device=segments.device).expand_as(segments)
    starts = segments.ne(torch.nn.functional.pad(segments, (1, 0), value=-2)[:, :-1])
    # a running max over the sample starts
    return torch.cummax(torch.where(starts, index, 0), dim=1).values


def sample_positions(segments: torch.Tensor | None, length: int, device) -> torch.Tensor:
    """0-based position of each token in its sample: [b, s] for packed rows (restarting at every
    sample, so a packed sample is rotated exactly as it is alone), else [1, s]."""
    index = torch.arange(length, device=device)[None]
    return index if segments is None else index - sample_starts(segments)


class LearnedPositions(PositionEncoding):
    """fairseq LearnedPositionalEmbedding: max_positions + pad_id + 1 rows, the pad row is zero."""

    input_term = True

    def __init__(self, max_positions: int, hidden_size: int, pad_token_id: int):
        super().__init__()
        self.pad_token_id = pad_token_id
        self.max_positions = max_positions
        self.weight = nn.Parameter(torch.empty(max_positions + pad_token_id + 1, hidden_size))

    @classmethod
    def from_config(cls, model: ModelConfig, tp_rank: int, tp_size: int) -> LearnedPositions:
        return cls(model.max_positions, model.embedding_dim, model.pad_token_id)

    def forward(self, tokens: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        # packed rows are longer, but each sample fits (the config checks seq_length <= max_positions)
        if segments is None and tokens.size(1) > self.max_positions:
            raise MegamlmError(
                f"sequence length {tokens.size(1)} exceeds the learned position table "
                f"(max_positions={self.max_positions}); learned positions cannot extrapolate"
            )
        # [b, s] -> [b, s, h]
        return nn.functional.embedding(fairseq_position_ids(tokens, self.pad_token_id, segments), self.weight,
                                       padding_idx=self.pad_token_id)

    embed = forward


def sinusoidal_table(num_positions: int, dim: int, pad_token_id: int) -> torch.Tensor:
    """fairseq SinusoidalPositionalEmbedding.get_embedding: [sin | cos] halves, pad row zero."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float) * -(math.log(10000) / (half - 1)))
    angles = torch.arange(num_positions, dtype=torch.float)[:, None] * freq[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(num_positions, 1)], dim=1)
    table[pad_token_id] = 0
    return table


class SinusoidalPositions(PositionEncoding):
    """Fixed sinusoidal positions in fairseq's layout; any length (the table grows on demand)."""

    input_term = True

    def __init__(self, hidden_size: int, pad_token_id: int):
        super().__init__()
        self.hidden_size, self.pad_token_id = hidden_size, pad_token_id
        self.register_buffer("table", torch.empty(0, hidden_size), persistent=False)

    @classmethod
    def from_config(cls, model: ModelConfig, tp_rank: int, tp_size: int) -> SinusoidalPositions:
        return cls(model.embedding_dim, model.pad_token_id)

    def forward(self, tokens: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        needed = tokens.size(1) + self.pad_token_id + 1
        if self.table.size(0) < needed:
            self.table = sinusoidal_table(needed, self.hidden_size, self.pad_token_id).to(
                self.table.device)
        # [b, s] -> [b, s, h]
        return self.table[fairseq_position_ids(tokens, self.pad_token_id, segments)]

    embed = forward


# ------------------------------------------------------------------------------------------------
# ALiBi
# ------------------------------------------------------------------------------------------------

ALIBI_OFFSETS = {"symmetric": 0.0, "offset": 0.5, "learned": 0.0}
"""model.alibi_mode -> the distance subtracted from keys after the query."""


def alibi_slopes(num_heads: int) -> list[float]:
    """Press et al.'s slopes, head order included (fairseq utils.alibi, unchanged).

    Power of 2: 2^(-8(i+1)/n). Otherwise the c = 2^floor(log2 n) power-of-2 slopes followed by the
    odd-exponent slopes of 2c heads: 12 heads -> 2^-1..2^-8, 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5.
    """

    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_2(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return power_of_2(closest) + alibi_slopes(2 * closest)[0::2][: num_heads - closest]


def alibi_score(distance, slope_before, slope_after, offset: float):
    """ALiBi's score term, the one formula of the package (the sdpa bias and flex's score_mod both
    call it): distance = j - i (key minus query); keys at or before the query get
    -m_before (i - j), keys after it -m_after (j - i - offset). Broadcasts over its arguments."""
    return torch.where(distance > 0, -(slope_after * (distance - offset)),
                       slope_before * distance.clamp(max=0))


def alibi_bias(slopes_before: torch.Tensor, slopes_after: torch.Tensor, q_len: int, k_len: int,
               offset: float) -> torch.Tensor:
    """[np] slopes -> additive bias [np, q_len, k_len] (alibi_score at every position)."""
    device = slopes_before.device
    # [1, sk] - [sq, 1] -> [sq, sk]
    distance = torch.arange(k_len, device=device)[None, :] - torch.arange(q_len, device=device)[:, None]
    # [np, 1, 1] with [sq, sk] -> [np, sq, sk]
    return alibi_score(distance, slopes_before[:, None, None], slopes_after[:, None, None], offset)


class Alibi(PositionEncoding):
    """ALiBi slopes of this tensor-parallel rank's heads and the score term they induce.

    Fixed modes keep one bias for the longest length seen per (dtype, device) and slice it: the bias
    depends only on i - j, so the top-left block of a larger matrix is exact. The learned mode keeps
    log-slopes (slopes stay positive) of shape [2, np] (before, after) and rebuilds the bias each
    forward; the encoder prepares it once per forward and every layer shares it.
    """

    score_term = True

    def __init__(self, num_heads: int, mode: str, tp_rank: int, tp_size: int):
        super().__init__()
        heads_local = num_heads // tp_size
        first = tp_rank * heads_local
        slopes = torch.tensor(alibi_slopes(num_heads)[first:first + heads_local], dtype=torch.float)
        self.mode = mode
        self.offset = ALIBI_OFFSETS[mode]
        if mode == "learned":
            # [2, np]: row 0 keys before (and at) the query, row 1 keys after it
            self.log_slopes = nn.Parameter(slopes.log().repeat(2, 1))
            set_tensor_model_parallel_attributes(self.log_slopes, is_parallel=True, dim=1, stride=1)
        else:
            self.register_buffer("slopes", slopes, persistent=False)
        self._cache: dict[tuple, torch.Tensor] = {}

    @classmethod
    def from_config(cls, model: ModelConfig, tp_rank: int, tp_size: int) -> Alibi:
        return cls(model.num_attention_heads, model.alibi_mode, tp_rank, tp_size)

    def slopes_before_after(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mode == "learned":
            slopes = self.log_slopes.exp()
            return slopes[0], slopes[1]
        return self.slopes, self.slopes

    def score_params(self) -> torch.Tensor:
        """[2, np]: slopes for keys before (and at) the query, and after it."""
        return torch.stack(self.slopes_before_after())

    def score_function(self):
        offset = self.offset

        def score(params, h, q_idx, kv_idx):
            return alibi_score(kv_idx - q_idx, params[0, h], params[1, h], offset)

        return score

    def score_bias(self, length: int, dtype: torch.dtype) -> torch.Tensor:
        return self(length, dtype)

    def forward(self, length: int, dtype: torch.dtype) -> torch.Tensor:
        """Bias [np, length, length] in `dtype`, ready to add to q·k/√d."""
        if self.mode == "learned":
            return alibi_bias(*self.slopes_before_after(), length, length, self.offset).to(dtype)
        key = (dtype, self.slopes.device)
        cached = self._cache.get(key)
        if cached is None or cached.size(-1) < length:
            cached = alibi_bias(self.slopes, self.slopes, length, length, self.offset).to(dtype)
            self._cache[key] = cached
        return cached[:, :length, :length]


# ------------------------------------------------------------------------------------------------
# RoPE
# ------------------------------------------------------------------------------------------------


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., hn] -> [..., hn]: (x1, x2) -> (-x2, x1) on the two halves (GPT-NeoX / HF layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotation(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[b, np, s, hn] rotated by position: t·cos + rotate_half(t)·sin, in fp32, back in t's dtype."""
    rotated = t.float() * cos + rotate_half(t.float()) * sin
    return rotated.to(t.dtype)


class Rotary(PositionEncoding):
    """Rotary position embeddings (Su et al.): dimension pairs (d, d + hn/2) of each head's query and
    key are rotated by position × θ^(-2d/hn), so q·k depends on the distance only. Nothing is
    learned and every head rotates alike, so tensor parallelism needs nothing; local layers use
    their own θ (model.rope_theta_local), as ModernBERT does."""

    rotates = True

    def __init__(self, head_dim: int, theta: float, theta_local: float):
        super().__init__()
        self.head_dim, self.theta, self.theta_local = head_dim, theta, theta_local

    @classmethod
    def from_config(cls, model: ModelConfig, tp_rank: int, tp_size: int) -> Rotary:
        return cls(model.head_dim, model.rope_theta, model.rope_theta_local)

    def rotation(self, positions: torch.Tensor, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [b|1, s] -> (cos, sin) [b|1, 1, s, hn] in fp32 for a global or local layer."""
        theta = self.theta_local if local else self.theta
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float, device=positions.device) / self.head_dim
        inverse_frequency = 1.0 / (theta ** exponent)
        # [b, s, 1] * [hn/2] -> [b, s, hn/2] -> [b, s, hn] (both halves) -> [b, 1, s, hn]
        angles = positions[..., None].float() * inverse_frequency
        angles = torch.cat((angles, angles), dim=-1)[:, None]
        return angles.cos(), angles.sin()


POSITIONS: dict[str, type[PositionEncoding]] = {
    "none": PositionEncoding,
    "learned": LearnedPositions,
    "sinusoidal": SinusoidalPositions,
    "alibi": Alibi,
    "rope": Rotary,
}
"""model.position -> its encoding (the names of ModelConfig.position; tests/test_model.py checks both)."""


def build_position(model: ModelConfig, tp_rank: int, tp_size: int) -> PositionEncoding:
    return POSITIONS[model.position].from_config(model, tp_rank, tp_size)
