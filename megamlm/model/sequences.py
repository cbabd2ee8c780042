"""The sequences of a batch as attention kernels without padding see them: the groups attention stays
within (documents, packed samples, rows), their real tokens end to end with their lengths, and the
varlen kernel (or its CPU stand-in); and packed rows' samples gathered side by side (`PackedRows`, what
sdpa and alibi-flash attend over). Reading the lengths needs the data on the host: `LayoutReads` reads
them once per forward, from the batch's host copy when it has one (no wait for the device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megamlm.parallel import host_to_device


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


@dataclass
class PackedRows:
    """sdpa's inputs for packed rows: where each sample's positions sit in the flat (b·s) stream."""

    index: torch.Tensor
    """[n, L] flat position of slot j of sample i (0 in empty slots)."""
    positions: torch.Tensor
    """[t] flat positions of the real tokens, and `slots` [t] their slot (i·L + j): the way back,
    precomputed so that compiled layers index with tensors, never with a data-dependent mask."""
    slots: torch.Tensor
    bias: torch.Tensor | None
    """[n, np|1, L, L] additive bias within each sample (None: no mask); alibi-flash's AlibiTerms."""

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """[b, np, s, hn] -> [n, np, L, hn], the samples side by side."""
        b, np_local, s, hn = t.shape
        # [b, np, s, hn] -> [np, b*s, hn] -> [np, n, L, hn] -> [n, np, L, hn]
        return t.transpose(0, 1).reshape(np_local, b * s, hn)[:, self.index].transpose(0, 1)

    def scatter(self, out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """[n, np, L, hn] -> [b, np, s, hn] shaped like `like` (zeros where no sample is)."""
        b, np_local, s, hn = like.shape
        n, _, length, _ = out.shape
        # [n, np, L, hn] -> [np, n*L, hn]; the filled slots go back to their positions
        filled = out.transpose(0, 1).reshape(np_local, n * length, hn)[:, self.slots]
        flat = out.new_zeros(np_local, b * s, hn).index_copy(1, self.positions, filled)
        # [np, b*s, hn] -> [b, np, s, hn]
        return flat.view(np_local, b, s, hn).transpose(0, 1)


class LayoutReads:
    """What the attention preparations of one forward read of the batch's layout on the host — whether
    any key is padded, the sequences and their lengths — read once whatever the number of attention
    patterns, and without waiting for the device when the batch brought its layout along on the host.

    padding [b, s] bool, documents / segments [b, s] or None (AttentionBackend.prepare); `host`: the same
    three on the CPU (copies made before the batch moved to the device) or None: read from the device.
    """

    def __init__(self, padding: torch.Tensor, documents: torch.Tensor | None, segments: torch.Tensor | None,
                 host: tuple | None = None):
        self.device = padding.device
        self.layout = (padding, documents, segments) if host is None else host
        self.cache: dict = {}
        self.free = host is not None or padding.device.type == "cpu"
        """Whether reading the layout waits for no device (a host copy, or a CPU batch)."""

    def any_padding(self, free_only: bool = False) -> bool | None:
        """Whether any key of the batch is padding; None if `free_only` and the answer needs a device read."""
        if free_only and not self.free:
            return None
        if "any_padding" not in self.cache:
            self.cache["any_padding"] = bool(self.layout[0].any())
        return self.cache["any_padding"]

    def sequences(self, within_documents: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """`sequences` of the `attention_groups` (documents left out unless `within_documents`) on the
        device, and the longest sequence's length."""
        if within_documents not in self.cache:
            padding, documents, segments = self.layout
            found = sequences(attention_groups(padding, documents if within_documents else None, segments))
            self.cache[within_documents] = (*(host_to_device(t, self.device) for t in found), int(found[2].max()))
        return self.cache[within_documents]


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
