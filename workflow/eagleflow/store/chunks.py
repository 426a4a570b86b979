"""The chunks of one shard: consecutive sample ranges committed one file each.

Work inside a shard is committed in chunks (`.partial/<shard>/chunk-NNNNN.safetensors`, each
written to a temporary name and renamed), so a killed job resumes after its last committed
chunk. A chunk file holds `hidden_states` [tokens, n_layers, hidden] and `input_ids` [tokens],
and its metadata names the fingerprint, shard and sample range it belongs to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eagleflow.data.shards import TokenShard
from eagleflow.store.headers import read_header


def chunk_ranges(offsets: np.ndarray, chunk_tokens: int) -> list[tuple[int, int]]:
    """Consecutive sample ranges of about `chunk_tokens` tokens (at least one sample each);
    a pure function of the shard, so a resumed job finds the same chunks."""
    ranges, start = [], 0
    n = len(offsets) - 1
    while start < n:
        end = start + 1
        while end < n and offsets[end + 1] - offsets[start] <= chunk_tokens:
            end += 1
        ranges.append((start, end))
        start = end
    return ranges


def chunk_path(partial_dir: Path, i: int) -> Path:
    return Path(partial_dir) / f"chunk-{i:05d}.safetensors"


@dataclass(frozen=True)
class ShardChunks:
    """Where and how one shard's chunks are committed for one extraction fingerprint."""

    shard: TokenShard
    fingerprint: str
    partial_dir: Path
    ranges: list[tuple[int, int]]

    @classmethod
    def plan(cls, shard: TokenShard, fingerprint: str, out_path: Path, chunk_tokens: int):
        """The chunks of `shard` whose finished file will be `out_path`."""
        partial_dir = Path(out_path).parent / ".partial" / shard.shard_id
        return cls(shard, fingerprint, partial_dir, chunk_ranges(shard.offsets, chunk_tokens))

    def path(self, i: int) -> Path:
        return chunk_path(self.partial_dir, i)

    def token_range(self, i: int) -> tuple[int, int]:
        a, b = self.ranges[i]
        return int(self.shard.offsets[a]), int(self.shard.offsets[b])

    def n_tokens(self, i: int) -> int:
        lo, hi = self.token_range(i)
        return hi - lo

    def metadata(self, i: int) -> dict:
        """What a chunk file records of its identity (checked before it is reused)."""
        return {
            "fingerprint": self.fingerprint,
            "shard_id": self.shard.shard_id,
            "chunk": i,
            "samples": list(self.ranges[i]),
        }

    def committed(self, i: int) -> bool:
        """Cheap check of a committed chunk: header readable, size complete, identity matches."""
        path = self.path(i)
        try:
            header, data_start = read_header(path)
            meta = header.get("__metadata__", {})
            end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
            return (
                path.stat().st_size == data_start + end
                and json.loads(meta.get("fingerprint", "null")) == self.fingerprint
                and json.loads(meta.get("shard_id", "null")) == self.shard.shard_id
                and json.loads(meta.get("samples", "null")) == list(self.ranges[i])
                and header["input_ids"]["shape"] == [self.n_tokens(i)]
            )
        except (OSError, ValueError, KeyError):
            return False

    def todo(self) -> list[int]:
        return [i for i in range(len(self.ranges)) if not self.committed(i)]
