"""Export a trained draft as a speculators-format directory that vLLM loads.

    <dir>/config.json         the layout speculators 0.9.0's `save_pretrained` writes for an
                              Eagle3 draft (architectures `Eagle3DraftModel`,
                              `speculators_model_type: eagle3`, a one-layer llama
                              `transformer_layer_config`, `speculators_config` with the
                              greedy proposal and the verifier)
    <dir>/model.safetensors   the draft's weights under speculators' names, plus `d2t`
                              (int64) and `t2d` (bool)

`eagle_aux_hidden_state_layer_ids` come from the shards' own metadata (read from every
shard, which must agree) and must equal the ids the checkpoint was trained on; vLLM reads
them from the top level of config.json without any shift (vLLM convention, as stored).
vLLM 0.32 turns this config into `Eagle3LlamaForCausalLM` (`SpeculatorsConfig`,
`speculators/algos.py: update_eagle3`). An MLA draft (`draft.architecture: mla`) is written
in the layout of `eagleflow.export.deepseek_eagle3` instead, with the same weights' names
and the same checks.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagleflow.draft.model import Eagle3Draft
from eagleflow.export.deepseek_eagle3 import deepseek_eagle3_config
from eagleflow.target.head import read_target_config
from eagleflow.train.data import layout_of, read_layout

SPECULATORS_VERSION = "0.9.0"


def transformer_layer_config(draft: Eagle3Draft, target_config: dict) -> dict:
    c = draft.cfg
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": target_config.get("bos_token_id"),
        "eos_token_id": target_config.get("eos_token_id"),
        "pad_token_id": target_config.get("pad_token_id"),
    }


def speculators_config(
    draft: Eagle3Draft,
    aux_ids: list[int],
    target_dir,
    target_config: dict,
    speculative_tokens: int,
    dtype: str,
    provenance: dict | None = None,
) -> dict:
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": draft.cfg.draft_vocab_size,
        "target_hidden_size": int(target_config["hidden_size"]),
        "norm_before_residual": draft.cfg.norm_before_residual,
        "norm_before_fc": False,
        "fc_norm": draft.cfg.fc_norm,
        "norm_output": draft.cfg.norm_output,
        "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": list(aux_ids),
        "tie_word_embeddings": False,
        "dtype": dtype,
        "transformer_layer_config": transformer_layer_config(draft, target_config),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(speculative_tokens),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {
                "name_or_path": str(target_dir),
                "architectures": list(target_config.get("architectures") or []),
            },
        },
        "eagleflow": provenance or {},
    }


def export_tensors(draft: Eagle3Draft, dtype: torch.dtype) -> dict:
    """Floating weights cast to `dtype`; d2t int64, t2d bool; names as vLLM loads them. A
    draft whose vocabulary is the target's whole vocabulary has no d2t/t2d: vLLM builds no
    `draft_id_to_target_id` then and refuses one in the file (the ids are the target's, in
    order: `eagleflow.draft.vocab` keeps chosen ids sorted, so d2t is all zeros)."""
    out = {}
    for name, tensor in draft.export_state_dict().items():  # + the frozen embedding
        tensor = tensor.detach().cpu()
        out[name] = (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous()
    if draft.cfg.draft_vocab_size == draft.cfg.vocab_size:
        if out["d2t"].any():
            raise ValueError("a draft vocabulary of every target id must keep the ids in order")
        del out["d2t"], out["t2d"]
    return out


def export_draft(
    draft: Eagle3Draft,
    trained_aux_ids: list[int],
    shards,
    target_dir,
    out_dir,
    speculative_tokens: int = 3,
    dtype: str = "bfloat16",
    provenance: dict | None = None,
    layer_ids=None,
) -> dict:
    """Write the directory (atomically: built beside it, then renamed) and return its config.
    `layer_ids`: the capture plan's, when the draft was trained on streamed states (`shards`
    are then token shards); else the shards' own."""
    target_config = read_target_config(target_dir)
    num_layers = int(target_config["num_hidden_layers"])
    if layer_ids is not None:
        layout = layout_of(shards, layer_ids, num_layers)
    else:
        layout = read_layout(shards, num_layers)
    if list(trained_aux_ids) != layout.aux_ids:
        raise ValueError(
            f"the checkpoint was trained on aux ids {list(trained_aux_ids)}, "
            f"the shards hold {layout.aux_ids}"
        )
    if draft.cfg.num_aux != len(layout.aux_ids):
        raise ValueError(
            f"the draft fuses {draft.cfg.num_aux} aux states, the shards hold {len(layout.aux_ids)}"
        )
    if draft.cfg.vocab_size != int(target_config["vocab_size"]):
        raise ValueError(
            f"draft vocab {draft.cfg.vocab_size} != target vocab {target_config['vocab_size']}"
        )
    provenance = {
        "layer_ids": layout.layer_ids,
        "final_layer_id": layout.final_id,
        "shards": [Path(p).name for p in layout.paths],
        **(provenance or {}),
    }
    if draft.cfg.decoder == "mla":
        config = deepseek_eagle3_config(draft, layout.aux_ids, target_config, dtype, provenance)
    else:
        config = speculators_config(
            draft, layout.aux_ids, target_dir, target_config, speculative_tokens, dtype, provenance
        )
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(
        export_tensors(draft, getattr(torch, dtype)),
        str(tmp / "model.safetensors"),
        metadata={"format": "pt"},
    )
    with open(tmp / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return config
