"""A copy of the tiny Kimi-K2.5 replica with its routed experts int4, as the hub publishes them:
the probe of what vLLM serves (docs/support-matrix.md), not part of the pipeline."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

# Kimi-K2.5's quantization as published: routed experts int4 in groups of 32 (one bf16 scale
# per group, symmetric, compressed-tensors `pack-quantized`), everything else bf16.
KIMI_INT4_QUANTIZATION = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "group_size": 32,
                "strategy": "group",
                "symmetric": True,
                "type": "int",
                "dynamic": False,
                "actorder": None,
                "observer": "minmax",
            },
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    ],
    "kv_cache_scheme": None,
}


def pack_int4(weight, group: int = 32):
    """compressed-tensors' pack-quantized form of a [out, in] weight: symmetric int4 per group
    of `group` inputs (scale = absmax / 7), eight values per int32 along the input dimension,
    lowest bits first, stored offset by 8. Returns (weight_packed, weight_scale, weight_shape)."""
    import torch

    out, inp = weight.shape
    w = weight.float().reshape(out, inp // group, group)
    scale = (w.abs().amax(-1, keepdim=True) / 7).clamp(min=1e-8)
    q = (w / scale).round().clamp(-8, 7).to(torch.int32).reshape(out, inp) + 8
    q = q.reshape(out, inp // 8, 8)
    packed = torch.zeros(out, inp // 8, dtype=torch.int32)
    for i in range(8):
        packed |= q[..., i] << (4 * i)
    shape = torch.tensor([out, inp], dtype=torch.int64)
    return packed, scale.squeeze(-1).to(torch.bfloat16), shape


def quantize_routed_experts(src_dir, out_dir) -> Path:
    """A copy of the replica in `src_dir` whose routed experts are int4 as Kimi-K2.5 publishes
    them."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src_dir, out_dir = Path(src_dir), Path(out_dir)
    shutil.copytree(src_dir, out_dir, dirs_exist_ok=True)
    expert = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
    index = json.loads((src_dir / "model.safetensors.index.json").read_text())
    weight_map = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors = {}
        with safe_open(str(src_dir / file), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if expert.match(name):
                    stem = name[: -len("weight")]
                    packed, scale, shape = pack_int4(t)
                    tensors |= {
                        stem + "weight_packed": packed,
                        stem + "weight_scale": scale,
                        stem + "weight_shape": shape,
                    }
                else:
                    tensors[name] = t
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        weight_map |= {n: file for n in tensors}
    index["weight_map"] = weight_map
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = json.loads((out_dir / "config.json").read_text())
    config["text_config"]["quantization_config"] = KIMI_INT4_QUANTIZATION
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    return out_dir
