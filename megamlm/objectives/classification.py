"""Sentence-classification heads for fine-tuning, chosen by name (model.classifier), and the pooling
of each sequence's features they read (model.classifier_pooling).

    pooler      features -> dense -> tanh -> out_proj                   fairseq's RobertaClassificationHead,
                                                                        BERT's / ALBERT's pooler + classifier
    dense_gelu  features -> dense -> GELU -> out_proj                   transformers' ElectraForSequence-
                                                                        Classification
    dense_relu  features -> dense -> ReLU -> out_proj                   transformers' DistilBertForSequence-
                                                                        Classification
    mlm_head    features -> dense -> activation -> norm -> out_proj     transformers' ModernBertForSequence-
                                                                        Classification (head + classifier)
    linear      features -> out_proj                                    ELECTRA's fine-tuning (google-research/
                                                                        electra: `[CLS]` features, one dense layer)

ModernBertForSequenceClassification's `head` is the same module, under the same name, as
ModernBertForMaskedLM's, so fine-tuning a masked-LM checkpoint starts it from the pretrained MLM
head's dense layer and norm; `mlm_head` does the same from a model folder. Likewise BERT's and ALBERT's
sequence classifiers start from the checkpoint's pooler, and `pooler` from the folder's (a sentence-pair
model's, or the one conversion keeps as a classification head). The new weights are drawn by
model.init's scheme (model/init.py), from a generator seeded by the fine-tuning seed, identical on
every data-parallel rank. A folder that holds a head named for the task (`megamlm glue --save`) starts
the whole head from it instead.

Pooling reads the encoder's output [s, b, h] at indices made on the host (`Pooling`), the same code for
one sequence per row and for packed rows: `cls` the first token of each sequence, `mean` the average
over its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megamlm.config import ModelConfig
from megamlm.data.pairs import PAIR_KINDS
from megamlm.errors import MegamlmError
from megamlm.model import names
from megamlm.model.activation import activation_function
from megamlm.model.init import init_head_linear
from megamlm.model.norm import norm
from megamlm.parallel import host_to_device


@dataclass
class Pooling:
    """Where n sequences lie in a [b, s] batch, as flat positions (row-major: b * s + position)."""

    first: torch.Tensor
    """[n] the flat position of each sequence's first token."""
    members: torch.Tensor | None = None
    """[n, b * s] bool: the positions of each sequence; mean pooling only. Pooling sums through a
    matmul with it: deterministic on a GPU, where index_add_'s atomics are not."""
    length: torch.Tensor | None = None
    """[n, 1] each sequence's tokens; mean pooling only."""

    @classmethod
    def of(cls, starts: torch.Tensor, lengths: list[int], positions: int, kind: str) -> Pooling:
        """Sequences of `lengths` tokens starting at flat positions `starts` in a batch of `positions`."""
        if kind == "cls":
            return cls(starts)
        count = torch.tensor(lengths)
        # [1, b * s] flat positions vs [n, 1] spans -> [n, b * s]
        index = torch.arange(positions)[None, :]
        members = (index >= starts[:, None]) & (index < starts[:, None] + count[:, None])
        return cls(starts, members, count.unsqueeze(1))

    def to(self, device: torch.device) -> Pooling:
        parts = (self.first, self.members, self.length)
        return Pooling(*(None if t is None else host_to_device(t, device) for t in parts))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [s, b, h] -> features [n, h]."""
        width = hidden.size(0)
        if self.members is None:
            return hidden[self.first % width, self.first // width]  # [n, h]
        flat = hidden.transpose(0, 1).reshape(-1, hidden.size(-1))  # [s, b, h] -> [b * s, h]
        sums = self.members.to(flat.dtype) @ flat  # [n, b * s] x [b * s, h] -> [n, h]
        return sums / self.length.to(sums.dtype)


@torch.no_grad()
def _take(module: nn.Module, sources: dict[str, list[str]], pretrained: dict[str, torch.Tensor]) -> list[str]:
    """Copy into each parameter of `module` the first of its `sources` ({kind}: weight | bias) that
    `pretrained` holds; returns the names taken."""
    taken = []
    for name, param in module.named_parameters():
        ours, kind = name.rsplit(".", 1)
        found = [key.format(kind=kind) for key in sources.get(f"{ours}.{{kind}}", ())
                 if key.format(kind=kind) in pretrained]
        if found:
            param.copy_(pretrained[found[0]])
            taken.append(found[0])
    return taken


class ClassificationHead(nn.Module):
    """What every head shares: dropout on the classification layer's input (fine-tuning's
    classifier_dropout: BERT's and ModernBERT's classifier, ELECTRA's dense layer, fairseq's out_proj),
    and the initialization of a head with a `dense` layer and an `out_proj`."""

    PRETRAINED: dict[str, list[str]] = {}
    """This head's parameter -> the folder tensors it starts from, the first found."""

    def __init__(self, dropout: float):
        super().__init__()
        # Identity at 0: no random draws, so runs without it are what they were
        self.drop = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    @torch.no_grad()
    def restore(self, name: str, pretrained: dict[str, torch.Tensor]) -> list[str]:
        """Load the folder's classification head `name` (a fine-tuned model `megamlm glue --save` wrote),
        every parameter; returns the names taken (none: the folder has no such head)."""
        prefix = f"{names.CLASSIFICATION_HEADS}{name}."
        saved = {key[len(prefix):]: tensor for key, tensor in pretrained.items() if key.startswith(prefix)}
        if not saved:
            return []
        ours = dict(self.named_parameters())
        unfit = sorted(set(saved) ^ set(ours) | {key for key in saved.keys() & ours.keys()
                                                 if saved[key].shape != ours[key].shape})
        if unfit:
            raise MegamlmError(f"the folder's classification head {name!r} does not fit this {type(self).__name__} "
                               f"(model.classifier) with {self.out_proj.out_features} output(s): {', '.join(unfit)}")
        for key, param in ours.items():
            param.copy_(saved[key])
        return [prefix + key for key in ours]

    def initialize(self, model: ModelConfig, generator: torch.Generator, pretrained: dict) -> list[str]:
        """Draw dense as the MLM head's dense layer and out_proj as a classification layer (model.init's
        scheme), then take the folder's tensors `PRETRAINED` names; returns the names taken."""
        init_head_linear(self.dense, model, names.LM_HEAD_DENSE.format(kind="weight"), generator)
        init_head_linear(self.out_proj, model, None, generator)
        return _take(self, self.PRETRAINED, pretrained)


class DenseHead(ClassificationHead):
    """features -> dense -> ACTIVATION -> out_proj at the hidden width, with dropout on out_proj's input
    (and on dense's, DROP_FEATURES); parameter names match fairseq's `classification_heads.<name>.*`."""

    ACTIVATION = staticmethod(torch.tanh)
    DROP_FEATURES = False

    def __init__(self, model: ModelConfig, num_classes: int, dropout: float = 0.0):
        super().__init__(dropout)
        self.dense = nn.Linear(model.hidden_size, model.hidden_size)
        self.out_proj = nn.Linear(model.hidden_size, num_classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if self.DROP_FEATURES:
            features = self.drop(features)
        return self.out_proj(self.drop(self.ACTIVATION(self.dense(features))))


class PoolerHead(DenseHead):
    """fairseq's RobertaClassificationHead (= BERT's pooler + classifier), tanh. Its dense layer starts
    from the folder's pretrained pooler when it has one, as BertForSequenceClassification and
    AlbertForSequenceClassification start from the checkpoint's: a sentence-pair model's
    (`pair_head.pooler`), or one kept by conversion as the classification head of its objective
    (`classification_heads.nsp.dense`, `...sop.dense`)."""

    PRETRAINED = {"dense.{kind}": ["pair_head.pooler.{kind}",
                                   *(f"{names.CLASSIFICATION_HEADS}{kind}.dense.{{kind}}" for kind in PAIR_KINDS)]}


class DenseGeluHead(DenseHead):
    """transformers' ElectraClassificationHead (ElectraForSequenceClassification): exact GELU, whatever
    model.activation is, and dropout on both layers' inputs."""

    ACTIVATION = staticmethod(F.gelu)
    DROP_FEATURES = True


class DenseReluHead(DenseHead):
    """DistilBertForSequenceClassification's pre_classifier -> ReLU -> classifier."""

    ACTIVATION = staticmethod(F.relu)


class MLMHeadClassifier(ClassificationHead):
    """The MLM head's transform (dense -> model.activation -> norm, RobertaLMHead's names) and a linear
    classifier over the embedding width (ModernBERT: the hidden width)."""

    PRETRAINED = {"dense.{kind}": [names.LM_HEAD_DENSE], "layernorm.{kind}": [names.LM_HEAD_NORM]}
    """The MLM head's transform; a CLAP-head or ELECTRA folder has none, and the transform stays drawn."""

    def __init__(self, model: ModelConfig, num_classes: int, dropout: float = 0.0):
        super().__init__(dropout)
        self.dense = nn.Linear(model.hidden_size, model.embedding_dim, bias=model.bias)
        self.activation = activation_function(model)
        self.layernorm = norm(model, model.embedding_dim)
        self.out_proj = nn.Linear(model.embedding_dim, num_classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.drop(self.layernorm(self.activation(self.dense(features)))))


class LinearHead(ClassificationHead):
    """One linear layer on the features: ELECTRA's classifier (its finetune/classification code reads
    `sequence_output[:, 0]` and applies `tf.layers.dense`; transformers' ElectraForSequenceClassification
    adds a dense + GELU layer the paper's code does not have)."""

    def __init__(self, model: ModelConfig, num_classes: int, dropout: float = 0.0):
        super().__init__(dropout)
        self.out_proj = nn.Linear(model.hidden_size, num_classes)

    @torch.no_grad()
    def initialize(self, model: ModelConfig, generator: torch.Generator, pretrained: dict) -> list[str]:
        """Glorot-uniform weights and zero bias: tf.layers.dense's defaults, as ELECTRA's code leaves them."""
        nn.init.xavier_uniform_(self.out_proj.weight, generator=generator)
        self.out_proj.bias.zero_()
        return []

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.drop(features))


CLASSIFIER_HEADS: dict[str, type[ClassificationHead]] = {"pooler": PoolerHead, "dense_gelu": DenseGeluHead,
                                                          "dense_relu": DenseReluHead, "mlm_head": MLMHeadClassifier,
                                                          "linear": LinearHead}
"""model.classifier -> its head (the names of ModelConfig.classifier)."""
