"""The sequences of a batch as attention kernels without padding see them: the groups attention stays
within (documents, packed samples, rows), their real tokens end to end with their lengths, and the
varlen kernel (or its CPU stand-in). Reading the lengths needs the data on the host; `shared_sequences`
makes that happen once per forward whatever the number of attention patterns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sequences(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[b, s] group ids (sample or document, -1 on padding; a new group where the id changes) ->
    (flat positions of the real tokens [t], their sequence 0..n-1 [t], sequence lengths [n])."""
    b, s = groups.shape
    real = groups.flatten() >= 0
    # [b, s] -> [t]: one id per sequence of the batch (rows hold < s sequences each)
    ids = (groups + s * torch.arange(b, device=groups.device)[:, None]).flatten()[real]
    sequence = torch.unique_consecutive(ids, return_inverse=True)[1]
    return real.nonzero().squeeze(1), sequence, torch.bincount(sequence)


def attention_groups(padding: torch.Tensor | None, documents: torch.Tensor | None, segments: torch.Tensor | None):
    """[b, s] the groups attention stays within: documents, else packed samples, else rows; -1 on padding."""
    if documents is not None:
        return documents
    return segments if segments is not None else padding.long().neg()


def shared_sequences(shared: dict | None, padding, documents, segments):
    """`sequences` of the `attention_groups` and the longest sequence, computed (read from the device) once per
    forward when the preparations of its attention patterns pass the same `shared` dict."""
    key = ("sequences", id(padding), id(documents), id(segments))  # alive while the forward prepares
    if shared is None or key not in shared:
        positions, sequence, lengths = sequences(attention_groups(padding, documents, segments))
        value = positions, sequence, lengths, int(lengths.max())
        if shared is None:
            return value
        shared[key] = value
    return shared[key]


def sequence_by_sequence(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """What varlen_attn computes, one SDPA per sequence ([t, np, hn] in and out): the CPU stand-in."""
    bounds = cu_q.tolist()

    def near(length):  # [s, s]: within window_size keys before / after the query (-1: unlimited)
        distance = torch.arange(length)[None, :] - torch.arange(length)[:, None]
        before, after = (length if w < 0 else w for w in window_size)
        return (distance >= -before) & (distance <= after)

    parts = [F.scaled_dot_product_attention(*(t[start:end].transpose(0, 1) for t in (q, k, v)),
                                            attn_mask=near(end - start), scale=scale)
             for start, end in zip(bounds[:-1], bounds[1:])]
    return torch.cat([p.transpose(0, 1) for p in parts])


def varlen_attention(device_type: str):
    """torch's variable-length FlashAttention on CUDA; elsewhere `sequence_by_sequence` stands in."""
    if device_type != "cuda":
        return sequence_by_sequence
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn
