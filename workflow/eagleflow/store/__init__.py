"""Stored tensors: dtypes, safetensors headers and streaming writes, chunks, integrity,
verification."""
