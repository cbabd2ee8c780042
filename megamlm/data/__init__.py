"""Data: tokenizer, webdataset shards, per-rank streaming, dynamic masking."""
