"""Real targets' config.json as published, without weights: DeepSeek-V3, Kimi-K2, and Kimi-K2.5's
multimodal wrapper around its text model; and a stand-in checkpoint built from one."""

import json
import shutil
from pathlib import Path

DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    first_k_dense_replace=3,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    quantization_config={"quant_method": "fp8"},
)
KIMI_K2 = {
    **DEEPSEEK_V3,
    "vocab_size": 163840,
    "num_attention_heads": 64,
    "n_routed_experts": 384,
    "first_k_dense_replace": 1,
    "quantization_config": None,
}
KIMI_K25 = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "vision_config": {"hidden_size": 1152},
    "text_config": {
        **{k: v for k, v in KIMI_K2.items() if k != "architectures"},
        "model_type": "kimi_k2",
        # As published: int4 routed experts (groups of 32, one bf16 scale each, symmetric);
        # the head, attention, shared experts and the dense first layer's MLP stay bf16.
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "group_size": 32,
                        "strategy": "group",
                        "symmetric": True,
                        "type": "int",
                    },
                }
            },
            "ignore": [
                "lm_head",
                "re:.*self_attn.*",
                "re:.*shared_experts.*",
                r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
            ],
        },
    },
}


def fake_checkpoint(directory: Path, config: dict, tokenizer_dir: Path, weight: str, file: str):
    """`directory` made a target path without the weights: `config` as its config.json, the
    tokenizer of `tokenizer_dir`, and one bf16 vector named `weight` in the safetensors `file`.
    Returns `directory`."""
    import torch
    from safetensors.torch import save_file

    hidden_size = config.get("text_config", config)["hidden_size"]
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    for p in Path(tokenizer_dir).iterdir():
        shutil.copy(p, directory / p.name)
    save_file({weight: torch.ones(hidden_size, dtype=torch.bfloat16)}, str(directory / file))
    return directory
