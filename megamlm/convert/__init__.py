"""Checkpoint conversion: Hugging Face and fairseq key tables, TP resharding."""
