"""Extraction of shards: preflight checks, fingerprint, per-shard extraction, the capture
engine server, job sizes, progress."""
