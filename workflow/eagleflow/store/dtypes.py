"""The one dtype table: config names, torch dtypes, safetensors codes and sizes.

Torch-free at import (the cheap checks that run on every invocation read it); `torch_dtype`
imports torch when a job needs the real dtype."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Dtype:
    name: str  # as in the config and as torch's attribute (`torch.<name>`)
    code: str  # safetensors header code
    itemsize: int


DTYPES = {
    d.name: d
    for d in (
        Dtype("bfloat16", "BF16", 2),
        Dtype("float16", "F16", 2),
        Dtype("float32", "F32", 4),
        Dtype("int64", "I64", 8),
        Dtype("int32", "I32", 4),
        Dtype("uint8", "U8", 1),
        Dtype("float8_e4m3fn", "F8_E4M3", 1),  # capture.storage_dtype float8_e4m3fn
    )
}
BY_CODE = {d.code: d for d in DTYPES.values()}


def torch_dtype(name_or_code: str):
    """`torch.bfloat16` for "bfloat16" or "BF16"."""
    import torch

    d = DTYPES.get(name_or_code) or BY_CODE[name_or_code]
    return getattr(torch, d.name)


def code_of(dtype) -> str:
    """The safetensors code of a torch dtype or a config name ("BF16" for torch.bfloat16)."""
    return DTYPES[str(dtype).removeprefix("torch.")].code


def itemsize(name: str) -> int:
    return DTYPES[name].itemsize
