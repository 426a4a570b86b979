"""The chunks of one shard: consecutive sample ranges, each committed by a marker.

Work inside a shard is committed in chunks, so a killed job resumes after its last committed
chunk. A chunk's rows are written into the shard file in place (`eagleflow.store.shardfile`,
`.partial/<shard>/shard.safetensors`) and flushed; only then is its marker
`.partial/<shard>/chunk-NNNNN.json` written (temporary name, then rename). The marker names the
fingerprint, shard and sample range it belongs to; a chunk without one is prefilled again.

With pipeline parallelism each stage that owns layer ids writes its own columns of the rows
and its own marker, `chunk-NNNNN.stage-S.json`; a chunk is committed when every such marker
is. The file's layout does not depend on the parallelism.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eagleflow.data.shards import TokenShard

SHARD_FILE = "shard.safetensors"  # the shard's file while written, in .partial/<shard>/


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
    """Chunk `i`'s commit marker (of pipeline stage `stage`)."""
    name = f"chunk-{i:05d}" + ("" if stage is None else f".stage-{stage}")
    return Path(partial_dir) / f"{name}.json"


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

    @property
    def shard_file(self) -> Path:
        """The shard's file while its chunks are written (eagleflow.store.shardfile)."""
        return self.partial_dir / SHARD_FILE

    def path(self, i: int, stage: int | None = None) -> Path:
        """Chunk `i`'s marker; with several capturing stages, stage `stage`'s marker."""
        return chunk_path(self.partial_dir, i, stage if self.stages else None)

    def paths(self, i: int) -> list[Path]:
        """Every marker of chunk `i`, in stage (= layer-id) order."""
        return [self.path(i, s) for s in self.stages] if self.stages else [self.path(i)]

    def token_range(self, i: int) -> tuple[int, int]:
        a, b = self.ranges[i]
        return int(self.shard.offsets[a]), int(self.shard.offsets[b])

    def n_tokens(self, i: int) -> int:
        lo, hi = self.token_range(i)
        return hi - lo

    def metadata(self, i: int) -> dict:
        """What a chunk's marker records of its identity (checked before it is trusted)."""
        return {
            "fingerprint": self.fingerprint,
            "shard_id": self.shard.shard_id,
            "chunk": i,
            "samples": list(self.ranges[i]),
            "tokens": list(self.token_range(i)),
        }

    def committed(self, i: int) -> bool:
        """Chunk `i`'s rows are in the shard file: every marker there, naming this chunk."""
        want = self.metadata(i)
        for path in self.paths(i):
            try:
                found = json.loads(path.read_text())
            except (OSError, ValueError):
                return False
            if {k: found.get(k) for k in want} != want:
                return False
        return True

    def todo(self) -> list[int]:
        if not self.shard_file.is_file():
            return list(range(len(self.ranges)))
        return [i for i in range(len(self.ranges)) if not self.committed(i)]

    def drop_markers(self) -> None:
        """Forget every committed chunk (the shard file is about to be created anew)."""
        for path in self.partial_dir.glob("chunk-*.json"):
            path.unlink()


def commit_marker(path: str | Path, record: dict) -> None:
    """Write a chunk's marker atomically, after its rows are on disk."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(record))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
