"""The capture server's `states` request (`draft.states: stream | cached`, docs/streaming.md):
prefill some samples of the token shards and answer with their captured states, none of them
written to disk.

The samples (one training pack's) become one small token shard, prefilled by the same
`run_chunks` loop and capture workers as an extract job's shard, into a shard file in a
memory filesystem (`draft.stream_dir`, /dev/shm by default): the states cross from the
workers to this process as they do in extraction, through a file, but that file is memory and
is removed as soon as its bytes are read back. Its folder comes from `tempfile.mkdtemp` (mode
0700, an unpredictable name holding the server's pid); a server that starts removes the
folders of this uid's servers whose pid is gone (a SIGKILL leaves one behind). So streamed
states are captured, quantized and placed exactly as stored ones. In `cached` mode the
samples' rows are also written into the state cache (`eagleflow.store.state_cache`) while
its budget lasts.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from eagleflow.data.shards import TokenShard, read_token_shard
from eagleflow.extract.shard import Timings, prepare_shard_file, run_chunks, shard_chunks
from eagleflow.store.quant import SCALES_KEY
from eagleflow.store.state_cache import StateCache


def pack_shard(shards: list[TokenShard], indices: list[int]) -> TokenShard:
    """One token shard of sample `indices[k]` of `shards[k]`, in this order."""
    ids, masks, lengths, names = [], [], [], []
    for shard, j in zip(shards, indices):
        a, b = shard.sample(j)
        ids.append(a)
        masks.append(b)
        lengths.append(len(a))
        names.append(f"{shard.shard_id}:{j}")
    digest = hashlib.sha256("\n".join(names).encode()).hexdigest()[:20]
    return TokenShard(
        shard_id=f"pack-{digest}",
        sample_ids=names,
        input_ids=np.concatenate(ids).astype(np.int64),
        loss_mask=np.concatenate(masks).astype(np.uint8),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
    )


WIRE_DTYPES = ("float8_e4m3fn", "bfloat16", "float16", "float32", "int64", "int32", "uint8")


def to_wire(t: torch.Tensor) -> dict:
    """A tensor as raw bytes (a frame of `eagleflow.serve.wire`) and its dtype and shape."""
    flat = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    dtype = str(t.dtype).removeprefix("torch.")
    return {"dtype": dtype, "shape": list(t.shape), "bytes": memoryview(flat)}


def from_wire(d: dict | None) -> torch.Tensor | None:
    """The tensor of `to_wire`; ValueError for a dtype, shape or size that is not one."""
    if d is None:
        return None
    if d.get("dtype") not in WIRE_DTYPES:
        raise ValueError(f"a tensor of dtype {d.get('dtype')!r} on the wire")
    dtype = getattr(torch, d["dtype"])
    raw = d["bytes"]
    raw = raw if isinstance(raw, bytearray) else bytearray(raw)
    shape = [int(x) for x in d["shape"]]
    if len(raw) != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise ValueError(f"{len(raw)} bytes on the wire for a {d['dtype']} tensor {shape}")
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)


SCRATCH_PREFIX = "eagleflow-stream-"


def clean_scratch(scratch_dir) -> list[Path]:
    """Remove the scratch folders of this uid's servers in `scratch_dir` whose pid is gone
    (`eagleflow-stream-<key>-<pid>-<random>`); returns them."""
    from eagleflow.serve.client import alive

    gone = []
    try:
        entries = list(os.scandir(scratch_dir))
    except OSError:
        return gone
    for e in entries:
        m = re.fullmatch(re.escape(SCRATCH_PREFIX) + r"[0-9a-f]+-(\d+)-\w+", e.name)
        try:
            mine = e.is_dir(follow_symlinks=False) and e.stat(follow_symlinks=False).st_uid
        except OSError:
            continue
        if m and mine == os.getuid() and not alive(int(m.group(1))):
            shutil.rmtree(e.path, ignore_errors=True)
            gone.append(Path(e.path))
    return gone


class StreamCapture:
    """The server side of `states` requests: a capture engine's `llm`, its plan and dtype."""

    def __init__(self, llm, plan, dtype: str, scratch_dir, name: str):
        self.llm, self.plan, self.dtype = llm, plan, dtype
        self.scratch_dir, self.name = Path(scratch_dir), name
        clean_scratch(self.scratch_dir)
        self.shards: dict[str, TokenShard] = {}  # token shard path -> shard, most recent last
        self.busy = 0.0
        self.requests = 0
        self.since = time.monotonic()

    def _shard(self, path: str) -> TokenShard:
        if path not in self.shards:
            if len(self.shards) >= 64:  # a bounded set of recent shards
                self.shards.pop(next(iter(self.shards)))
            self.shards[path] = read_token_shard(path)
        return self.shards[path]

    def capture(self, pack: TokenShard):
        """(states, scales or None, input ids) of every row of `pack`, as its shard file would
        hold them: written by the capture workers into the memory filesystem, read back, and
        removed."""
        scratch = self.new_scratch()
        out = scratch / "pack.safetensors"
        try:
            chunks = shard_chunks(pack, self.plan, out, chunk_tokens=len(pack.input_ids))
            shard_file = prepare_shard_file(chunks, self.plan, self.dtype)
            with open(os.devnull, "w") as sink:
                run_chunks(self.llm, chunks, chunks.todo(), self.plan, shard_file, Timings(), sink)
            with safe_open(str(chunks.shard_file), framework="pt") as f:
                states = f.get_tensor("hidden_states")
                scales = f.get_tensor(SCALES_KEY) if SCALES_KEY in f.keys() else None
                return states, scales, f.get_tensor("input_ids")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def new_scratch(self) -> Path:
        """A fresh folder for one pack: mode 0700, an unpredictable name with this pid."""
        prefix = f"{SCRATCH_PREFIX}{self.name}-{os.getpid()}-"
        return Path(tempfile.mkdtemp(prefix=prefix, dir=self.scratch_dir))

    def handle(self, req: dict) -> dict:
        """Prefill req["samples"] = [[token shard path, sample index], ...]; answer with the
        states of all their rows, in order, and the input ids they were captured for."""
        t0 = time.perf_counter()
        shards = [self._shard(p) for p, _ in req["samples"]]
        indices = [int(j) for _, j in req["samples"]]
        pack = pack_shard(shards, indices)
        states, scales, input_ids = self.capture(pack)
        cached = 0
        if req.get("cache"):
            cache = StateCache(req["cache"]["dir"], req["cache"]["budget_bytes"])
            by_shard: dict[str, list] = {}
            for k, (shard, j) in enumerate(zip(shards, indices)):
                a, b = int(pack.offsets[k]), int(pack.offsets[k + 1])
                rows = (j, states[a:b], scales[a:b] if scales is not None else None)
                by_shard.setdefault(shard.shard_id, [shard, []])[1].append(rows)
            for shard, rows in by_shard.values():
                cached += cache.add(shard, rows, self.plan, self.dtype)
        seconds = time.perf_counter() - t0
        self.busy += seconds
        self.requests += 1
        print(
            f"states: {len(indices)} samples, {len(pack.input_ids)} tokens in {seconds:.2f} s"
            f"{f', {cached} bytes cached' if req.get('cache') else ''}; busy {self.busy:.1f} s "
            f"of {time.monotonic() - self.since:.1f} s over {self.requests} requests",
            flush=True,
        )
        return {
            "states": to_wire(states),
            "scales": to_wire(scales) if scales is not None else None,
            "input_ids": to_wire(input_ids),
            "offsets": pack.offsets.tolist(),
            "seconds": seconds,
            "cached_bytes": cached,
        }
