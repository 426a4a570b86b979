"""Fixes for bugs of the installed vLLM that change hidden states, each checked before it is
applied.

vLLM 0.32's CPU rotary-embedding kernel (`RotaryEmbedding.forward_cpu`, `ops.rotary_embedding`)
rotates a query given as [tokens, heads, head_size] wrongly for every head but the first; given
as [tokens, heads * head_size] it is right. Llama- and Qwen-style models pass 2-D queries;
DeepseekV2/V3 attention (MLA and plain) passes its rope part as a 3-D view. On a random target,
whose attention is near uniform, this hardly shows; on a trained one it moved the first layer's
output by a median 3% and a 95th percentile of 105% (docs/measurements/reference-check.md).

`fix_cpu_rope()` runs, on the CPU platform, a tiny self-test of the kernel and, only if the 3-D
result is wrong, routes 3-D calls through the 2-D layout. It must run in every process that
builds a model before the model is built (vLLM binds the method at construction): eagleflow
calls it where it starts engines and where its worker extension is imported. A process vLLM
spawns (its V1 engine core, by default) does not inherit the patch: eagleflow keeps the engine
core in the calling process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) or reaches it through the
worker extension."""

from __future__ import annotations

import functools

import torch


def _gptj_rotate(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Reference: pairs (2i, 2i+1) of the last dim rotated by position * base^(-2i/d), float64."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions[:, None].double() * inv[None]
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    x = x.double()
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def cpu_rope_3d_is_wrong() -> bool:
    """True if the installed vLLM's CPU rotary kernel mis-rotates a 3-D multi-head query."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    tokens, heads, dim, base = 9, 3, 16, 10000.0
    with set_current_vllm_config(VllmConfig()):
        rope = RotaryEmbedding(dim, dim, 64, base, False, torch.float32)
    g = torch.Generator().manual_seed(0)
    positions = torch.arange(tokens)
    query = torch.randn(tokens, heads, dim, generator=g)
    key = torch.randn(tokens, 1, dim, generator=g)
    q, _ = rope.forward_cpu(positions, query.clone(), key.clone())
    return not torch.allclose(q.double(), _gptj_rotate(query, positions, base), atol=1e-4)


def _flattened(forward_cpu):
    def forward_cpu_2d(self, positions, query, key=None):
        shape_q = query.shape
        q = query.reshape(shape_q[0], -1).contiguous()
        k = None if key is None else key.reshape(key.shape[0], -1).contiguous()
        q, k = forward_cpu(self, positions, q, k)
        return q.view(shape_q), None if key is None else k.view(key.shape)

    return forward_cpu_2d


@functools.cache
def fix_cpu_rope() -> bool:
    """On the CPU platform, apply the fix in this process if the self-test fails (once per
    process); True if the fix is in place."""
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not cpu_rope_3d_is_wrong():
        return False
    RotaryEmbedding.forward_cpu = _flattened(RotaryEmbedding.forward_cpu)
    if cpu_rope_3d_is_wrong():
        raise RuntimeError(
            "eagleflow: vLLM's CPU rotary embedding is wrong for 3-D queries and the "
            "flattening fix did not repair it; extraction would be wrong"
        )
    return True
