"""Extraction of shards: preflight checks, fingerprint, per-shard extraction, job sizes,
progress."""
