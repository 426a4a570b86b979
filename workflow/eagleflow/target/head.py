"""The few target tensors draft training needs, read alone from the target's safetensors.

`model.norm.weight` and `lm_head.weight` turn the stored final pre-norm state (layer id L)
into the target's distribution; `model.embed_tokens.weight` is the draft's frozen input
embedding. Each is read with `safe_open` from the one file that holds it (the index file
says which), so a 1 TB target costs a few hundred MB of reads, not a model load.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from eagleflow.target.info import read_target, unwrap_text_config

NORM, LM_HEAD, EMBED = "model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"


def read_target_config(target_dir) -> dict:
    """The target's text-model config: a wrapper's `text_config`, else config.json itself."""
    with open(Path(target_dir) / "config.json") as f:
        return unwrap_text_config(json.load(f))[1]


def _weight_file(target_dir: Path, name: str) -> Path:
    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        if name not in weight_map:
            raise KeyError(f"{index}: no tensor {name!r}")
        return target_dir / weight_map[name]
    single = target_dir / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{target_dir}: neither model.safetensors nor its index")
    return single


def _stored_name(target_dir: Path, name: str) -> str:
    """A multimodal wrapper (Kimi-K2.5) stores its text model under `language_model.`."""
    return f"language_model.{name}" if read_target(target_dir).wrapper else name


def read_target_tensor(target_dir, name: str) -> torch.Tensor:
    """One tensor of the target's text model (named as in a plain causal LM), nothing else."""
    target_dir = Path(target_dir)
    name = _stored_name(target_dir, name)
    path = _weight_file(target_dir, name)
    with safe_open(str(path), framework="pt") as f:
        if name not in f.keys():
            raise KeyError(f"{path}: no tensor {name!r}")
        return f.get_tensor(name)


class TargetHead(torch.nn.Module):
    """Frozen target final norm + lm_head restricted to the draft vocabulary. The rows are
    kept in `dtype` (draft training: bf16, as the target stores them); the norm runs in fp32
    and the logits come back as fp32."""

    def __init__(self, norm_weight, lm_head_rows, eps: float, dtype=torch.float32):
        super().__init__()
        self.register_buffer("norm_weight", norm_weight.float())
        self.register_buffer("lm_head", lm_head_rows.to(dtype))
        self.eps = eps

    @classmethod
    def load(cls, target_dir, draft_target_ids: torch.Tensor, dtype=torch.float32) -> TargetHead:
        config = read_target_config(target_dir)
        norm = read_target_tensor(target_dir, NORM)
        lm_head = read_target_tensor(target_dir, LM_HEAD)[draft_target_ids]
        return cls(norm, lm_head, float(config.get("rms_norm_eps", 1e-6)), dtype)

    @torch.no_grad()
    def forward(self, final_prenorm: torch.Tensor) -> torch.Tensor:
        x = final_prenorm.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.norm_weight * x).to(self.lm_head.dtype) @ self.lm_head.T).float()
