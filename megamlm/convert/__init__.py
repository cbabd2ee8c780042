"""Checkpoint conversion: Hugging Face and fairseq key tables, TP resharding."""

SOURCES = ("fairseq", "megamlm", "zero", "hf")
"""What `megamlm convert --from` reads (convert/pipeline.py), here without its imports for the CLI's choices."""
TARGETS = ("megamlm", "fairseq", "hf")
"""What `megamlm convert --to` writes."""
