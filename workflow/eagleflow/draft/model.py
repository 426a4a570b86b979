"""The EAGLE-3 draft, laid out exactly as vLLM 0.32 loads it (`llama_eagle3.py`).

    fused  = fc(cat(aux states))                      n_aux*H -> H (step 0 only)
    x      = cat(input_layernorm(embed(token)), hidden_norm(hidden))      2H
    h      = residual + o_proj(attn(q/k/v_proj(x)))   residual = hidden (or hidden_norm(hidden)
                                                      with norm_before_residual)
    h      = h + mlp(post_attention_layernorm(h))     -> the next step's hidden (pre-norm)
    logits = lm_head(norm(h))                         over the draft vocabulary

Parameter names are the speculators checkpoint names (`embed_tokens.weight`, `fc.weight`,
`layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`layers.0.self_attn.{q,k,v,o}_proj.weight`, `layers.0.mlp.{gate,up,down}_proj.weight`,
`norm.weight`, `lm_head.weight`, `d2t`, `t2d`). vLLM's `Eagle3LlamaForCausalLM.load_weights`
prefixes `model.` to all but `lm_head`, renames `d2t` to `draft_id_to_target_id`, skips
`t2d`, and stacks q/k/v into `qkv_proj` and gate/up into `gate_up_proj`.

Training-time test (`ttt_forward`): the draft is unrolled for several steps over a packed
sequence. Step k at anchor t reads token t+1+k, at position t+1+k, and the hidden state its
step k-1 produced at anchor t; its attention sees the step-0 keys of the anchor's causal
prefix (same sample) plus the keys steps 1..k wrote at the same anchor: exactly the KV cache
vLLM's drafter holds when it proposes the (k+1)-th token.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DraftConfig:
    hidden_size: int  # = the target's hidden size
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary (embedding rows)
    draft_vocab_size: int  # lm_head rows
    num_aux: int  # aux hidden states fused by fc
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    norm_before_residual: bool = True  # speculators' and vLLM's default for eagle3

    @classmethod
    def for_target(cls, target_config: dict, draft_vocab_size: int, num_aux: int, **overrides):
        """A draft sized after the target: its hidden size, heads of 64 (128 from H >= 2048)."""
        hidden = int(target_config["hidden_size"])
        head_dim = 128 if hidden >= 2048 else 64
        heads = max(1, hidden // head_dim)
        rope = target_config.get("rope_parameters") or {}
        values = dict(
            hidden_size=hidden,
            intermediate_size=int(target_config.get("intermediate_size") or 4 * hidden),
            num_attention_heads=heads,
            num_key_value_heads=min(heads, 8),
            head_dim=head_dim,
            vocab_size=int(target_config["vocab_size"]),
            draft_vocab_size=int(draft_vocab_size),
            num_aux=int(num_aux),
            rms_norm_eps=float(target_config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", target_config.get("rope_theta", 10000.0))),
            max_position_embeddings=int(target_config.get("max_position_embeddings", 2048)),
        )
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary(positions: torch.Tensor, head_dim: int, theta: float):
    """cos, sin [N, head_dim] for vLLM's neox-style rotary embedding (Llama default)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x, cos, sin):  # x [heads, N, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        h2 = 2 * cfg.hidden_size  # the first (only) layer reads cat(embeds, hidden)
        self.q_proj = nn.Linear(h2, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h2, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h2, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, cache: list, prefix_mask: torch.Tensor):
        """x [N, 2H]; appends this step's (k, v) to `cache`; cache[0] is attended causally
        (`prefix_mask` [N, N], True = visible), later entries on the diagonal only."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.heads, self.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
        cache.append((k, v))
        scale = 1.0 / math.sqrt(self.head_dim)
        k0, v0 = cache[0]
        scores = [(q @ k0.transpose(1, 2) * scale).masked_fill(~prefix_mask, float("-inf"))]
        scores += [(q * kj).sum(-1, keepdim=True) * scale for kj, _ in cache[1:]]
        probs = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
        out = probs[..., :n] @ v0
        for j, (_, vj) in enumerate(cache[1:]):
            out = out + probs[..., n + j : n + j + 1] * vj
        return self.o_proj(out.transpose(0, 1).reshape(n, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, embeds, hidden, cos, sin, cache, prefix_mask):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        h = residual + self.self_attn(x, cos, sin, cache, prefix_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # a frozen copy of the target's
        self.fc = nn.Linear(cfg.num_aux * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(
                f"vocab maps {tuple(d2t.shape)}/{tuple(t2d.shape)} do not fit "
                f"the draft ({self.cfg.draft_vocab_size}/{self.cfg.vocab_size})"
            )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def set_embedding(self, weight: torch.Tensor) -> None:
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)

    def forward(self, aux, tokens, positions, doc, steps: int):
        return self.ttt_forward(aux, tokens, positions, doc, steps)

    def ttt_forward(self, aux, tokens, positions, doc, steps: int):
        """Unrolled draft over one packed sequence of N anchors.

        aux [N, n_aux*H] (aux states at anchor t); tokens [steps, N] (token read at step k,
        i.e. token t+1+k); positions [N] (position of token t+1); doc [N] sample index.
        Returns the draft-vocabulary logits of every step, each [N, draft_vocab].
        """
        n = aux.shape[0]
        idx = torch.arange(n, device=aux.device)
        prefix_mask = (idx[None, :] <= idx[:, None]) & (doc[None, :] == doc[:, None])
        hidden = self.fc(aux)
        cache: list = []
        logits = []
        layer = self.layers[0]
        for k in range(steps):
            cos, sin = rotary(positions + k, self.cfg.head_dim, self.cfg.rope_theta)
            embeds = self.embed_tokens(tokens[k])
            hidden = layer(embeds, hidden, cos, sin, cache, prefix_mask)
            logits.append(self.lm_head(self.norm(hidden)))
        return logits
