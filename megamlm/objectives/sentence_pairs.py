"""Sentence-pair objectives: BERT's next-sentence prediction (objective.name=nsp, Devlin et al. 2019) and
ALBERT's sentence-order prediction (objective.name=sop, Lan et al. 2020), each masked language modeling
plus a binary classification of every sample's pair (data/pairs.py makes the pairs):

    loss = MLM cross-entropy (mean over masked tokens) + pair cross-entropy (mean over samples)

The classifier reads the `<s>` ([CLS]) position through BERT's pooler (dense + tanh) and a 2-way linear
layer (BertForPreTraining's `seq_relationship`, ALBERT's `sop_classifier`). Both terms are logged
(`mlm_loss`, `nsp_loss` / `sop_loss`) with the pair accuracy. Off by default: RoBERTa found NSP
unnecessary; reproducing BERT or ALBERT needs it. Batches without pairs (`megamlm eval`) give the MLM
term alone.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from megamlm.data.batch import Batch
from megamlm.data.pairs import Pairing
from megamlm.objectives.base import LossOutput, register_objective
from megamlm.objectives.mlm import MaskedLanguageModeling, MaskedLM, perplexity, select
from megamlm.parallel import ParallelContext


class PairHead(nn.Module):
    """BERT's pooler and a 2-way classifier: [n, h] features at `<s>` -> [n, 2] logits. The same function
    as a fairseq classification head (dense -> tanh -> out_proj): conversion keeps it as one named by the
    objective (`as_classification_head`), and fine-tuning's pooler starts from its `pooler`."""

    AS_CLASSIFICATION_HEAD = {"pooler": "dense", "classifier": "out_proj"}

    def __init__(self, hidden_size: int):
        super().__init__()
        self.pooler = nn.Linear(hidden_size, hidden_size)
        self.classifier = nn.Linear(hidden_size, 2)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler(features)))


class PairedMaskedLM(MaskedLM):
    """MaskedLM plus the pair head (replicated on TP ranks: its input is)."""

    def __init__(self, model, ctx: ParallelContext, seed: int = 1, params_dtype: torch.dtype = torch.float32):
        super().__init__(model, ctx, seed, params_dtype, initialize=False)
        self.pair_head = PairHead(model.hidden_size)
        self.initialize(seed, params_dtype)

    def forward(self, tokens, masked_positions=None, documents=None, segments=None, targets=None,
                host_layout=None, pair_index: torch.Tensor | None = None):
        """MaskedLM's forward; with `pair_index` [p] (flat (b, s) positions of each sample's `<s>`) and
        `targets`: (Σ MLM cross-entropy [1], pair logits [p, 2]) from one pass of the encoder."""
        if pair_index is None:
            return super().forward(tokens, masked_positions, documents, segments, targets, host_layout)
        hidden = self.hidden_states(tokens, documents, segments, host_layout=host_layout)  # [s, b, h]
        return self.loss_sum(select(hidden, masked_positions), targets), self.pair_head(select(hidden, pair_index))


class SentencePairObjective(MaskedLanguageModeling):
    """MLM + the classification of each sample's pair (`kind`: nsp | sop)."""

    kind: ClassVar[str]
    masked_lm_inside = True

    def build_model(self, ctx: ParallelContext, params_dtype: torch.dtype = torch.float32) -> PairedMaskedLM:
        return PairedMaskedLM(self.cfg.model, ctx, seed=self.cfg.train.seed, params_dtype=params_dtype)

    def fresh_head(self, name: str) -> bool:
        """The pair head: continued pretraining from an MLM folder (e.g. an imported BERT) adds it."""
        return name.startswith("pair_head.")

    def heads_from_folder(self, heads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The pair head kept as the folder's classification head `kind` (an imported BERT / ALBERT
        pretraining checkpoint, a converted NSP / SOP model): continued pretraining starts from it."""
        return {f"pair_head.{ours}.{k}": heads[f"{self.kind}.{fairseq}.{k}"]
                for ours, fairseq in PairHead.AS_CLASSIFICATION_HEAD.items() for k in ("weight", "bias")
                if f"{self.kind}.{fairseq}.{k}" in heads}

    def pairing(self, seed: int) -> Pairing:
        return Pairing(self.kind, seed)

    def count(self, batch: Batch) -> list[int]:
        """Masked tokens (MLM) and pairs (samples; none in batches made without pairing)."""
        return [int(batch.target_index.numel()), 0 if batch.pair_labels is None else len(batch.pair_labels)]

    def loss(self, model, batch: Batch) -> LossOutput:
        if batch.pair_labels is None:
            mlm = super().loss(model, batch)
            zero = mlm.loss_sum.new_zeros(1)
            return LossOutput(torch.cat([mlm.loss_sum.reshape(1), zero]), self.count(batch),
                              {f"{self.kind}_correct": zero.reshape(())})
        mlm_sum, logits = model(batch.inputs, batch.target_index, batch.documents, batch.segments,
                                targets=batch.targets, host_layout=batch.host_layout, pair_index=batch.sample_starts)
        logits = logits.float()
        pair_sum = F.cross_entropy(logits, batch.pair_labels, reduction="sum")
        correct = (logits.argmax(-1) == batch.pair_labels).sum().detach()
        return LossOutput(torch.cat([mlm_sum.reshape(1).float(), pair_sum.reshape(1)]), self.count(batch),
                          {f"{self.kind}_correct": correct})

    def finish_metrics(self, sums: dict[str, torch.Tensor], counts: list[float]) -> dict[str, float]:
        pairs = counts[1]
        return {f"{self.kind}_accuracy": float(sums[f"{self.kind}_correct"]) / pairs if pairs else float("nan")}

    def summary(self, terms: dict[str, float]) -> dict[str, float]:
        return {"ppl": perplexity(terms["mlm"])}

    def parameter_count(self) -> int:
        h = self.cfg.model.hidden_size
        return super().parameter_count() + (h * h + h) + (2 * h + 2)

    def flops_per_token(self, seq_length: int) -> float:
        """MLM's, plus the pair head once per sample (a negligible 6·(h² + 2h) / seq_length per token)."""
        h = self.cfg.model.hidden_size
        return super().flops_per_token(seq_length) + 6 * (h * h + 2 * h) / seq_length


@register_objective
class NextSentencePrediction(SentencePairObjective):
    """objective.name=nsp: BERT's MLM + next-sentence prediction (B follows A, or is another sample's)."""

    name = "nsp"
    kind = "nsp"
    loss_terms = ("mlm", "nsp")


@register_objective
class SentenceOrderPrediction(SentencePairObjective):
    """objective.name=sop: ALBERT's MLM + sentence-order prediction (A, B in order or swapped)."""

    name = "sop"
    kind = "sop"
    loss_terms = ("mlm", "sop")


def as_classification_head(full: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """A sentence-pair model's head as the classification head `kind` ({kind}.dense.weight, ...): what a
    folder's classification_heads.pt holds (empty if `full` has no pair head)."""
    return {f"{kind}.{fairseq}.{k}": full[f"pair_head.{ours}.{k}"]
            for ours, fairseq in PairHead.AS_CLASSIFICATION_HEAD.items() for k in ("weight", "bias")
            if f"pair_head.{ours}.{k}" in full}
