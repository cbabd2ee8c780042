"""model.attention_backend -> its backend class (attention.py describes each; the names are
ModelConfig.attention_backend's). A module of its own so that a backend may live in its own file."""

from __future__ import annotations

from megamlm.model.attention import (AlibiFlashAttention, AttentionBackend, EagerAttention, FlexAttention,
                                     VarlenAttention)
from megamlm.model.triton_attention import TritonAttention

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    cls.name: cls for cls in (AttentionBackend, EagerAttention, FlexAttention, VarlenAttention, AlibiFlashAttention,
                              TritonAttention)}
"""model.attention_backend -> backend class."""
