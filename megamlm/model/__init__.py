"""The encoder, its positional encodings, attention and heads."""

from megamlm.model.encoder import MaskedLM, perplexity
from megamlm.model.folder import from_pretrained, load_pretrained
from megamlm.model.positions import alibi_bias, alibi_slopes

__all__ = ["MaskedLM", "alibi_bias", "alibi_slopes", "from_pretrained", "load_pretrained", "perplexity"]
