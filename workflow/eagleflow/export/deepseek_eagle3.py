"""The config.json of an MLA draft, as vLLM 0.32 loads it: `Eagle3DeepseekV2ForCausalLM`
(`vllm/model_executor/models/deepseek_eagle3.py`).

The speculators format cannot carry it (vLLM's converter maps only llama and qwen3 layers),
so this is a plain HF-style directory: config.json + model.safetensors, served with
`speculative_config={"method": "eagle3", "model": DIR, ...}`. The weights keep the draft's
own names (`layers.0.self_attn.q_a_proj.weight`, ..., `fc`, `norm`, `lm_head`, `d2t`); vLLM
prefixes `model.` to all but `lm_head` and `d2t`, fuses q_a_proj with kv_a_proj_with_mqa and
gate with up, and skips `t2d` (`Eagle3DeepseekV2ForCausalLM.load_weights`).

What vLLM needs, found by running it (field notes 18):
- `model_type` deepseek_v2: deepseek_v3 is turned into an MTP draft by
  `SpeculativeConfig.hf_config_override`;
- `q_lora_rank` set: the weight mapper always fuses q_a_proj with kv_a_proj_with_mqa;
- `norm_before_residual` written out: this model's default is False, eagleflow's True;
- the engine with MLA on (VLLM_MLA_DISABLE=0): with MLA off its CPU KV cache has no block
  size common to the target and the draft.
The aux layer ids are read from the top level (`eagle_aux_hidden_state_layer_ids`, vLLM
convention, as stored in the shards) by the target's model runner.
"""

from __future__ import annotations

from eagleflow.draft.mla import MLA_SHAPE_KEYS
from eagleflow.draft.model import DraftConfig, Eagle3Draft

ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"


def deepseek_eagle3_config(
    draft: Eagle3Draft, aux_ids: list[int], target_config: dict, dtype: str, provenance: dict
) -> dict:
    c = draft.cfg
    if c.decoder != "mla":
        raise ValueError(f"{ARCHITECTURE} holds an MLA draft, this one is {c.decoder}")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "deepseek_v2",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_attention_heads,
        "q_lora_rank": c.q_lora_rank,
        "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_parameters": c.rope(),
        "rope_interleave": True,  # vLLM's MLA rotates interleaved pairs whatever this says
        "attention_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": int(target_config["hidden_size"]),
        "num_aux_hidden_states": c.num_aux,
        "eagle_aux_hidden_state_layer_ids": list(aux_ids),
        "norm_before_residual": c.norm_before_residual,
        "fc_norm": c.fc_norm,
        "norm_output": c.norm_output,
        "dtype": dtype,
        "bos_token_id": target_config.get("bos_token_id"),
        "eos_token_id": target_config.get("eos_token_id"),
        "pad_token_id": target_config.get("pad_token_id"),
        "eagleflow": provenance,
    }


def draft_config_of(config: dict) -> DraftConfig:
    """The `DraftConfig` of an exported MLA draft's config.json (what the reference loop of
    the evaluation rebuilds): the inverse of `deepseek_eagle3_config`."""
    rope = dict(config["rope_parameters"])
    theta = float(rope.pop("rope_theta"))
    qk = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    return DraftConfig(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_attention_heads"],
        head_dim=qk,
        vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"],
        num_aux=len(config["eagle_aux_hidden_state_layer_ids"]),
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=theta,
        max_position_embeddings=config["max_position_embeddings"],
        norm_before_residual=config["norm_before_residual"],
        fc_norm=config.get("fc_norm", False),
        norm_output=config.get("norm_output", False),
        decoder="mla",
        **{key: config[key] for key in MLA_SHAPE_KEYS},
        rope_scaling=None if rope["rope_type"] == "default" else rope,
    )
