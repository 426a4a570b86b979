"""The chunks of one shard: consecutive sample ranges committed one file each.

Work inside a shard is committed in chunks (`.partial/<shard>/chunk-NNNNN.safetensors`, each
written to a temporary name and renamed), so a killed job resumes after its last committed
chunk. A chunk file holds `hidden_states` [tokens, n_layers, hidden] and `input_ids` [tokens],
and its metadata names the fingerprint, shard and sample range it belongs to.

With pipeline parallelism each stage that owns layer ids writes its own file per chunk,
`chunk-NNNNN.stage-S.safetensors`, holding its ids only (metadata `layer_ids`); a chunk is
committed when every such file is. Assembly concatenates a chunk's stage files in stage order,
which is layer-id order (stages own consecutive layers), so a shard is the same whatever the
parallelism. With one capturing stage the file is `chunk-NNNNN.safetensors`, as without PP.
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


def chunk_path(partial_dir: Path, i: int, stage: int | None = None) -> Path:
    name = f"chunk-{i:05d}" + ("" if stage is None else f".stage-{stage}")
    return Path(partial_dir) / f"{name}.safetensors"


@dataclass(frozen=True)
class ShardChunks:
    """Where and how one shard's chunks are committed for one extraction fingerprint."""

    shard: TokenShard
    fingerprint: str
    partial_dir: Path
    ranges: list[tuple[int, int]]
    # Pipeline ranks that write files of their own, when more than one stage captures ids.
    stages: tuple[int, ...] = ()

    @classmethod
    def plan(
        cls,
        shard: TokenShard,
        fingerprint: str,
        out_path: Path,
        chunk_tokens: int,
        stages: tuple[int, ...] = (),
    ):
        """The chunks of `shard` whose finished file will be `out_path`; `stages`: the pipeline
        ranks that capture ids (one file each per chunk when there are several)."""
        partial_dir = Path(out_path).parent / ".partial" / shard.shard_id
        stages = tuple(stages) if len(stages) > 1 else ()
        ranges = chunk_ranges(shard.offsets, chunk_tokens)
        return cls(shard, fingerprint, partial_dir, ranges, stages)

    def path(self, i: int, stage: int | None = None) -> Path:
        """Chunk `i`'s file; with several capturing stages, stage `stage`'s file."""
        return chunk_path(self.partial_dir, i, stage if self.stages else None)

    def paths(self, i: int) -> list[Path]:
        """Every file of chunk `i`, in stage (= layer-id) order."""
        return [self.path(i, s) for s in self.stages] if self.stages else [self.path(i)]

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
        """Cheap check of a committed chunk: every file's header readable, size complete,
        identity matches."""
        return all(self._committed_file(path, i) for path in self.paths(i))

    def _committed_file(self, path: Path, i: int) -> bool:
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
