"""What eagleflow needs to know about a target, read from its files without loading weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eagleflow.logs import UserError

DEEPSEEK_V2_FAMILY = {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"}
DENSE_FAMILY = {"LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM"}
# Multimodal wrappers whose text model sits under `text_config` (Kimi-K2.5).
WRAPPERS = {"KimiK25ForConditionalGeneration"}

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "tokenizer.model",
    "tiktoken.model",
    "special_tokens_map.json",
)


class TargetError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class TargetInfo:
    path: Path
    architecture: str  # of the text model
    wrapper: str | None
    text_config: dict
    num_layers: int
    hidden_size: int
    vocab_size: int

    @property
    def is_deepseek_v2_family(self) -> bool:
        return self.architecture in DEEPSEEK_V2_FAMILY

    @property
    def is_mla(self) -> bool:
        return self.is_deepseek_v2_family and bool(self.text_config.get("kv_lora_rank"))


def read_target(path: str | Path) -> TargetInfo:
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise TargetError(
            f"{cfg_file}: not found; set `target.path` to a Hugging Face model directory"
        )
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise TargetError(f"{cfg_file}: not valid JSON ({e.msg}, line {e.lineno})") from e
    archs = cfg.get("architectures") or []
    if not archs:
        raise TargetError(
            f"{cfg_file}: no `architectures` entry; eagleflow cannot tell which model this is"
        )
    arch, wrapper, text = archs[0], None, cfg
    if "text_config" in cfg and arch not in DEEPSEEK_V2_FAMILY | DENSE_FAMILY:
        wrapper, text = arch, cfg["text_config"]
        arch = (text.get("architectures") or [None])[0] or _arch_from_model_type(text, cfg_file)
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if key not in text:
            raise TargetError(f"{cfg_file}: the text model config lacks `{key}`")
    return TargetInfo(
        path,
        arch,
        wrapper,
        text,
        int(text["num_hidden_layers"]),
        int(text["hidden_size"]),
        int(text["vocab_size"]),
    )


def _arch_from_model_type(text: dict, cfg_file: Path) -> str:
    by_type = {
        "deepseek_v3": "DeepseekV3ForCausalLM",
        "deepseek_v2": "DeepseekV2ForCausalLM",
        "kimi_k2": "DeepseekV3ForCausalLM",
        "llama": "LlamaForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
    }
    model_type = text.get("model_type")
    if model_type not in by_type:
        raise TargetError(f"{cfg_file}: text_config model_type {model_type!r} is not supported")
    return by_type[model_type]


def count_parameters(info: TargetInfo) -> int:
    """Parameter count from the config alone (embeddings, attention, MLP/MoE, norms, head)."""
    c, H = info.text_config, info.hidden_size
    n_heads = c["num_attention_heads"]
    total = 2 * info.vocab_size * H + H  # embeddings, lm_head, final norm
    if info.is_deepseek_v2_family:
        nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        q_lora, kv_lora = c.get("q_lora_rank"), c["kv_lora_rank"]
        q = (
            H * q_lora + q_lora + q_lora * n_heads * (nope + rope)
            if q_lora
            else H * n_heads * (nope + rope)
        )
        attn = q + H * (kv_lora + rope) + kv_lora + kv_lora * n_heads * (nope + v) + n_heads * v * H
        dense = 3 * H * c["intermediate_size"]
        moe_i = c["moe_intermediate_size"]
        moe = (
            (c["n_routed_experts"] + c.get("n_shared_experts", 0)) * 3 * H * moe_i
            + H * c["n_routed_experts"]
            + c["n_routed_experts"]
        )
        k_dense = c.get("first_k_dense_replace", 0)
        total += (
            info.num_layers * (attn + 2 * H) + k_dense * dense + (info.num_layers - k_dense) * moe
        )
    else:
        hd = c.get("head_dim") or H // n_heads
        kv = c.get("num_key_value_heads", n_heads)
        attn = H * n_heads * hd + 2 * H * kv * hd + n_heads * hd * H
        total += info.num_layers * (attn + 3 * H * c["intermediate_size"] + 2 * H)
    return int(total)


def bytes_per_weight(cfg: dict) -> float:
    """Storage bytes per weight: fp8 and int4 checkpoints are far smaller than bf16 ones."""
    q = cfg.get("quantization_config") or {}
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        return 1.0
    if method in ("compressed-tensors", "awq", "gptq"):
        bits = q.get("bits") or _compressed_tensors_bits(q) or 4
        return bits / 8
    return 2.0


def _compressed_tensors_bits(q: dict):
    for group in (q.get("config_groups") or {}).values():
        bits = (group.get("weights") or {}).get("num_bits")
        if bits:
            return bits
    return None


def weight_bytes(info: TargetInfo) -> int:
    """Bytes of the target's weights, estimated from its config (no weight file is read)."""
    return int(count_parameters(info) * bytes_per_weight(info.text_config))


def weight_files(path: str | Path) -> list[Path]:
    return sorted(Path(path).glob("*.safetensors"))
