"""Run vLLM 0.32's own EAGLE-3 draft (`Eagle3LlamaForCausalLM`) on an exported draft directory.

    python tests/support/vllm_eagle3_reference.py <inputs.pt> <out.pt> <export dir>...

Builds the module exactly as vLLM does: config through `SpeculatorsConfig` (config.json),
weights through `Eagle3LlamaForCausalLM.load_weights` (model.safetensors: name mapping,
q/k/v and gate/up stacking, `d2t` -> `draft_id_to_target_id`), then the quant methods'
`process_weights_after_loading`. Only the paged attention kernel is replaced, by a plain
KV cache with the same semantics (each call appends its keys; a query sees every cached key
and the causal part of its own call). Then it drafts as vLLM's proposer does for one request:
step 0 over the whole prefix (`combine_hidden_states(aux)`, tokens shifted by one, positions
0..n-1), steps 1.. on the last position only with the previous step's pre-norm output, the
given token and position + 1; logits from `compute_logits` (target vocabulary, -inf outside
the draft vocabulary). Separate process: vLLM's distributed state is process-global.
"""

import sys
import tempfile
from types import SimpleNamespace as NS

import torch


class CachedAttention(torch.nn.Module):
    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, **_):
        super().__init__()
        self.h, self.d, self.scale = num_heads, head_size, scale
        self.kvh = num_kv_heads or num_heads
        self.k = self.v = None

    def forward(self, q, k, v, *_, **__):
        n, rep = q.shape[0], self.h // self.kvh
        q = q.view(n, self.h, self.d).transpose(0, 1)
        k = k.view(n, self.kvh, self.d).transpose(0, 1).repeat_interleave(rep, 0)
        v = v.view(n, self.kvh, self.d).transpose(0, 1).repeat_interleave(rep, 0)
        past = 0 if self.k is None else self.k.shape[1]
        self.k = k if self.k is None else torch.cat([self.k, k], 1)
        self.v = v if self.v is None else torch.cat([self.v, v], 1)
        visible = torch.arange(past + n)[None, :] <= (past + torch.arange(n))[:, None]
        scores = (q @ self.k.transpose(1, 2) * self.scale).masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores.float(), -1).to(q.dtype)
        return (probs @ self.v).transpose(0, 1).reshape(n, self.h * self.d)


_DISTRIBUTED = False


def build(export_dir: str, target_layers: int, target_vocab: int):
    import vllm.model_executor.models.llama as vllm_llama
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    vllm_llama.Attention = CachedAttention  # the only stand-in
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    hf = SpeculatorsConfig.from_pretrained(export_dir)
    return loaded(Eagle3LlamaForCausalLM, hf, export_dir, target_layers, target_vocab), hf


def loaded(model_class, hf, export_dir: str, target_layers: int, target_vocab: int):
    """`model_class` (a vLLM EAGLE-3 draft) built for `hf` under a one-rank vLLM config, with
    the export's weights loaded through its own `load_weights`, then the quant methods'
    `process_weights_after_loading`, as vLLM's loader does."""
    from safetensors.torch import load_file
    from vllm.config import CompilationMode, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    vc = VllmConfig()
    vc.compilation_config.mode = CompilationMode.NONE
    global _DISTRIBUTED
    if not _DISTRIBUTED:
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"file://{tempfile.mkdtemp()}/init",
        )
        with set_current_vllm_config(vc):
            initialize_model_parallel(1, 1)
        _DISTRIBUTED = True
    object.__setattr__(
        vc,
        "speculative_config",
        NS(draft_model_config=NS(hf_config=hf, quantization=None), parallel_drafting=False),
    )
    object.__setattr__(
        vc,
        "model_config",
        NS(
            dtype=torch.float32,
            head_dtype=torch.float32,
            get_vocab_size=lambda: target_vocab,
            get_total_num_hidden_layers=lambda: target_layers,
        ),
    )
    with set_current_vllm_config(vc):
        model = model_class(vllm_config=vc)
    weights = {
        k: (v.float() if v.is_floating_point() else v)
        for k, v in load_file(f"{export_dir}/model.safetensors").items()
    }
    model.load_weights(iter(weights.items()))
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
    return model


@torch.no_grad()
def draft_like_vllm(model, aux, tokens):
    """aux [n, n_aux*H] (target aux states at positions 0..n-1); tokens [steps, ...]: the
    token fed at step 0 for every position (tokens[0], length n: the prompt shifted by one),
    then the token fed at step k for the last position (tokens[k][-1])."""
    n, steps = aux.shape[0], tokens.shape[0]
    hidden, positions, ids = model.combine_hidden_states(aux), torch.arange(n), tokens[0]
    logits = []
    for k in range(steps):
        post, pre = model(ids, positions, hidden)
        logits.append(model.compute_logits(post[-1:])[0])
        if k + 1 < steps:
            ids, positions, hidden = tokens[k + 1, -1:], positions[-1:] + 1, pre[-1:]
    return torch.stack(logits)


def main():
    inputs, out, *export_dirs = sys.argv[1:]
    data = torch.load(inputs)
    results = []
    for export_dir in export_dirs:
        model, hf = build(export_dir, data["target_layers"], data["target_vocab"])
        results.append(
            {
                "logits": draft_like_vllm(model, data["aux"], data["tokens"]),
                "norm_before_residual": hf.norm_before_residual,
                "fc_norm": bool(getattr(hf, "fc_norm", False)),
                "norm_output": bool(getattr(hf, "norm_output", False)),
                "draft_vocab_size": hf.draft_vocab_size,
            }
        )
    torch.save(results, out)


if __name__ == "__main__":
    main()
