"""The encoder and its parts: position encodings, attention backends, layers, heads; model folders."""

from megamlm.model.encoder import Encoder
from megamlm.model.positions import alibi_bias, alibi_slopes

__all__ = ["Encoder", "alibi_bias", "alibi_slopes"]
