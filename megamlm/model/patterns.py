"""Which keys a query may see: the rules every attention backend expresses in its own form (an
additive bias for sdpa / eager, a BlockMask for flex, cu_seqlens and window_size for varlen).

  samples, documents  a real query sees the real keys of its sample (packed rows: `segments`) or, with
                      model.document_mask, of its document; a padded query sees every real key (so no
                      softmax row is empty; its output is never read)
  LayerAttention      within that, a local layer's pattern (config/model.py): the window
                      |i - j| <= window // 2 (ModernBERT), and with model.local_attention=bigbird
                      (Zaheer et al. 2020) the sample's first global tokens, which see and are seen by
                      every token, and random key blocks per query block.

Positions are positions in the sample, so a pattern is the same for a sample in any batch layout.
BigBird's random blocks are drawn once per layer (seeded by its index) as a [N, N] table over
N = table_blocks blocks of block_size positions, indexed modulo N: the same sample gets the same
pattern padded or packed, at any length.
"""

from __future__ import annotations

import functools

import torch

from megamlm.config import GLOBAL_ATTENTION, LayerAttention


def random_block_table(pattern: LayerAttention, device=None) -> torch.Tensor | None:
    """[N, N] bool: key block j is one of query block i's random blocks (None without random blocks)."""
    return _drawn_table(pattern, torch.device(device or "cpu")) if pattern.random_blocks else None


@functools.cache
def _drawn_table(pattern: LayerAttention, device: torch.device) -> torch.Tensor:
    """The draw behind random_block_table (on the host), once per pattern and device: every forward
    reuses it, and none copies it to the GPU again (a copy that would wait for the queued kernels)."""
    n = pattern.table_blocks
    generator = torch.Generator().manual_seed(1_000_003 + pattern.seed)
    # [N, N] uniform -> per row the indices of its random_blocks smallest draws
    chosen = torch.rand(n, n, generator=generator).argsort(dim=1)[:, : min(pattern.random_blocks, n)]
    return torch.zeros(n, n, dtype=torch.bool).scatter_(1, chosen, True).to(device)


def pattern_sees(pattern: LayerAttention, query_position, key_position, table: torch.Tensor | None):
    """Whether a real query sees a key of its sample under a local pattern; positions in the sample
    (broadcasting integer tensors)."""
    seen = (query_position - key_position).abs() <= pattern.window // 2
    if pattern.global_tokens:
        seen = seen | (query_position < pattern.global_tokens) | (key_position < pattern.global_tokens)
    if table is not None:
        n = table.size(0)
        seen = seen | table[(query_position // pattern.block_size) % n, (key_position // pattern.block_size) % n]
    return seen


def group_sees(query_group, key_group):
    """Whether a query of `query_group` sees a key of `key_group` (`attention_groups`' ids; -1 padding): a
    real query the real keys of its own group, a padding query every real key. Broadcasts."""
    return (key_group >= 0) & ((query_group < 0) | (key_group == query_group))


def flex_block_mask(groups: torch.Tensor, pattern: LayerAttention = GLOBAL_ATTENTION,
                    starts: torch.Tensor | None = None):
    """[b, s] key groups (-1 on padding, else the document index; 0 when samples are not split into
    documents) -> the FlexAttention BlockMask: real queries see the real keys of their own document
    (through `pattern` in a local layer; `starts` [b, s]: where each position's sample starts in a
    packed row, None: at 0), padding queries every real key. The kernel skips key blocks that are
    all padding, all another document or all outside the pattern."""
    from torch.nn.attention.flex_attention import create_block_mask

    table = random_block_table(pattern, groups.device)

    def visible(b, h, q_idx, kv_idx):
        query, key = groups[b, q_idx], groups[b, kv_idx]
        seen = group_sees(query, key)
        if pattern.window is None:
            return seen
        query_position = q_idx if starts is None else q_idx - starts[b, q_idx]
        key_position = kv_idx if starts is None else kv_idx - starts[b, kv_idx]
        return seen & (pattern_sees(pattern, query_position, key_position, table) | (query < 0))

    b, s = groups.shape
    # compiled on GPU: the eager construction materializes [b, s, s] index tensors (GiBs at 8192)
    return create_block_mask(visible, b, None, s, s, device=groups.device, _compile=groups.device.type == "cuda")
