"""model.activation as a function, for every layer that applies it (the FFN, the MLM head)."""

from __future__ import annotations

import functools

import torch.nn.functional as F

from megamlm.config import ModelConfig


def activation_function(model: ModelConfig):
    """Exact erf GELU (fairseq, BERT) or its tanh approximation (ALBERT's gelu_new)."""
    return functools.partial(F.gelu, approximate="tanh") if model.activation == "gelu_tanh" else F.gelu
