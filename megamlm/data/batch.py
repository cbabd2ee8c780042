"""The typed micro-batch every objective trains and validates on, and how samples become one.

A batch is b rows of width s; positions are named in row-major (b, s) order. Padded layout: one
sample per row, right-padded. Packed layout (data.packing=packed): one row holding several samples
end to end (`segments` says which), padded only at the end of the token budget.
`inputs` is what the encoder reads (the corrupted text); `original` is the text before corruption;
the objective's prediction targets are the positions `target_index` (flat b_i * s + s_i, what the
model selects by: a [b, s] bool mask would make the device count it, a host sync mid-forward) whose
original ids are `targets`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from megamlm.data.tokenizer import EOS
from megamlm.parallel import host_to_device

Corruption = Callable[[np.ndarray, int, int], tuple[np.ndarray, np.ndarray]]
"""(sample ids [n], epoch, sample index) -> (corrupted ids [n], targeted [n] bool), seeded by its
arguments (data/masking.py's Masker is one)."""


@dataclass
class Batch:
    inputs: torch.Tensor
    """[b, s] ids the encoder reads: the corrupted samples, pad_id on padding."""
    original: torch.Tensor
    """[b, s] the samples before corruption, pad_id on padding."""
    target_index: torch.Tensor
    """[n] flat (b, s) indices of the prediction targets, ascending."""
    targets: torch.Tensor
    """[n] original ids at target_index."""
    documents: torch.Tensor
    """[b, s] document index of each position within its row (the </s> before it counted, numbered
    on across the samples of a packed row), -1 on padding."""
    sample_ids: torch.Tensor
    """[b] index of each sample in its epoch's order (what seeds its corruption); host metadata,
    stays on the CPU in `to`."""
    epoch: int = 0
    """Epoch of the samples."""
    batch: int = 0
    """Index of this micro-batch in its rank's epoch (the stream's resume position)."""
    corrupt: int = 0
    """Samples that could not be read and were replaced by others of the batch (packed: left out)."""
    segments: torch.Tensor | None = None
    """Packed layout: [b, s] index of the sample each position belongs to within its row, -1 on
    padding (positions restart and attention stays within a sample); None: one sample per row."""
    pair_labels: torch.Tensor | None = None
    """Sentence-pair objectives (data/pairs.py): [number of samples] the label of each sample's pair,
    in sample order (its `<s>` is the first position of its row or packed segment); None otherwise."""
    host_layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
    """(inputs, documents, segments) as collated, on the CPU whatever the device the batch moves to: the
    model reads the layout's sizes (padding at all, sequence lengths, sample starts) from them, so a step
    never waits for the device to read its own batch (None: read from the device)."""
    real: int | None = None
    """Non-padding positions, counted on the host when the batch moves to a device (`to`), so that
    `real_tokens` never waits for the device; None: counted from `documents` when asked."""

    HOST_FIELDS: ClassVar[tuple[str, ...]] = ("sample_ids",)
    """Tensors the host reads and the model does not (seeds): `to` leaves them on the CPU."""

    @property
    def sample_starts(self) -> torch.Tensor:
        """[number of samples] flat (b, s) index of each sample's first position (`<s>`)."""
        width = self.inputs.size(1)
        if self.segments is None:
            return torch.arange(self.inputs.size(0), device=self.inputs.device) * width
        segments = self.segments if self.host_layout is None else self.host_layout[2]
        previous = torch.nn.functional.pad(segments, (1, 0), value=-1)[:, :-1]
        starts = ((segments >= 0) & segments.ne(previous)).flatten().nonzero().squeeze(1)
        return host_to_device(starts, self.inputs.device)

    @property
    def target_mask(self) -> torch.Tensor:
        """[b, s] bool: True at the prediction targets."""
        mask = torch.zeros(self.inputs.numel(), dtype=torch.bool, device=self.inputs.device)
        return mask.index_fill(0, self.target_index, True).view_as(self.inputs)

    def real_tokens(self) -> int:
        """Non-padding positions (what throughput counts)."""
        return self.real if self.real is not None else int((self.documents >= 0).sum())

    def to(self, device: torch.device) -> Batch:
        """The tensors on `device`, copied without waiting (`host_to_device`); the scalars and the
        host metadata (HOST_FIELDS, `real`) stay: an objective reading them (seeds, counts) does not
        make the host wait for the device in the middle of a step."""
        return self._converted(lambda tensor: host_to_device(tensor, device))

    def pin_memory(self) -> Batch:
        """The tensors `to` moves, in pinned host memory (torch's DataLoader calls this in its pinning thread
        with pin_memory=True: `loader.make_loader`); `to` then copies them to a GPU as they are."""
        return self._converted(torch.Tensor.pin_memory)

    def _converted(self, convert: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        """The batch with `convert` applied to its tensors but the host's (HOST_FIELDS, `host_layout`), and
        `real` counted on the host."""
        converted = {f.name: convert(getattr(self, f.name)) for f in dataclasses.fields(self)
                     if isinstance(getattr(self, f.name), torch.Tensor) and f.name not in self.HOST_FIELDS}
        return dataclasses.replace(self, real=self.real_tokens(), **converted)

    def fill(self) -> float:
        """Real tokens / token slots."""
        return self.real_tokens() / self.inputs.numel()


def collate(samples: list[tuple[np.ndarray, int]], corruption: Corruption, epoch: int, width: int,
            pad_id: int, packed: bool = False, pair_labels: list[int] | None = None, **fields) -> Batch:
    """[(sample ids, sample index)] -> a Batch of `width` columns: one row per sample, or with
    `packed` one row of all of them end to end. `pair_labels`: of sentence-pair samples, in order.
    `fields`: epoch-position fields (batch, corrupt)."""
    rows = [samples] if packed else [[sample] for sample in samples]
    original = np.full((len(rows), width), pad_id, dtype=np.int64)
    inputs = original.copy()
    targeted = np.zeros(original.shape, dtype=bool)
    documents = np.full(original.shape, -1, dtype=np.int64)
    segments = documents.copy()
    for row, members in enumerate(rows):
        start = first_document = 0
        for segment, (sample, index) in enumerate(members):
            corrupted, mask = corruption(sample, epoch, index)
            span = slice(start, start + len(sample))
            original[row, span], inputs[row, span], targeted[row, span] = sample, corrupted, mask
            # document index of each position: the </s> before it counted (from the uncorrupted text)
            docs = np.concatenate([[0], np.cumsum(sample[:-1] == EOS)]) + first_document
            documents[row, span], segments[row, span] = docs, segment
            start, first_document = span.stop, int(docs[-1]) + 1
    layout = torch.from_numpy(inputs), torch.from_numpy(documents), torch.from_numpy(segments) if packed else None
    return Batch(inputs=layout[0], original=torch.from_numpy(original),
                 target_index=torch.from_numpy(np.flatnonzero(targeted)),
                 targets=torch.from_numpy(original[targeted]), documents=layout[1],
                 sample_ids=torch.tensor([index for _, index in samples]), epoch=epoch, segments=layout[2],
                 host_layout=layout,
                 pair_labels=None if pair_labels is None else torch.tensor(pair_labels), **fields)
