"""What eagleflow needs to know about a target, read from its files without loading weights."""

from __future__ import annotations

import json
import re
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


def draft_architecture_for(text_config: dict) -> str:
    """`draft.architecture: auto`: "mla" for a target that attends with MLA and has a query
    low rank, as DeepSeek-V3, Kimi-K2 and Kimi-K2.5 do (the draft then takes their MLA shape;
    it tied or beat the llama draft at at most 1.21x the training time on both embedded
    targets: docs/measurements/mla-draft.md); "llama" for any other target. A target without
    q_lora_rank (DeepSeek-V2-Lite) gets llama: vLLM's MLA draft needs one."""
    has_mla = bool(text_config.get("kv_lora_rank")) and bool(text_config.get("q_lora_rank"))
    return "mla" if has_mla else "llama"


def unwrap_text_config(cfg: dict) -> tuple[str | None, dict]:
    """(The wrapper's architecture or None, the text model's config) of a target's config.json.

    A config with a `text_config` is a multimodal wrapper (Kimi-K2.5) unless its architecture
    is itself a supported text model, whose config can carry a `text_config` of its own."""
    arch = (cfg.get("architectures") or [None])[0]
    if "text_config" in cfg and arch not in DEEPSEEK_V2_FAMILY | DENSE_FAMILY:
        return arch, cfg["text_config"]
    return None, cfg


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
    wrapper, text = unwrap_text_config(cfg)
    arch = archs[0]
    if wrapper:
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


def parameter_groups(info: TargetInfo) -> list[tuple[str, int, bool]]:
    """The text model's parameters from its config alone, as (a module name standing for the
    group, count over all layers, whether it is a Linear weight): embeddings, attention,
    MLP/MoE (routed experts, shared experts, router), norms, head. Names as in the text model
    (`model.layers.1.mlp.experts.0.gate_proj`), so quantization ignore lists can be applied."""
    c, H, L = info.text_config, info.hidden_size, info.num_layers
    n_heads = c["num_attention_heads"]
    groups = [
        ("model.embed_tokens", info.vocab_size * H, False),
        ("lm_head", info.vocab_size * H, True),
        ("model.norm", H, False),
        ("model.layers.1.input_layernorm", 2 * H * L, False),  # and post_attention_layernorm
    ]
    if not info.is_deepseek_v2_family:
        hd = c.get("head_dim") or H // n_heads
        kv = c.get("num_key_value_heads", n_heads)
        attn = H * n_heads * hd + 2 * H * kv * hd + n_heads * hd * H
        return groups + [
            ("model.layers.1.self_attn.q_proj", L * attn, True),
            ("model.layers.1.mlp.gate_proj", L * 3 * H * c["intermediate_size"], True),
        ]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q_lora, kv_lora = c.get("q_lora_rank"), c["kv_lora_rank"]
    attn = "model.layers.1.self_attn."
    if q_lora:
        groups += [
            (attn + "q_a_proj", L * H * q_lora, True),
            (attn + "q_a_layernorm", L * q_lora, False),
            (attn + "q_b_proj", L * q_lora * n_heads * (nope + rope), True),
        ]
    else:
        groups.append((attn + "q_proj", L * H * n_heads * (nope + rope), True))
    groups += [
        (attn + "kv_a_proj_with_mqa", L * H * (kv_lora + rope), True),
        (attn + "kv_a_layernorm", L * kv_lora, False),
        (attn + "kv_b_proj", L * kv_lora * n_heads * (nope + v), True),
        (attn + "o_proj", L * n_heads * v * H, True),
    ]
    k_dense = c.get("first_k_dense_replace", 0)
    n_moe, moe_i, routed = L - k_dense, c["moe_intermediate_size"], c["n_routed_experts"]
    return groups + [
        ("model.layers.0.mlp.gate_proj", k_dense * 3 * H * c["intermediate_size"], True),
        ("model.layers.1.mlp.experts.0.gate_proj", n_moe * routed * 3 * H * moe_i, True),
        (
            "model.layers.1.mlp.shared_experts.gate_proj",
            n_moe * c.get("n_shared_experts", 0) * 3 * H * moe_i,
            True,
        ),
        # The router's weight and e_score_correction_bias (a plain parameter, not a Linear).
        ("model.layers.1.mlp.gate", n_moe * (H * routed + routed), False),
    ]


def count_parameters(info: TargetInfo) -> int:
    """Parameter count from the config alone (embeddings, attention, MLP/MoE, norms, head)."""
    return sum(n for _, n, _ in parameter_groups(info))


def quantization_config(info: TargetInfo) -> dict:
    """The checkpoint's quantization_config: top level, or under a wrapper's text_config."""
    path_cfg = info.path / "config.json"
    top = json.loads(path_cfg.read_text()) if path_cfg.is_file() else {}
    return top.get("quantization_config") or info.text_config.get("quantization_config") or {}


def bytes_per_weight(cfg: dict) -> float:
    """Storage bytes per quantized weight, scales included (fp8: one byte and a float32 scale
    per 128x128 block; int4 groups: half a byte and a bf16 scale per group); 2 (bf16) when
    the checkpoint is not quantized."""
    q = cfg.get("quantization_config") or cfg
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        block = q.get("weight_block_size") or [128, 128]
        return 1.0 + 4 / (block[0] * block[1]) if q.get("weight_block_size") else 1.0
    if method in ("compressed-tensors", "awq", "gptq"):
        weights = _compressed_tensors_weights(q)
        bits = q.get("bits") or weights.get("num_bits") or 4
        group = q.get("group_size") or weights.get("group_size")
        scale = 2 / group if group and group > 0 else 0.0  # one bf16 scale per group
        return bits / 8 + scale
    return 2.0


def _compressed_tensors_weights(q: dict) -> dict:
    for group in (q.get("config_groups") or {}).values():
        if (group.get("weights") or {}).get("num_bits"):
            return group["weights"]
    return {}


def _ignored(name: str, ignore: list[str]) -> bool:
    """compressed-tensors' rule: `re:` entries are regexes matched from the start of the
    module name, others are module names (matched here also as a suffix, so `lm_head` names
    a wrapper's `language_model.lm_head`)."""
    for entry in ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], name):
                return True
        elif name == entry or name.endswith("." + entry):
            return True
    return False


def weight_bytes(info: TargetInfo) -> int:
    """Bytes of the target's text-model weights, estimated from its config (no weight file is
    read): quantized Linear weights at `bytes_per_weight` of the quantization_config (scales
    included), everything else, and whatever its `ignore` list names, in bf16."""
    q = quantization_config(info)
    if not q:
        return 2 * count_parameters(info)
    quantized = bytes_per_weight(q)
    ignore = list(q.get("ignore") or q.get("modules_to_not_convert") or [])
    total = 0.0
    for name, n, linear in parameter_groups(info):
        total += n * (quantized if linear and not _ignored(name, ignore) else 2.0)
    return int(total)


def weight_files(path: str | Path) -> list[Path]:
    return sorted(Path(path).glob("*.safetensors"))
