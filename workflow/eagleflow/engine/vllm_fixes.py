"""Fixes for bugs of the installed vLLM on the CPU, each checked before it is applied;
`apply_vllm_fixes()` applies all of them.

1. The rotary embedding. vLLM 0.32's CPU rotary-embedding kernel (`RotaryEmbedding.forward_cpu`,
`ops.rotary_embedding`) rotates a query given as [tokens, heads, head_size] wrongly for every
head but the first; given as [tokens, heads * head_size] it is right. Llama- and Qwen-style
models pass 2-D queries; DeepseekV2/V3 attention (MLA and plain) passes its rope part as a 3-D
view. On a random target, whose attention is near uniform, this hardly shows; on a trained one
it moved the first layer's output by a median 3% and a 95th percentile of 105%
(docs/measurements/reference-check.md). `fix_cpu_rope()` runs a tiny self-test of the kernel and,
only if the 3-D result is wrong, routes 3-D calls through the 2-D layout.

2. AMX permission. On an x86 CPU with AMX, vLLM's CPU attention kernel for non-MLA models
(`cpu_attention_with_kv_cache`, ISA "amx") uses AMX tiles without asking Linux for them
(`arch_prctl(ARCH_REQ_XCOMP_PERM)`); a process that has not asked dies of SIGILL at its first
forward, silently (a spawned worker of a Llama or Qwen target). PyTorch asks when its own
kernels first use AMX, so whether a process had asked depended on what it ran before.
`fix_cpu_amx()` asks, once per process, and checks that the kernel granted it.

Both must run in every process that builds a model before the model is built (vLLM binds the
rotary method at construction): eagleflow calls `apply_vllm_fixes()` where it starts engines and
where its worker extensions are imported. A process vLLM spawns (its V1 engine core, TP
workers) does not inherit the patch: eagleflow reaches it through the worker extension."""

from __future__ import annotations

import ctypes
import functools
import platform

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


# Linux x86-64: arch_prctl's syscall number, its "get permitted extended features" request and
# the AMX tile-data feature bit (asm/prctl.h, asm/fpu/types.h).
_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1022, 18


def amx_permitted() -> bool:
    """True if this process may use AMX tiles (Linux x86-64; False elsewhere)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    mask = ctypes.c_ulong(0)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) != 0:
        return False
    return bool(mask.value >> _XFEATURE_XTILEDATA & 1)


@functools.cache
def fix_cpu_amx() -> bool:
    """On the CPU platform of an AMX-capable x86 CPU, ask for AMX in this process (once per
    process); True if the process may now use AMX, False where there is no AMX to ask for."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not torch.cpu._is_amx_tile_supported():
        return False
    if not torch.cpu._init_amx() or not amx_permitted():
        raise RuntimeError(
            "eagleflow: this CPU has AMX but Linux did not grant this process its use "
            "(arch_prctl ARCH_REQ_XCOMP_PERM); vLLM's CPU attention would die of an illegal "
            "instruction. Run on a kernel of Linux 5.16 or newer that permits AMX."
        )
    return True


def apply_vllm_fixes() -> None:
    """Every fix above, in this process (each applied once per process)."""
    fix_cpu_amx()
    fix_cpu_rope()
