"""The encoder and its parts: position encodings, attention backends, layers, heads; model folders.

Import from the modules (megamlm.model.encoder, ...): this package file imports nothing, so that
low modules (tp.py, init.py) can import their siblings without a cycle through it."""
