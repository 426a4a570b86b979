"""Run vLLM 0.32's own MLA EAGLE-3 draft (`Eagle3DeepseekV2ForCausalLM`) on an exported MLA draft.

    python tests/support/vllm_mla_eagle3_reference.py <inputs.pt> <out.pt> <export dir>...

Builds the module as vLLM does for `speculative_config={"method": "eagle3", "model": DIR}`:
config.json read by vLLM's `get_config` (transformers' DeepseekV2Config, its rope parameters
standardised), wrapped in `EAGLEConfig(method="eagle3")` (which names the architecture);
weights through `Eagle3DeepseekV2ForCausalLM.load_weights` (`model.` prefix, q_a_proj and
kv_a_proj_with_mqa fused, gate/up stacked, `d2t` renamed, `t2d` skipped); vLLM's
`DeepseekV2MLAAttention` with its own projections, norms, rotary embedding (DeepSeek YaRN,
interleaved) and softmax scale. Only the paged MLA kernel (`MLAAttention`) is replaced, by a
plain cache of what vLLM's MLA cache holds (the normed latent and the rotated rope key per
token), expanded per head through vLLM's `kv_b_proj` as its prefill path does: a query sees
every cached token and the causal part of its own call. Then it drafts as vLLM's proposer
does (`vllm_eagle3_reference.draft_like_vllm`). Separate process: vLLM's distributed state is
process-global.
"""

import sys

import torch
from vllm_eagle3_reference import draft_like_vllm, loaded


class CachedMLA(torch.nn.Module):
    def __init__(
        self, num_heads, scale, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_b_proj, **_
    ):
        super().__init__()
        self.h, self.scale, self.kv_b_proj = num_heads, scale, kv_b_proj
        self.nope, self.rope, self.dv = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.latent = self.k_pe = None

    def forward(self, q, kv_c_normed, k_pe, output_shape=None, **_):
        n = q.shape[0]
        past = 0 if self.latent is None else self.latent.shape[0]
        k_pe = k_pe.reshape(n, self.rope)
        self.latent = kv_c_normed if self.latent is None else torch.cat([self.latent, kv_c_normed])
        self.k_pe = k_pe if self.k_pe is None else torch.cat([self.k_pe, k_pe])
        total = past + n
        kv = self.kv_b_proj(self.latent)[0].view(total, self.h, self.nope + self.dv)
        k_nope, v = kv.split([self.nope, self.dv], -1)
        k = torch.cat([k_nope, self.k_pe[:, None].expand(total, self.h, self.rope)], -1)
        q = q.view(n, self.h, -1).transpose(0, 1)  # [h, n, nope + rope]
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        visible = torch.arange(total)[None, :] <= (past + torch.arange(n))[:, None]
        scores = (q @ k.transpose(1, 2) * self.scale).masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores.float(), -1).to(q.dtype)
        return (probs @ v).transpose(0, 1).reshape(n, self.h * self.dv)


def build(export_dir: str, target_layers: int, target_vocab: int):
    import vllm.model_executor.layers.mla as vllm_mla
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig

    vllm_mla.MLAAttention = CachedMLA  # the only stand-in
    from vllm.model_executor.models.deepseek_eagle3 import Eagle3DeepseekV2ForCausalLM

    hf = EAGLEConfig(get_config(export_dir, trust_remote_code=False), method="eagle3")
    assert hf.architectures == ["Eagle3DeepseekV2ForCausalLM"], hf.architectures
    return loaded(Eagle3DeepseekV2ForCausalLM, hf, export_dir, target_layers, target_vocab), hf


def main():
    inputs, out, *export_dirs = sys.argv[1:]
    data = torch.load(inputs)
    results = []
    for export_dir in export_dirs:
        model, hf = build(export_dir, data["target_layers"], data["target_vocab"])
        attn = model.model.layers[0].self_attn
        results.append(
            {
                "logits": draft_like_vllm(model, data["aux"], data["tokens"]),
                "architectures": list(hf.architectures),
                "norm_before_residual": bool(getattr(hf, "norm_before_residual", False)),
                "fc_norm": bool(getattr(hf, "fc_norm", False)),
                "norm_output": bool(getattr(hf, "norm_output", False)),
                "draft_vocab_size": hf.draft_vocab_size,
                "scaling": attn.scaling,
                "rope_type": hf.rope_parameters["rope_type"],
                "rotary": type(attn.rotary_emb).__name__,
            }
        )
    torch.save(results, out)


if __name__ == "__main__":
    main()
