"""A safetensors file written tensor by tensor, hashing as it goes, in bounded memory: the
streaming write that benchmarks/rerun_overhead.py builds its large shards with (the workflow's
own shards are written in place by eagleflow.store.shardfile)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from eagleflow.store.shardfile import safetensors_header


def tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.contiguous()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


class StreamingWriter:
    """`layout` = [(name, dtype, shape)] in file order; then `write(name, tensor)` in that order,
    any number of pieces per tensor (concatenated along dim 0)."""

    def __init__(self, path: str | Path, layout, metadata: dict[str, str], digest: bool = True):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        header, spans, _ = safetensors_header(layout, metadata)
        self.sizes = {name: b - a for name, (a, b) in spans.items()}
        self.order = [name for name, _, _ in layout]
        self.written = {name: 0 for name in self.order}
        # digest=False skips hashing: close returns None.
        self.sha = hashlib.sha256() if digest else None
        self.f = open(self.tmp, "wb")
        self._emit(header)

    def _emit(self, data) -> None:
        if self.sha is not None:
            self.sha.update(data)
        self.f.write(data)

    def write(self, name: str, t: torch.Tensor) -> None:
        expected_next = next(
            n for n in self.order if self.written[n] < self.sizes[n] or self.sizes[n] == 0
        )
        if name != expected_next:
            raise ValueError(f"tensor {name} written out of order (next is {expected_next})")
        data = tensor_bytes(t)
        if self.written[name] + len(data) > self.sizes[name]:
            raise ValueError(f"tensor {name}: more bytes than its declared shape")
        self._emit(data)
        self.written[name] += len(data)

    def close(self) -> tuple[str | None, int]:
        """Check completeness, fsync, rename into place; returns (sha256, size)."""
        short = [n for n in self.order if self.written[n] != self.sizes[n]]
        if short:
            self.abort()
            raise ValueError(f"{self.path}: tensors {short} were not written completely")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        size = self.tmp.stat().st_size
        os.replace(self.tmp, self.path)
        return (self.sha.hexdigest() if self.sha is not None else None), size

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)
