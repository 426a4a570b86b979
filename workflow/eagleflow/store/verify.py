"""Verification of extracted shards.

`verify_shard` reads everything once, in file order and row blocks (bounded memory), hashing
what it reads: keys, shapes, dtypes, metadata, every value finite, no all-zero rows, input ids /
loss mask / offsets identical to the tokenized shard; in fp8 storage the values are checked
after dequantization and the scales must be positive and finite. Its sha256 is the one the
extraction record keeps; `deep` compares it with the record's. `cheap_check` reads only the
file size and header and compares them with the extraction record; it is what every rerun can
afford.

Every extract job ends with `verify_extracted_shard`: a shard is finished only once its report
is written, and a shard that fails is moved to quarantine (nothing is lost, nothing bad is
kept where a rerun would take it for finished). One job per shard, not an extract job and a
verify job: half the DAG for Snakemake to build on every rerun, and no second cluster job
(queue wait, start-up) per shard for a read that costs seconds next to a model load.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from eagleflow.data.shards import TokenShard
from eagleflow.store.direct_io import DirectReader
from eagleflow.store.dtypes import code_of, torch_dtype
from eagleflow.store.headers import cheap_check, read_header
from eagleflow.store.integrity import quarantine
from eagleflow.store.quant import DEFAULT_STORAGE, FP8, SCALES_KEY, is_fp8, row_peaks

KEYS = {"hidden_states", "input_ids", "loss_mask", "offsets"}
ROW_BLOCK = 4096


class ShardInvalid(ValueError):
    pass


@dataclass(frozen=True)
class Expected:
    """What a shard of an extraction must hold beyond its tokens."""

    fingerprint: str
    layer_ids: list[int]
    hidden_size: int
    dtype: str  # extract.dtype
    storage_dtype: str = DEFAULT_STORAGE  # capture.storage_dtype

    @classmethod
    def of(cls, plan, dtype: str) -> Expected:
        """From a capture plan (`eagleflow.capture.plan.CapturePlan`)."""
        return cls(
            plan.fingerprint, list(plan.layer_ids), plan.hidden_size, dtype, plan.storage_dtype
        )

    @property
    def keys(self) -> set[str]:
        return KEYS | {SCALES_KEY} if is_fp8(self.storage_dtype) else KEYS


def verify_shard(
    path: str | Path,
    tokens: TokenShard,
    record: dict,
    expected: Expected,
    deep: bool = False,
) -> dict:
    """Check the shard at `path`; the result's `sha256` is the file's, from the same read."""
    path = Path(path)
    problems = cheap_check(path, record, expected.fingerprint)
    digest = None
    if not problems:
        more, digest = _verify_tensors(path, tokens, expected)
        problems += more
    if deep and digest is not None and digest != record.get("sha256"):
        problems.append(
            f"sha256 {digest[:16]}... differs from the recorded "
            f"{str(record.get('sha256'))[:16]}... (content changed)"
        )
    return {
        "shard_id": tokens.shard_id,
        "path": str(path),
        "ok": not problems,
        "problems": problems,
        "n_samples": len(tokens.sample_ids),
        "n_tokens": int(len(tokens.input_ids)),
        "bytes": record.get("bytes"),
        "sha256": digest,
        "tokens_per_second": record.get("tokens_per_second"),
        "deep": deep,
    }


def verify_extracted_shard(
    path: str | Path,
    tokens: TokenShard,
    record: dict,
    expected: Expected,
    report_path: str | Path,
    partial_dir: Path | None = None,
    record_path: str | Path | None = None,
) -> dict:
    """Verify a shard just written. If it passes: with `record_path`, set the record's sha256
    (from the verification read) and write it; then write the report; each atomically, the
    report last. If it fails, move the shard, its record and its partial directory
    (`partial_dir`: the file's data and chunk markers, so the next run extracts afresh) to
    `<hidden dir>/quarantine/` with the reason, and raise ShardInvalid naming the shard, the
    problems and where the files went."""
    t0 = time.perf_counter()
    result = verify_shard(path, tokens, record, expected)
    result["verify_seconds"] = round(time.perf_counter() - t0, 3)
    if not result["ok"]:
        dest = quarantine(Path(path).parent, tokens.shard_id, result["problems"])
        if partial_dir is not None and Path(partial_dir).exists():
            os.replace(partial_dir, dest / "chunks")
        raise ShardInvalid(
            f"shard {tokens.shard_id} ({path}) failed verification: "
            f"{'; '.join(result['problems'])}. "
            f"Its files were moved to {dest}; the next run extracts it again."
        )
    if record_path is not None:
        record["sha256"] = result["sha256"]
        _write_json(record_path, record)
    _write_json(report_path, result)
    return result


def _write_json(path: str | Path, data: dict) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _verify_tensors(path, tokens, expected: Expected) -> tuple[list[str], str | None]:
    """Problems found in the tensors, and the file's sha256 (None when the header alone
    already failed)."""
    layer_ids = expected.layer_ids
    hidden_size, dtype = expected.hidden_size, expected.dtype
    problems = []
    header, data_start = read_header(path)
    keys = set(header) - {"__metadata__"}
    fp8 = is_fp8(expected.storage_dtype)
    if keys != expected.keys:
        if fp8 and keys == KEYS:
            return [
                f"{path}: shard {tokens.shard_id} lacks {SCALES_KEY} (storage_dtype {FP8} "
                "stores one scale per token and layer); its states cannot be dequantized"
            ], None
        return [f"tensors {sorted(keys)}, expected {sorted(expected.keys)}"], None
    meta = header["__metadata__"]
    T = len(tokens.input_ids)
    n = len(layer_ids)
    expect = {
        "hidden_states": ([T, n, hidden_size], code_of(FP8 if fp8 else dtype)),
        **({SCALES_KEY: ([T, n], "F32")} if fp8 else {}),
        "input_ids": ([T], "I64"),
        "loss_mask": ([T], "U8"),
        "offsets": ([len(tokens.offsets)], "I64"),
    }
    for name, (shape, dt) in expect.items():
        if header[name]["shape"] != shape or header[name]["dtype"] != dt:
            problems.append(
                f"{name}: {header[name]['dtype']} {header[name]['shape']}, expected {dt} {shape}"
            )
    if json.loads(meta.get("layer_ids", "null")) != list(layer_ids):
        problems.append(f"layer_ids {meta.get('layer_ids')} in the file, expected {layer_ids}")
    if json.loads(meta.get("sample_ids", "null")) != tokens.sample_ids:
        problems.append("sample_ids in the file differ from the tokenized shard's")
    # Shards written before storage dtypes existed carry no entry: they are the default layout.
    if meta.get("storage_dtype", DEFAULT_STORAGE) != expected.storage_dtype:
        problems.append(
            f"storage_dtype {meta.get('storage_dtype')} in the file, "
            f"expected {expected.storage_dtype}"
        )
    if problems:
        return problems, None
    with safe_open(str(path), framework="pt") as f:
        if not np.array_equal(f.get_tensor("input_ids").numpy(), tokens.input_ids):
            problems.append("input_ids differ from the tokenized shard's tokens")
        if not np.array_equal(f.get_tensor("loss_mask").numpy(), tokens.loss_mask):
            problems.append("loss_mask differs from the tokenized shard's")
        offsets = f.get_tensor("offsets").numpy()
        if not np.array_equal(offsets, tokens.offsets):
            problems.append("offsets differ from the tokenized shard's")
        if offsets[0] != 0 or offsets[-1] != T or np.any(np.diff(offsets) <= 0):
            problems.append("offsets are not 0, strictly increasing, ending at the token count")
        scales = f.get_slice(SCALES_KEY) if fp8 else None
        digest = _scan_states(path, header, data_start, layer_ids, scales, problems)
    return problems, digest


def _scan_states(path, header, data_start, layer_ids, scales, problems) -> str:
    """Read the file once, start to end, hashing every byte; `hidden_states` is read in row
    blocks, around the page cache where the filesystem allows (the file was just written
    around it, and no one else reads it now: `eagleflow.store.direct_io`), and checked by each
    row's peak (dequantized with `scales`, a safetensors slice, in fp8). The first problem of
    each kind is appended to `problems`; hashing goes on to the end."""
    info = header["hidden_states"]
    T, n, H = info["shape"]
    dtype = torch_dtype(info["dtype"])
    row = n * H * dtype.itemsize
    states_start = data_start + info["data_offsets"][0]
    sha = hashlib.sha256()
    state_problem = False
    with open(path, "rb") as f, DirectReader(path, min(ROW_BLOCK, max(T, 1)) * row) as reader:
        sha.update(f.read(data_start))
        _hash_span(f, sha, info["data_offsets"][0])  # tensors laid out before the states, if any
        for a in range(0, T, ROW_BLOCK):
            rows = min(ROW_BLOCK, T - a)
            view = reader.read(states_start + a * row, rows * row)
            if len(view) != rows * row:
                problems.append(f"hidden_states: the file ends inside row block {a}")
                return sha.hexdigest()
            sha.update(view)
            if state_problem:
                continue
            states = torch.frombuffer(view, dtype=torch.uint8).view(dtype).reshape(rows, n, H)
            sc = scales[a : a + rows] if scales is not None else None
            if sc is not None:
                bad_scale = ~(torch.isfinite(sc) & (sc > 0))
                if bad_scale.any():
                    tok, layer = (int(x) for x in bad_scale.nonzero()[0])
                    problems.append(
                        f"{SCALES_KEY}: scale {float(sc[tok, layer])} at token {tok + a}, "
                        f"layer id {layer_ids[layer]} (scales must be positive and finite)"
                    )
                    state_problem = True
                    continue
            peaks = row_peaks(states, sc)  # [rows, n]: the largest |value|, dequantized
            finite = torch.isfinite(peaks)
            if not finite.all():
                tok, layer = (int(x) for x in (~finite).nonzero()[0])
                problems.append(
                    f"hidden_states: non-finite value at token {tok + a}, "
                    f"layer id {layer_ids[layer]}"
                )
                state_problem = True
                continue
            zero_rows = peaks == 0
            if zero_rows.any():
                tok, layer = (int(x) for x in zero_rows.nonzero()[0])
                problems.append(
                    f"hidden_states: all-zero row at token {tok + a}, layer id {layer_ids[layer]}"
                )
                state_problem = True
        f.seek(states_start + T * row)
        _hash_span(f, sha, None)  # the tensors after the states, to the end
    return sha.hexdigest()


def _hash_span(f, sha, n_bytes: int | None, block: int = 1 << 24) -> None:
    """Hash the next `n_bytes` of `f` (None: to the end)."""
    while n_bytes is None or n_bytes > 0:
        data = f.read(block if n_bytes is None else min(block, n_bytes))
        if not data:
            return
        sha.update(data)
        if n_bytes is not None:
            n_bytes -= len(data)
