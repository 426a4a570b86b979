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

The MLA draft (`decoder="mla"`, `draft.architecture: mla`) is the same draft with the
attention of vLLM's `Eagle3DeepseekV2ForCausalLM` (`deepseek_eagle3.py`): `MLAAttention`,
named `layers.0.self_attn.{q_a_proj,q_a_layernorm,q_b_proj,kv_a_proj_with_mqa,
kv_a_layernorm,kv_b_proj,o_proj}`, its maths and conventions in `eagleflow.draft.mla`.

`embed_tokens.weight` is a frozen bf16 copy of the target's embedding (as the target stores
it). It is a non-persistent buffer: no gradient, no optimizer state, not sharded by FSDP, not
in `state_dict()` (a checkpoint reads it again from the target). `export_state_dict()` adds it
back for the speculators file, and `load_state_dict` still accepts it (exports, old
checkpoints).

Training-time test (`ttt_forward`): the draft is unrolled for several steps over a packed
sequence. Step k at anchor t reads token t+1+k, at position t+1+k, and the hidden state its
step k-1 produced at anchor t; its attention sees the step-0 keys of the anchor's causal
prefix (same sample) plus the keys steps 1..k wrote at the same anchor: exactly the KV cache
vLLM's drafter holds when it proposes the (k+1)-th token.

Attention (`attend`): softmax over [causal prefix keys of step 0 ; diagonal keys of steps
1..k]. `attention="flex"` computes the prefix part with a kernel that returns its output and
log-sum-exp and never holds an [N, N] tensor, then merges the k diagonal scores by log-sum-exp
(the same softmax, split in two):

    L   = logsumexp(lse0, s_1..s_k)      s_j = q . k_j / sqrt(d)   (anchor-wise)
    out = exp(lse0 - L) out0 + sum_j exp(s_j - L) v_j

The prefix kernel is `flex_attention` with a document-causal `BlockMask` (built once per pack,
reused by every TTT step), compiled once, on CUDA. torch 2.13 has no flex_attention backward on
CPU, so there the same maths runs blockwise in plain torch: per 128 queries, scores against the
keys from the start of the first query's sample (each block checkpointed, so only its output
and log-sum-exp are kept for backward). `attention="eager"` is the dense reference: [heads, N, N]
scores and an [N, N] mask.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint

from eagleflow.draft import mla
from eagleflow.target.info import draft_architecture_for

ATTENTION = ("flex", "eager")
ARCHITECTURES = ("llama", "mla")  # the decoder layer's attention: GQA, or MLA (`mla.py`)
AUTO = "auto"  # draft.architecture's default: the target decides (`draft_architecture_for`)
LATER_OPTIONS = ("fc_norm", "norm_output")  # architecture added after checkpoints existed
BLOCK = 128  # query/key block of the flex BlockMask and of the blockwise CPU kernel
FROZEN_DTYPE = torch.bfloat16  # the target's embedding, as the target stores it


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
    # "Eagle 3.1" (speculators PR #610; vLLM 0.32 loads both): an RMSNorm per aux state
    # before fc, and the next TTT step fed the final-normed hidden state
    fc_norm: bool = False
    norm_output: bool = False
    # "mla": the layer of vLLM's Eagle3DeepseekV2ForCausalLM (`eagleflow.draft.mla`), with
    # num_key_value_heads = heads and head_dim = nope + rope (k after kv_b_proj); "llama"
    # leaves the MLA keys None
    decoder: str = "llama"  # `draft.architecture`
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_scaling: dict | None = None  # MLA: DeepSeek YaRN keys (`mla.YARN_KEYS`), None: plain
    # How the forward is computed, not what it computes (`architecture()` leaves them out):
    attention: str = "flex"  # "flex" (no [N, N] tensor) or "eager" (dense, the reference)
    activation_checkpointing: bool = False  # recompute the decoder layer per TTT step

    def __post_init__(self):
        if self.attention not in ATTENTION:
            raise ValueError(f"attention {self.attention!r}: one of {', '.join(ATTENTION)}")
        if self.decoder not in ARCHITECTURES:
            raise ValueError(
                f"draft architecture {self.decoder!r}: one of {', '.join(ARCHITECTURES)}"
            )
        shape = {k: getattr(self, k) for k in mla.MLA_SHAPE_KEYS}
        if self.decoder == "llama":
            given = [k for k, v in shape.items() if v is not None]
            if given or self.rope_scaling is not None:
                raise ValueError(f"a llama draft has no MLA shape, but {given} are set")
            return
        missing = [k for k, v in shape.items() if not isinstance(v, int) or v <= 0]
        if missing:
            raise ValueError(f"an MLA draft needs a positive {missing[0]} (got {shape})")
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if (self.num_key_value_heads, self.head_dim) != (self.num_attention_heads, qk):
            raise ValueError(
                f"an MLA draft has num_key_value_heads = num_attention_heads and head_dim = "
                f"qk_nope_head_dim + qk_rope_head_dim ({self.num_attention_heads}, {qk}), not "
                f"({self.num_key_value_heads}, {self.head_dim})"
            )

    def rope(self) -> dict:
        """An MLA draft's rope, as `mla.deepseek_rotary` reads it."""
        return {
            "rope_type": "default",
            **(self.rope_scaling or {}),
            "rope_theta": self.rope_theta,
        }

    @classmethod
    def for_target(cls, target_config: dict, draft_vocab_size: int, num_aux: int, **overrides):
        """A draft sized after the target: its hidden size, heads of 64 (128 from H >= 2048);
        with `decoder="mla"`, the target's heads and MLA shape (`mla_shape_of`);
        `decoder="auto"`: the one `draft_architecture_for` the target gives."""
        if overrides.get("decoder") == AUTO:
            overrides = {**overrides, "decoder": draft_architecture_for(target_config)}
        if overrides.get("decoder") == "mla":
            overrides = {**mla_shape_of(target_config, overrides), **overrides}
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

    def architecture(self) -> dict:
        """The fields that decide what the weights mean (what a resume must match)."""
        d = self.to_dict()
        del d["attention"], d["activation_checkpointing"]
        if self.decoder == "llama":  # as a llama draft's checkpoint before MLA existed
            for key in ("decoder", *mla.MLA_SHAPE_KEYS, "rope_scaling"):
                del d[key]
        for key in LATER_OPTIONS:  # off: the draft of a checkpoint written before them
            if not d[key]:
                del d[key]
        return d


def mla_shape_of(target_config: dict, overrides: dict) -> dict:
    """The MLA draft's shape defaults: the target's heads, MLA dims and rope (its YaRN keys)
    where `overrides` does not set them. A target without MLA gives none: then every shape
    key must be set, or this refuses in one sentence naming the first one missing."""
    has_mla = "kv_lora_rank" in target_config
    missing = [k for k in mla.MLA_SHAPE_KEYS if overrides.get(k) is None]
    if not has_mla and missing:
        raise ValueError(
            f"draft.architecture mla on a target without MLA (no kv_lora_rank in its "
            f"config) needs every MLA shape key, and draft.{missing[0]} is not set"
        )
    if has_mla and "q_lora_rank" in missing and not target_config.get("q_lora_rank"):
        raise ValueError(
            "draft.architecture mla: the target has no q_lora_rank and vLLM 0.32's MLA draft "
            "needs one (it fuses q_a_proj with kv_a_proj_with_mqa): set draft.q_lora_rank"
        )
    values = {k: int(target_config[k]) for k in missing}
    heads = int(overrides.get("num_attention_heads") or target_config["num_attention_heads"])
    rope = mla.rope_parameters_of(target_config)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if not has_mla:  # no target convention to follow: plain rope at its theta
        scaling = {"rope_type": "default"}
    return {
        **values,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": int(overrides.get("qk_nope_head_dim") or values["qk_nope_head_dim"])
        + int(overrides.get("qk_rope_head_dim") or values["qk_rope_head_dim"]),
        "rope_theta": rope["rope_theta"],
        "rope_scaling": None if scaling["rope_type"] == "default" else scaling,
    }


def draft_config_for(target_config: dict, draft_vocab_size: int, num_aux: int, **overrides):
    """The one way a draft's config is made from its target's config.json (a wrapper's
    `text_config` read through): the trainer (`eagleflow.draft.weights.build_draft`), the
    check before launch and the job's memory plan (resources.smk) all call it, with the
    overrides `eagleflow.plan.settings.DraftModel` takes from `draft:`."""
    if "hidden_size" not in target_config:
        target_config = target_config["text_config"]
    return DraftConfig.for_target(target_config, draft_vocab_size, num_aux, **overrides)


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


def autocast_once(x):
    """`x` in autocast's dtype (when autocast is on): an input several Linears read is cast
    once, not once per Linear (autocast keeps every cast for backward)."""
    device = x.device.type
    return x.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else x


def apply_rotary(x, cos, sin):  # x [heads, N, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


# ---------------------------------------------------------------- who sees whom in a pack


@dataclass
class PackMask:
    """The document-causal mask of one packed sequence, built once for all TTT steps.

    A sample is a run of equal consecutive `doc` values. Query t sees key s of step 0 iff
    start[t] <= s <= t (same sample, causal). The queries are the pack's anchors
    [offset, offset + queries) (all of them, or one rank's slice: `draft.sequence_parallel`),
    the keys all N. Exactly one of `block_mask` (kernel "flex"), `dense` ([queries, N] bool,
    kernel "dense") is set, or neither (kernel "blockwise")."""

    kernel: str
    start: torch.Tensor  # [N] index of the first token of each token's sample
    segment: torch.Tensor  # [N] run index of each token's sample
    offset: int = 0  # the first query's index in the pack (a multiple of BLOCK when > 0)
    block_mask: BlockMask | None = None
    dense: torch.Tensor | None = None


def _samples(doc: torch.Tensor):
    """(segment, start) [N] each: the run index of every token and its run's first index."""
    change = torch.ones_like(doc, dtype=torch.bool)
    change[1:] = doc[1:] != doc[:-1]
    segment = torch.cumsum(change, 0) - 1
    return segment, torch.nonzero(change).flatten()[segment]


def _doc_causal(segment: torch.Tensor, offset: int):
    def mask_mod(b, h, q, kv):
        return (segment[q + offset] == segment[kv]) & (kv <= q + offset)

    return mask_mod


def doc_causal_block_mask(
    segment: torch.Tensor,
    start: torch.Tensor,
    block: int = BLOCK,
    offset: int = 0,
    queries: int | None = None,
):
    """The flex `BlockMask` of a pack, from its sample runs: per query block, the key blocks
    from its first query's sample start to the diagonal; a block is full (no mask_mod call)
    when it lies before the diagonal, inside one sample, and the query block is complete.
    Small [N/block]^2 tensors only (`create_block_mask` would evaluate an [N, N] grid).
    Queries [offset, offset + queries) of the N keys (offset: whole blocks)."""
    n = segment.numel()
    queries = n - offset if queries is None else queries
    nb = -(-n // block)
    qb = torch.arange(
        offset // block, offset // block + -(-queries // block), device=segment.device
    )
    q_end = torch.clamp((qb + 1) * block, max=offset + queries)
    first = start[qb * block] // block
    kb = torch.arange(nb, device=segment.device)[None, :]
    needed = (kb >= first[:, None]) & (kb <= qb[:, None])
    full = (
        needed
        & (kb < qb[:, None])
        & (segment[kb * block] == segment[q_end - 1][:, None])
        & (q_end - qb * block == block)[:, None]
    )
    partial = needed & ~full

    def blocks(m):
        count = m.sum(-1, dtype=torch.int32)[None, None]
        order = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True)
        return count, order.to(torch.int32)[None, None]

    return BlockMask.from_kv_blocks(
        *blocks(partial),
        *blocks(full),
        BLOCK_SIZE=block,
        mask_mod=_doc_causal(segment, offset),
        seq_lengths=(queries, n),
    )


def pack_mask(doc: torch.Tensor, kernel: str, offset: int = 0, queries: int | None = None):
    """kernel: "flex", "blockwise" or "dense" (see `kernel_for`); queries [offset, offset +
    queries) of the pack (all by default)."""
    segment, start = _samples(doc)
    queries = doc.numel() - offset if queries is None else queries
    mask = PackMask(kernel, start, segment, offset)
    if kernel == "flex":
        mask.block_mask = doc_causal_block_mask(segment, start, BLOCK, offset, queries)
    elif kernel == "dense":
        q = torch.arange(offset, offset + queries, device=doc.device)[:, None]
        k = torch.arange(doc.numel(), device=doc.device)[None, :]
        mask.dense = (k <= q) & (segment[None, :] == segment[q])
    return mask


def kernel_for(attention: str, device: torch.device) -> str:
    """flex_attention where it has a backward (CUDA), the blockwise twin elsewhere."""
    if attention == "eager":
        return "dense"
    return "flex" if device.type == "cuda" else "blockwise"


# ---------------------------------------------------------------- attention kernels


def _f32(x):
    """Scores and their log-sum-exp in at least fp32 (bf16 in, fp32 out; fp64 stays)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention)


def _flex_prefix(q, k, v, mask: PackMask, scale: float):
    """q [heads, N, d], k/v [kv_heads, N, d] -> out [heads, N, d], lse [heads, N] fp32."""
    fn = _compiled_flex() if q.is_cuda else flex_attention  # eager flex: CPU without grad
    out, aux = fn(
        q[None],
        k[None],
        v[None],
        block_mask=mask.block_mask,
        scale=scale,
        enable_gqa=True,
        return_aux=AuxRequest(lse=True),
    )
    return out[0], _f32(aux.lse[0])


def _prefix_block(q, k, v, segment, s: int, e: int, ks: int, offset: int, scale: float):
    """Local queries s..e-1 (pack anchors offset+s..offset+e-1) against keys ks..offset+e-1
    (ks: the first query's sample start)."""
    kvh, d, dv = k.shape[0], q.shape[-1], v.shape[-1]  # dv: MLA's v is narrower than q.k
    ke = offset + e
    qb = q[:, s:e].reshape(kvh, -1, e - s, d)  # (kv_heads, rep, b, d)
    scores = _f32(qb @ k[:, None, ks:ke].transpose(-1, -2)) * scale  # (kv, rep, b, L)
    qi = torch.arange(offset + s, ke, device=q.device)[:, None]
    ki = torch.arange(ks, ke, device=q.device)[None, :]
    visible = (ki <= qi) & (segment[ks:ke][None, :] == segment[offset + s : ke][:, None])
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse[..., None]).to(v.dtype) @ v[:, None, ks:ke]
    return out.reshape(q.shape[0], e - s, dv), lse.reshape(q.shape[0], e - s)


def _blockwise_prefix(q, k, v, mask: PackMask, scale: float):
    """The flex prefix in plain torch: per query block only its sample's keys; each block is
    checkpointed, so backward keeps its output and log-sum-exp, never its scores."""
    n = q.shape[1]
    starts = mask.start[mask.offset : mask.offset + n : BLOCK].tolist()
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    outs, lses = [], []
    for i, s in enumerate(range(0, n, BLOCK)):
        args = (q, k, v, mask.segment, s, min(s + BLOCK, n), starts[i], mask.offset, scale)
        if grad:
            out, lse = checkpoint(_prefix_block, *args, use_reentrant=False)
        else:
            out, lse = _prefix_block(*args)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def _dense(q, keys, mask: PackMask, scale: float):
    """The reference: dense [heads, N, N] scores over the step-0 keys plus the diagonal ones."""
    n = keys[0][0].shape[1]
    rep = q.shape[0] // keys[0][0].shape[0]
    keys = [(k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)) for k, v in keys]
    k0, v0 = keys[0]
    scores = [(q @ k0.transpose(1, 2) * scale).masked_fill(~mask.dense, float("-inf"))]
    scores += [(q * kj).sum(-1, keepdim=True) * scale for kj, _ in keys[1:]]
    probs = torch.softmax(_f32(torch.cat(scores, dim=-1)), dim=-1).to(q.dtype)
    out = probs[..., :n] @ v0
    for j, (_, vj) in enumerate(keys[1:]):
        out = out + probs[..., n + j : n + j + 1] * vj
    return out


def attend(q, keys, mask: PackMask, scale: float):
    """q [heads, n, d] (the queries of `mask`); keys [(k, v)]: keys[0] [kv_heads, N, d] the
    pack's step-0 keys, seen through `mask`; keys[1:] [kv_heads, n, d] on the diagonal
    (anchor t sees only its own entry); each v [kv_heads, *, dv] (MLA: dv != d). Returns
    [heads, n, dv]."""
    if mask.kernel == "dense":
        return _dense(q, keys, mask, scale)
    prefix = _flex_prefix if mask.kernel == "flex" else _blockwise_prefix
    out, lse0 = prefix(q, *keys[0], mask, scale)
    if len(keys) == 1:
        return out
    kvh, n, d = keys[-1][0].shape
    dv = keys[-1][1].shape[-1]
    qg = q.view(kvh, -1, n, d)  # (kv_heads, rep, N, d): GQA without repeating k/v
    diag = [(_f32((qg * k[:, None]).sum(-1)) * scale).view(-1, n) for k, _ in keys[1:]]
    total = torch.logsumexp(torch.stack([lse0, *diag]), dim=0)  # [heads, N]
    merged = torch.exp(lse0 - total)[..., None] * out
    for s, (_, v) in zip(diag, keys[1:]):
        w = torch.exp(s - total).view(kvh, -1, n, 1)
        merged = merged + (w * v[:, None]).view(-1, n, dv)
    return merged.to(q.dtype)


# ---------------------------------------------------------------- the draft


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
        self.rope_theta = cfg.rope_theta

    def rotary(self, positions):
        return rotary(positions, self.head_dim, self.rope_theta)

    def forward(self, x, cos, sin, past: tuple, mask: PackMask, split=None):
        """x [n, 2H]; past: the (k, v) of earlier TTT steps, each [kv_heads, n, d] (step 0's:
        the whole pack's, [kv_heads, N, d], gathered from the `split`'s ranks).
        Returns (out [n, H], this step's (k, v))."""
        n = x.shape[0]
        x = autocast_once(x)
        q = self.q_proj(x).view(n, self.heads, self.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = v.contiguous()
        if split is not None and not past:  # step 0: the prefix keys of the whole pack
            k, v = split.gather(k), split.gather(v)
        out = attend(q, (*past, (k, v)), mask, 1.0 / math.sqrt(self.head_dim))
        return self.o_proj(out.transpose(0, 1).reshape(n, self.heads * self.head_dim)), (k, v)


class MLAAttention(nn.Module):
    """vLLM's `DeepseekV2MLAAttention` on the 2H input (`eagleflow.draft.mla` has the maths
    and the conventions), over the same kernels as `Attention`: k and v are expanded per head
    from the latent (k [heads, N, nope + rope], v [heads, N, v_head_dim])."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.heads, self.nope, self.rope_dim = (
            cfg.num_attention_heads,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
        )
        self.v_dim, self.kv_lora = cfg.v_head_dim, cfg.kv_lora_rank
        h2, eps = 2 * cfg.hidden_size, cfg.rms_norm_eps
        qk = self.nope + self.rope_dim
        self.q_a_proj = nn.Linear(h2, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h2, self.kv_lora + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, eps)
        self.kv_b_proj = nn.Linear(self.kv_lora, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, cfg.hidden_size, bias=False)
        self.rope = cfg.rope()
        self.scale = mla.softmax_scale(qk, self.rope)

    def rotary(self, positions):
        return mla.deepseek_rotary(positions, self.rope_dim, self.rope)

    def forward(self, x, cos, sin, past: tuple, mask: PackMask, split=None):
        """As `Attention.forward`; cos/sin rotate the rope dims only."""
        n, h = x.shape[0], self.heads
        x = autocast_once(x)
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(n, h, -1).transpose(0, 1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope_dim], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(n, h, -1).transpose(0, 1)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)  # [heads, n, nope], [heads, n, v]
        q_nope, q_rope = q.split([self.nope, self.rope_dim], -1)
        q_rope = mla.apply_interleaved(q_rope, cos, sin)
        k_rope = mla.apply_interleaved(k_rope, cos, sin)[None].expand(h, n, self.rope_dim)
        q = torch.cat([q_nope, q_rope], -1)  # [heads, n, nope + rope]
        k = torch.cat([k_nope, k_rope.to(k_nope.dtype)], -1)
        v = v.contiguous()
        if split is not None and not past:  # step 0: the prefix keys of the whole pack
            k, v = split.gather(k), split.gather(v)
        out = attend(q, (*past, (k, v)), mask, self.scale)  # [heads, n, v]
        return self.o_proj(out.transpose(0, 1).reshape(n, h * self.v_dim)), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        x = autocast_once(x)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg) if cfg.decoder == "mla" else Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, embeds, hidden, cos, sin, past: tuple, mask: PackMask, split=None):
        """A pure function of its inputs (so it can be recomputed): (next hidden, (k, v))."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        attn, kv = self.self_attn(x, cos, sin, past, mask, split)
        h = residual + attn
        return h + self.mlp(self.post_attention_layernorm(h)), kv


def _take_weight(module, state_dict, prefix, *args):
    weight = state_dict.pop(prefix + "weight", None)  # an export, or an old checkpoint
    if weight is not None:
        with torch.no_grad():
            module.weight.copy_(weight)


class FrozenEmbedding(nn.Module):
    """The target's input embedding as a non-persistent bf16 buffer named `weight`."""

    def __init__(self, rows: int, size: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(rows, size, dtype=FROZEN_DTYPE), False)
        self.register_load_state_dict_pre_hook(_take_weight)

    def _apply(self, fn, recurse=True):
        """`.to(device)` moves it; a dtype cast of the model (`.double()`, `.to(bf16)`) does
        not change it: the copy stays bf16."""
        super()._apply(fn, recurse)
        self.weight = self.weight.to(FROZEN_DTYPE)
        return self

    def forward(self, tokens):
        return F.embedding(tokens, self.weight)


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = FrozenEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.fc_norm = None
        if cfg.fc_norm:
            norms = [RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_aux)]
            self.fc_norm = nn.ModuleList(norms)
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
        """Copy the target's embedding in (held in bf16, the target's own dtype)."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)

    def export_state_dict(self) -> dict:
        """`state_dict()` plus the frozen embedding: every tensor of the speculators file."""
        return {"embed_tokens.weight": self.embed_tokens.weight, **self.state_dict()}

    def forward(self, aux, tokens, positions, doc, steps: int, split=None):
        return self.ttt_forward(aux, tokens, positions, doc, steps, split)

    def ttt_forward(self, aux, tokens, positions, doc, steps: int, split=None):
        """Unrolled draft over one packed sequence of N anchors, or over slice `split.part`
        of it (n = N / split.parts anchors; `eagleflow.train.sequence_parallel`).

        aux [n, n_aux*H] (aux states at anchor t); tokens [steps, n] (token read at step k,
        i.e. token t+1+k); positions [n] (position of token t+1); doc [N] sample index of
        every anchor of the pack (a sample is a run of equal consecutive values). Returns
        the draft-vocabulary logits of every step, each [n, draft_vocab].
        """
        n = aux.shape[0]
        offset = split.offset(n) if split is not None else 0
        mask = pack_mask(doc, kernel_for(self.cfg.attention, aux.device), offset, n)
        hidden = self.fuse(aux)
        past: tuple = ()
        logits = []
        layer = self.layers[0]
        rotary = layer.self_attn.rotary
        recompute = self.cfg.activation_checkpointing and torch.is_grad_enabled()
        for k in range(steps):
            cos, sin = rotary(positions + k)
            embeds = self.embed_tokens(tokens[k]).to(hidden.dtype)
            args = (embeds, hidden, cos, sin, past, mask, split)
            if recompute:  # keep the layer's inputs, recompute the rest in backward
                hidden, kv = checkpoint(layer, *args, use_reentrant=False)
            else:
                hidden, kv = layer(*args)
            past = (*past, kv)
            normed = self.norm(hidden)
            logits.append(self.lm_head(normed))
            if self.cfg.norm_output:  # vLLM's norm_output: the next step reads it normed
                hidden = normed
        return logits

    def fuse(self, aux):
        """fc over the aux states (each RMS-normed first with `fc_norm`)."""
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)
