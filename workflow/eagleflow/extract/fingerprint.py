"""The extraction fingerprint: a short hash of everything that changes the stored tensors.

Output paths are content-addressed by it (`<results>/hidden/<fingerprint>/<shard>.safetensors`),
so a configuration change writes a new directory and leaves the old one intact, and returning
to an earlier configuration finds its outputs again.

Covered: the target's identity (config.json, tokenizer files, the code files it ships
(`remote_code_files`: Kimi's tokenizer is code), weight index, and for each
weight file its name, size and a signature of its first and last 64 KiB: safetensors files
begin with a header of every tensor's name, dtype, shape and offsets; or a pinned revision),
layer ids and their convention, max length, dtype, capture strategy (as configured), the
storage dtype (`capture.storage_dtype`) when it is not the default, the vLLM version (kernels
change numerics), and EXTRACTION_CODE_VERSION. The storage dtype enters the record only when it
is not `bfloat16`: the default layout is exactly what was stored before the option existed, so
the fingerprints of existing configurations (and their extracted shards) stay valid, while an
fp8 extraction gets a directory of its own; `data.chat_template_kwargs` likewise, when set (the
shard ids already change with the tokens it changes). Not covered: tensor-parallel
degree and batch sizes, which change only reduction order (TP=2 vs TP=1 agree within bf16
tolerance; docs/capture.md), so shards extracted at TP=8 and TP=1 are interchangeable.
Cost: a few small reads per weight file; never the weights themselves.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from eagleflow.store.quant import DEFAULT_STORAGE, check_storage_dtype
from eagleflow.target.info import TOKENIZER_FILES
from eagleflow.target.load import remote_code_files

# Bump when the extraction code changes what is written (layout, capture semantics).
EXTRACTION_CODE_VERSION = (
    2  # 2: vLLM CPU rotary fix (vllm_fixes.fix_cpu_rope) changes DeepSeek states
)
SIGNATURE_BYTES = 64 * 1024


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def weight_signature(path: Path) -> str:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(SIGNATURE_BYTES)
        f.seek(max(0, size - SIGNATURE_BYTES))
        tail = f.read(SIGNATURE_BYTES)
    return _sha256(head + tail + str(size).encode())


def target_identity(target_dir: str | Path, revision: str | None = None) -> dict:
    d = Path(target_dir)
    ident = {"config.json": _sha256((d / "config.json").read_bytes())}
    ident["tokenizer"] = {
        n: _sha256((d / n).read_bytes()) for n in TOKENIZER_FILES if (d / n).is_file()
    }
    code = remote_code_files(d)
    if code:  # code shipped in the directory (Kimi's tokenizer) makes tokens too
        ident["code"] = {p.name: _sha256(p.read_bytes()) for p in code}
    preprocessor = d / "preprocessor_config.json"
    if preprocessor.is_file():
        ident["preprocessor_config.json"] = _sha256(preprocessor.read_bytes())
    if revision:
        ident["weights"] = {"revision": revision}
        return ident
    index = d / "model.safetensors.index.json"
    if index.is_file():
        ident["weight_index"] = _sha256(index.read_bytes())
    ident["weights"] = {
        p.name: {"bytes": p.stat().st_size, "head_tail_sha256": weight_signature(p)}
        for p in sorted(d.glob("*.safetensors"))
    }
    return ident


def extraction_fingerprint(
    identity: dict,
    layer_ids: list[int],
    convention: str,
    max_length: int,
    dtype: str,
    strategy: str,
    vllm_version: str,
    storage_dtype: str = DEFAULT_STORAGE,
    chat_template_kwargs: dict | None = None,
) -> tuple[str, dict]:
    record = {
        "target": identity,
        "layer_ids": list(layer_ids),
        "layer_id_convention": convention,
        "max_length": max_length,
        "dtype": dtype,
        "capture_strategy": strategy,
        "vllm_version": vllm_version,
        "extraction_code_version": EXTRACTION_CODE_VERSION,
    }
    if check_storage_dtype(storage_dtype) != DEFAULT_STORAGE:
        record["storage_dtype"] = storage_dtype
    if chat_template_kwargs:  # as storage_dtype: only when set, so old fingerprints stay valid
        record["chat_template_kwargs"] = dict(chat_template_kwargs)
    blob = json.dumps(record, sort_keys=True).encode()
    record["how"] = (
        "sha256 of this record (sorted-key JSON, without this field); weights are identified by "
        f"name, size and sha256 of their first and last {SIGNATURE_BYTES} bytes, or by revision"
    )
    return _sha256(blob)[:16], record


def config_fingerprint(config: dict) -> tuple[str, dict]:
    """The fingerprint of a workflow configuration (what `common.smk` computes)."""
    from eagleflow.engine.version import vllm_version
    from eagleflow.target.info import read_target
    from eagleflow.target.layers import CONVENTION, resolve_layer_ids

    target = config["target"]["path"]
    info = read_target(target)
    ids = resolve_layer_ids(
        config["capture"]["layer_ids"], config["capture"]["layer_id_convention"], info.num_layers
    )
    return extraction_fingerprint(
        target_identity(target, config["target"]["revision"]),
        ids,
        CONVENTION,
        config["data"]["max_length"],
        config["extract"]["dtype"],
        config["capture"]["strategy"],
        vllm_version(),
        config["capture"].get("storage_dtype", DEFAULT_STORAGE),
        config["data"].get("chat_template_kwargs"),
    )
