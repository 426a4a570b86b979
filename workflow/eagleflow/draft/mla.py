"""What an MLA draft computes beyond the Llama draft's maths: DeepSeek's rotary embedding on
the rope dims and the softmax scale, exactly as vLLM 0.32 serves the draft
(`Eagle3DeepseekV2ForCausalLM`, whose layer is `DeepseekV2MLAAttention`).

Per head, q and k are [nope | rope] (nope first), v is its own width:

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))             [heads, nope + rope]
    c, kr  = split(kv_a_proj_with_mqa(x), [kv_lora, rope])    kr: one rope key for all heads
    kn, v  = split(kv_b_proj(kv_a_layernorm(c)), [nope, v])   per head
    k      = [kn | rope(kr)],  q = [qn | rope(qr)]
    out    = o_proj(softmax(q . k * scale) v)

vLLM's conventions, read from its source (not from the target's `rope_interleave`, which its
MLA layer never reads):
- the rotation is GPT-J style (`is_neox_style=False`): pairs (2i, 2i+1) of the rope dims;
- `rope_type` "default": plain RoPE, scale = (nope + rope) ** -0.5;
- any other `rope_type` is DeepSeek's YaRN (`DeepseekScalingRotaryEmbedding`): interpolated
  inverse frequencies, cos/sin multiplied by mscale(factor, mscale) / mscale(factor,
  mscale_all_dim); and, unless `attention_factor` is 1.0 ("deepseek_llama_scaling"), the
  softmax scale multiplied by mscale(factor, mscale_all_dim) ** 2 ("deepseek_yarn").
"""

from __future__ import annotations

import math

import torch

MLA_SHAPE_KEYS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
)


def rope_parameters_of(config: dict) -> dict:
    """A text config's rope as one dict {rope_type, rope_theta, YaRN keys}: from
    `rope_parameters` (transformers 5) or the older `rope_theta` + `rope_scaling`."""
    params = dict(config.get("rope_parameters") or {})
    if not params:
        params = dict(config.get("rope_scaling") or {})
        params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if "rope_type" not in params:
        params["rope_type"] = params.pop("type", "default")
    params.pop("type", None)
    params["rope_theta"] = float(params.get("rope_theta", 10000.0))
    keep = ("rope_type", "rope_theta", *YARN_KEYS)
    return {k: params[k] for k in keep if k in params}


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _is_yarn(rope: dict) -> bool:
    return rope["rope_type"] != "default"


def softmax_scale(qk_head_dim: int, rope: dict) -> float:
    """`DeepseekV2MLAAttention.scaling`."""
    scale = qk_head_dim**-0.5
    if _is_yarn(rope) and rope.get("attention_factor") != 1.0:  # "deepseek_yarn"
        m = yarn_mscale(rope["factor"], float(rope.get("mscale_all_dim", 0) or 0))
        scale *= m * m
    return scale


def _yarn_inv_freq(dim: int, rope: dict) -> torch.Tensor:
    """`DeepseekScalingRotaryEmbedding._compute_inv_freq`."""
    base, factor = rope["rope_theta"], rope["factor"]
    original = rope["original_max_position_embeddings"]
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rope.get("beta_fast", 32))), 0)
    high = min(math.ceil(correction_dim(rope.get("beta_slow", 1))), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def deepseek_rotary(positions: torch.Tensor, dim: int, rope: dict):
    """cos, sin [N, dim] for the interleaved rotation of `apply_interleaved` (each frequency
    repeated for its pair), with YaRN's cos/sin magnitude folded in."""
    if _is_yarn(rope):
        inv_freq = _yarn_inv_freq(dim, rope)
        factor = rope["factor"]
        magnitude = yarn_mscale(factor, float(rope.get("mscale", 1))) / yarn_mscale(
            factor, float(rope.get("mscale_all_dim", 0) or 0)
        )
    else:
        inv_freq = 1.0 / rope["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim)
        magnitude = 1.0
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    cos, sin = freqs.cos() * magnitude, freqs.sin() * magnitude
    return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)


def apply_interleaved(x, cos, sin):
    """GPT-J rotation of x [..., N, dim] (`rotate_gptj`): pair (x[2i], x[2i+1])."""
    rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    return (x * cos + rotated * sin).to(x.dtype)
