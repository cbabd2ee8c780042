"""model.activation as a function, for every layer that applies it (the FFN, the MLM head)."""

from __future__ import annotations

import functools

import torch.nn.functional as F

from megamlm.config import ModelConfig

ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "silu": F.silu}
"""model.activation -> the function: exact erf GELU (fairseq, BERT, ModernBERT), its tanh approximation
(ALBERT's gelu_new) or SiLU."""


def activation_function(model: ModelConfig):
    """model.activation's function (ACTIVATIONS)."""
    return ACTIVATIONS[model.activation]
