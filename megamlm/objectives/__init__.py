"""Pretraining objectives by name (base.py: the interface and registry; one module per objective)."""

from megamlm.objectives.base import (OBJECTIVES, LossOutput, LossTotals, Objective, ReducedTotals, get_objective,
                                     objective_class, register_objective)
from megamlm.objectives.mlm import MaskedLM, perplexity  # importing it registers "mlm"
from megamlm.objectives import electra, sentence_pairs  # noqa: F401  (register "electra", "nsp", "sop")
from megamlm.objectives.pretrained import encoder_from, from_pretrained, load_encoder, load_pretrained

__all__ = ["OBJECTIVES", "LossOutput", "LossTotals", "ReducedTotals", "MaskedLM", "Objective", "encoder_from",
           "from_pretrained", "get_objective", "load_encoder", "load_pretrained", "objective_class", "perplexity",
           "register_objective"]
