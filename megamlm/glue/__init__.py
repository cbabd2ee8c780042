"""GLUE fine-tuning and evaluation."""
