"""model.activation as a function, for every layer that applies it (the FFN, the MLM head)."""

from __future__ import annotations

import functools

import torch.nn.functional as F

from megamlm.config import ModelConfig


def activation_function(model: ModelConfig):
    """Exact erf GELU (fairseq, BERT, ModernBERT), its tanh approximation (ALBERT's gelu_new) or SiLU."""
    functions = {"gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "silu": F.silu}
    return functions[model.activation]
