"""The states cache of `draft.states: cached` (docs/streaming.md): the samples the capture
server streamed, kept on disk up to a byte budget so that later epochs read them instead of
prefilling them again.

One file per token shard, `<cache dir>/<shard>.safetensors`, in the extracted shard's own
layout (`eagleflow.store.shardfile`: same header, same rows, sparse until written), so a
cached sample is read exactly as a stored one. Only the engine server writes (one request at
a time): the rows of a sample are written and flushed, then the sample is listed in
`<shard>.cached.json` (an unpredictable temporary name, fsync, rename, fsync of the folder),
so a reader never takes a hole for states. An index that cannot be read (a crash of a
filesystem without ordered renames) counts as empty, with a warning: its shard's file is
prepared again and the samples are streamed and cached again.
The budget counts the blocks the files really hold (`st_blocks`), and a sample is cached only
when its rows fit in what is left, rounded up to whole pages at both ends.
"""

from __future__ import annotations

import fcntl
import json
import os
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from safetensors import safe_open

from eagleflow.data.shards import TokenShard
from eagleflow.store.direct_io import ALIGN, round_up
from eagleflow.store.locks import fsync_dir
from eagleflow.store.private import write_private
from eagleflow.store.quant import SCALES_KEY
from eagleflow.store.shardfile import plan_shard_file, prepare


class StateCache:
    """The cache directory of one extraction fingerprint (`<hidden>/cache/`)."""

    def __init__(self, directory, budget_bytes: int):
        self.dir, self.budget = Path(directory), int(budget_bytes)

    def file(self, shard_id: str) -> Path:
        return self.dir / f"{shard_id}.safetensors"

    def index_file(self, shard_id: str) -> Path:
        return self.dir / f"{shard_id}.cached.json"

    def cached(self, shard_id: str) -> set[int]:
        """The sample indices of the shard whose rows are in its cache file."""
        path = self.index_file(shard_id)
        try:
            samples = json.loads(path.read_text())["samples"]
            return {int(j) for j in samples}
        except FileNotFoundError:
            return set()
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            warnings.warn(
                f"{path} is unreadable ({type(e).__name__}: {e}); its samples count as not "
                "cached and are cached again",
                stacklevel=2,
            )
            return set()

    def used_bytes(self) -> int:
        """Bytes the cache holds on disk (allocated blocks, not apparent sizes)."""
        if not self.dir.is_dir():
            return 0
        return sum(p.stat().st_blocks * 512 for p in self.dir.iterdir() if p.is_file())

    def read(self, shard: TokenShard, j: int):
        """(states, scales or None, input ids) of sample j, as stored; it must be listed as
        cached. The ids are the cache file's own, for the reader to check against the token
        shard's."""
        a, b = int(shard.offsets[j]), int(shard.offsets[j + 1])
        with safe_open(str(self.file(shard.shard_id)), framework="pt") as f:
            states = f.get_slice("hidden_states")[a:b]
            scales = f.get_slice(SCALES_KEY)[a:b] if SCALES_KEY in f.keys() else None
            ids = f.get_slice("input_ids")[a:b]
        return states, scales, ids

    @contextmanager
    def _lock(self):
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / "lock", os.O_CREAT | os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def add(self, shard: TokenShard, samples, plan, dtype: str) -> int:
        """Cache `samples` = [(j, states [n, L, H] as stored, scales or None)] of `shard` while
        they fit in the budget; returns the bytes of states written. A sample that does not
        fit is left out (it is streamed again next epoch)."""
        written = 0
        with self._lock():
            shard_file, header = plan_shard_file(
                self.file(shard.shard_id), shard, plan, dtype, plan.fingerprint
            )
            index = self.index_file(shard.shard_id)
            have = self.cached(shard.shard_id)
            used = self.used_bytes()
            # No listed sample (a new shard, or an unreadable index): the file starts afresh.
            new_file = not have or not shard_file.path.is_file()
            # A new file holds its header and token tensors at once.
            small = round_up(shard_file.spans["hidden_states"][0]) + sum(
                round_up(e - s) + ALIGN
                for k, (s, e) in shard_file.spans.items()
                if k not in _STATES
            )
            fresh = [(j, s, c) for j, s, c in samples if j not in have]
            for j, states, scales in fresh:
                n = int(shard.offsets[j + 1] - shard.offsets[j])
                need = round_up(n * shard_file.n_layers * shard_file.state_bytes) + 2 * ALIGN
                if scales is not None:
                    need += round_up(n * shard_file.n_layers * 4) + 2 * ALIGN
                if new_file:
                    need += small
                if used + need > self.budget:
                    break
                if new_file:
                    prepare(shard_file, header, shard, lambda: index.unlink(missing_ok=True))
                    new_file = False
                shard_file.write_rows(int(shard.offsets[j]), 0, states, scales)
                have.add(int(j))
                used += need
                written += n * shard_file.n_layers * shard_file.state_bytes
            if fresh and written:
                write_private(index, json.dumps({"samples": sorted(have)}), mode=0o644)
                fsync_dir(self.dir)
        return written

    def complete(self, shard: TokenShard) -> bool:
        return len(self.cached(shard.shard_id)) == len(shard.sample_ids)


_STATES = ("hidden_states", SCALES_KEY)


def sample_index(shard: TokenShard, start_row: int) -> int:
    """The index of the sample that starts at `start_row` of its shard."""
    j = int(np.searchsorted(shard.offsets, start_row))
    if j >= len(shard.offsets) - 1 or shard.offsets[j] != start_row:
        raise ValueError(f"shard {shard.shard_id}: no sample starts at row {start_row}")
    return j
