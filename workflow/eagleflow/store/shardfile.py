"""A shard file written once: created in its final layout, chunks written into place.

Every byte of states is written once. Before the engine runs, the extract job creates the
shard's file under `.partial/<shard>/shard.safetensors` with its final safetensors header (the
layout is known from the token shard and the capture plan), the small tensors (`input_ids`,
`loss_mask`, `offsets`) and the full size (sparse: the states' bytes are not written until they
exist). The capture worker writes each chunk's rows of `hidden_states` (and, in fp8, of
`hidden_scales`) at their offsets, around the page cache where the filesystem allows
(`eagleflow.store.direct_io`), flushes them, and only then commits the chunk by its marker
(`eagleflow.store.chunks`). Finishing is verification of the file in place (a read) and a
hard link into the final path: no second copy of the states is ever written.

A file whose header differs from the one expected (another plan, another shard) is never
written into: `prepare` drops the chunk markers and creates it anew.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eagleflow.store.chunks import commit_marker
from eagleflow.store.direct_io import ALIGN, DirectWriter
from eagleflow.store.dtypes import code_of, torch_dtype
from eagleflow.store.quant import FP8, SCALES_KEY, is_fp8

FORMAT = "eagleflow-hidden-v1"


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


def shard_layout(n_tokens: int, n_offsets: int, n_layers: int, hidden: int, dtype, storage: str):
    """[(name, torch dtype, shape)] of a shard file, in file order (states first)."""
    fp8 = is_fp8(storage)
    layout = [("hidden_states", torch_dtype(FP8) if fp8 else dtype, (n_tokens, n_layers, hidden))]
    if fp8:
        layout.append((SCALES_KEY, torch.float32, (n_tokens, n_layers)))
    return layout + [
        ("input_ids", torch.int64, (n_tokens,)),
        ("loss_mask", torch.uint8, (n_tokens,)),
        ("offsets", torch.int64, (n_offsets,)),
    ]


@dataclass(frozen=True)
class ShardFile:
    """Where each tensor of one shard file lies. `spans`: tensor -> absolute byte range."""

    path: Path
    spans: dict
    n_layers: int
    state_bytes: int  # one (token, layer) row of states: hidden x element size
    size: int

    def to_json(self) -> dict:
        return {
            "path": str(self.path),
            "spans": {k: list(v) for k, v in self.spans.items()},
            "n_layers": self.n_layers,
            "state_bytes": self.state_bytes,
            "size": self.size,
        }

    @classmethod
    def from_json(cls, d: dict) -> ShardFile:
        spans = {k: tuple(v) for k, v in d["spans"].items()}
        return cls(Path(d["path"]), spans, d["n_layers"], d["state_bytes"], d["size"])

    def write_rows(
        self, lo: int, column: int, states: torch.Tensor, scales: torch.Tensor | None
    ) -> None:
        """Write `states` [n, k, hidden] (in fp8 the codes, any 1-byte dtype) and `scales`
        [n, k] as rows lo..lo+n, layer columns column..column+k, then flush them to disk.
        Whole rows of states go around the page cache where the filesystem allows
        (`eagleflow.store.direct_io`): nothing reads them back but the verification."""
        with DirectWriter(self.path) as out:
            self._write(out, "hidden_states", lo, column, states, self.state_bytes)
            if scales is not None:
                self._write(out, SCALES_KEY, lo, column, scales, 4)

    def _write(self, out: DirectWriter, name: str, lo: int, column: int, t, item_bytes: int):
        n, k = t.shape[0], t.shape[1]
        data = t.contiguous().view(torch.uint8).reshape(n, k * item_bytes).numpy()
        row = self.n_layers * item_bytes
        start = self.spans[name][0] + lo * row
        if start + n * row > self.spans[name][1]:
            raise ValueError(f"{self.path}: rows {lo}..{lo + n - 1} lie beyond {name}")
        if k == self.n_layers:  # whole rows: one contiguous range
            out.write(memoryview(data).cast("B"), start)
            return
        # A pipeline stage's layers: its columns of each row, one write per row, through the
        # page cache. Byte-range writes, not a shared mapping: stages on other nodes write the
        # other columns of the same pages, and a network filesystem writes back what each
        # client dirtied.
        offset = start + column * item_bytes
        for r in range(n):
            out.write_cached(memoryview(data[r]), offset + r * row)


@dataclass(frozen=True)
class ChunkTarget:
    """Where one chunk's rows go (its columns: one pipeline stage's layers, or all) and the
    marker that commits them; `metadata` is the marker's content (`ShardChunks.metadata`)."""

    file: ShardFile
    column: int
    marker: Path
    metadata: dict

    def commit(self, states: torch.Tensor, scales: torch.Tensor | None) -> None:
        """Write the rows, flushed to disk, then the marker."""
        self.file.write_rows(self.metadata["tokens"][0], self.column, states, scales)
        commit_marker(self.marker, self.metadata)

    def to_json(self) -> dict:
        return {
            "file": self.file.to_json(),
            "column": self.column,
            "marker": str(self.marker),
            "metadata": self.metadata,
        }

    @classmethod
    def from_json(cls, d: dict) -> ChunkTarget:
        return cls(ShardFile.from_json(d["file"]), d["column"], Path(d["marker"]), d["metadata"])


def plan_shard_file(path: Path, shard, plan, dtype, fingerprint: str) -> tuple[ShardFile, bytes]:
    """The file of `shard` under `plan` (states of `dtype` unless the plan stores fp8): its
    spans and its exact header bytes."""
    from eagleflow.target.layers import CONVENTION

    dtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    n_tok, n_layers = len(shard.input_ids), len(plan.layer_ids)
    layout = shard_layout(
        n_tok, len(shard.offsets), n_layers, plan.hidden_size, dtype, plan.storage_dtype
    )
    metadata = {
        "layer_ids": json.dumps(plan.layer_ids),
        "layer_id_convention": CONVENTION,
        "sample_ids": json.dumps(shard.sample_ids),
        "shard_id": shard.shard_id,
        "capture_strategy": plan.strategy.value,
        "fingerprint": fingerprint,
        "format": FORMAT,
        "storage_dtype": plan.storage_dtype,
    }
    # The states start on a page, so rows of a whole number of pages (Kimi-K2.5's 57,344 bytes
    # per token, the embedded default's 8,192) go to disk straight from an aligned buffer.
    header, spans, size = safetensors_header(layout, metadata, data_align=ALIGN)
    state_bytes = layout[0][1].itemsize * plan.hidden_size
    return ShardFile(Path(path), spans, n_layers, state_bytes, size), header


def prepare(shard_file: ShardFile, header: bytes, shard, drop_markers) -> bool:
    """Make `shard_file` exist with `header`, its small tensors and its full size. Returns True
    when an existing file was kept (its committed chunks stand), False when it was created;
    before creating, `drop_markers()` removes every chunk marker (they describe the old file)."""
    path = shard_file.path
    if path.is_file() and path.stat().st_size == shard_file.size:
        try:
            with open(path, "rb") as f:
                if f.read(len(header)) == header:
                    return True
        except OSError:
            pass
    drop_markers()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header)
        for name, values in (
            ("input_ids", shard.input_ids.astype(np.int64)),
            ("loss_mask", shard.loss_mask.astype(np.uint8)),
            ("offsets", shard.offsets.astype(np.int64)),
        ):
            os.pwrite(f.fileno(), np.ascontiguousarray(values).tobytes(), shard_file.spans[name][0])
        f.truncate(shard_file.size)  # the states stay a hole until their chunks are written
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return False


def link_into_place(partial: Path, final: Path) -> None:
    """Give the finished file its final name without copying: a hard link, so the partial
    name keeps the data until the job has finished (a kill right after still resumes with
    nothing to prefill); a rename where the filesystem has no hard links."""
    tmp = final.with_name(final.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(partial, tmp)
    except OSError:
        os.replace(partial, final)
        return
    os.replace(tmp, final)
