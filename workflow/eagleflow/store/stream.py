"""Write a safetensors file tensor by tensor, hashing as it goes, in bounded memory.

`safetensors.torch.save_file` needs every tensor in memory at once; a shard of a large target
is many GB. The format is an 8-byte little-endian header length, a JSON header (dtype, shape,
data offsets per tensor, `__metadata__` of strings), then the raw bytes; this writer emits
exactly that, and the result is read back with safetensors' own reader in verification.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch

from eagleflow.store.dtypes import code_of


def tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.contiguous()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


def safetensors_header(
    layout, metadata: dict[str, str], data_align: int = 8
) -> tuple[bytes, dict, int]:
    """The bytes a safetensors file of `layout` = [(name, dtype, shape)] starts with (length
    prefix and JSON header, padded with spaces as the format allows so the data starts at a
    multiple of `data_align`: 8, or a page for direct I/O), each tensor's absolute byte range
    in the file, and the file's size."""
    header, offset, sizes = {}, 0, []
    for name, dtype, shape in layout:
        n = torch.empty(0, dtype=dtype).element_size()
        for d in shape:
            n *= d
        header[name] = {
            "dtype": code_of(dtype),
            "shape": list(shape),
            "data_offsets": [offset, offset + n],
        }
        sizes.append((name, offset, offset + n))
        offset += n
    header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % data_align)
    start = 8 + len(blob)
    spans = {name: (start + a, start + b) for name, a, b in sizes}
    return struct.pack("<Q", len(blob)) + blob, spans, start + offset


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
