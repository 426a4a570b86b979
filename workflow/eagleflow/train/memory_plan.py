"""Per-device memory of draft training, computed before any GPU is touched.

The draft is built on the meta device at the target's real shape, so its parameter and buffer
counts are the model's own. The rest are byte counts of what training holds per device, with
P trainable parameters, W ranks (FSDP2 over all of them), N tokens per pack (`max_tokens`)
and per device (under sequence splitting over R ranks, `draft.sequence_parallel`: N / R,
rounded up to a block, plus the pack's step-0 keys and values, 2 N_pack kv a),
S TTT steps, a bytes per activation (bf16 autocast on CUDA: 2; fp32 on CPU: 4) and f = 4:

    params       4P / W     fp32 master weights, sharded
    grads        4P / W     fp32, sharded
    optimizer    8P / W     AdamW's two moments, fp32, sharded (Muon keeps one: a bound)
    working      aP         autocast's bf16 copies of the weights (on CUDA), plus, when W > 1,
                 + 8P       the unsharded fp32 weights and gradients FSDP holds while it
                            computes (the layer is gathered per use, the root module for the
                            whole step: the worst case has all of them at once)
    frozen                  the draft's buffers as the meta model has them (the bf16 embedding,
                            d2t, t2d), plus the target's head over the draft vocabulary (bf16
                            rows, fp32 norm): replicated on every rank
    inputs       N (n_aux + 1) H a          the pack's states (aux, final) on the device
    activations  N (S step_full + backward)                    without checkpointing
                 N (S step_ckpt + step_full + backward)        with checkpointing (one step
                                                               recomputed at a time)
                 backward = max(step_full, workspace): one step's gradients, or the
                 attention kernel's workspace, at a time
    loss         N Vd (8 S + 8)

What one TTT step keeps for backward, per token (H hidden, I intermediate, q = heads x
head_dim, kv = kv_heads x head_dim, d = head_dim, Vd draft vocabulary):

    step_full = H (5a + 6f)   cat(embed, hidden) and the other Linear inputs; the residual
                              stream and the RMSNorms' fp32 inputs and outputs
              + 3 q a         q after RoPE, the attention output, the o_proj input
              + 2 kv a        k after RoPE, v (also the later steps' keys)
              + 2 d f         RoPE cos, sin
              + 4 I a         MLP gate, up, silu(gate), their product
              + Vd a          the draft logits (the loss holds them)
              [+ heads (N + S)(f + a)   attention "eager": the [heads, N, N + S] softmax]
    step_ckpt = H (2a + 2f) + 2 kv a + 2 d f + Vd a
                              the layer's inputs (embed, hidden) and outputs (k, v, the next
                              hidden), the final norm's and lm_head's inputs, the logits
    workspace = heads BLOCK f 3   the CPU's blockwise kernel (one query block's scores);
                heads (N + S) f 2 the eager reference; 0 for flex_attention (its workspace
                is not counted)

The MLA draft (`draft.architecture: mla`) replaces the attention terms: its k and v are
expanded per head from the latent (kv = heads x (nope + rope) for k, vw = heads x v_head_dim
for v; o = heads x v_head_dim), and the low-rank paths keep their own tensors
(ql = q_lora_rank, kl = kv_lora_rank, r = qk_rope_head_dim):

    attention = ql (a + 2f)        q_a_proj's output, q_a_layernorm's normed fp32 input
                                   and its output (q_b_proj's input)
              + (kl + r) a + 2 kl f        kv_a_proj_with_mqa's output, kv_a_layernorm's
              + q a                        q after RoPE (q_b_proj's and kv_b_proj's outputs
                                           are split and copied, not kept)
              + kv a + vw a + 2 o a        k, v (also the later steps' keys), the attention
                                           output and o_proj's input
              + 2 r f                      RoPE cos, sin
    (step_ckpt keeps kv a + vw a + 2 r f of it)

The loss (`draft.train.ttt_loss`) keeps the draft's fp32 log-probabilities and the target's
fp32 probabilities per step (8 Vd), and forms the target's fp32 logits and log-probabilities
once (8 Vd; its gradients take their place in backward). On CPU, a tiny draft's measured peak
(every tensor its forward, loss and backward create) is within 20% of these terms
(tests/test_memory_plan.py). Not modelled: the CUDA context, NCCL buffers and allocator
fragmentation, for which `HEADROOM` of the device is kept free.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from eagleflow.draft.model import BLOCK, DraftConfig, Eagle3Draft, kernel_for
from eagleflow.train.sequence_parallel import slice_length

GB = 2**30  # GiB, as torch.cuda and nvidia-smi count a device's memory
HEADROOM = 0.10  # share of the device kept free for what is not modelled
F32 = 4
COMPUTE_BYTES = {"cuda": 2, "cpu": 4}  # the trainer autocasts to bf16 on CUDA only
BLOCKWISE_COPIES = 3  # fp32 [heads, BLOCK, N] tensors a block of the CPU kernel holds at once
DENSE_COPIES = 2  # and [heads, N, N] ones of the eager reference, beyond the kept softmax
TOKEN_STEP = 256  # a suggested max_tokens is a multiple of this
PARTS = ("params", "grads", "optimizer", "working", "frozen", "inputs", "activations", "loss")
HEAD_BYTES = 2  # the trainer's TargetHead rows: bf16


@dataclass(frozen=True)
class Workload:
    """What a rank trains at once."""

    max_tokens: int  # N: tokens per pack
    ttt_steps: int  # S
    world_size: int = 1  # ranks sharing the FSDP state (nodes x processes_per_node)
    device_type: str = "cuda"  # cuda: bf16 autocast, flex_attention; cpu: fp32, blockwise
    sequence_parallel: int = 1  # ranks sharing one pack, each a slice of its tokens

    @property
    def device_tokens(self) -> int:
        """Anchors one device computes: the pack, or its slice."""
        return slice_length(self.max_tokens, self.sequence_parallel)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device, by part."""

    workload: Workload
    activation_checkpointing: bool
    attention: str
    trainable_params: int
    params: int
    grads: int
    optimizer: int
    working: int
    frozen: int
    inputs: int
    activations: int
    loss: int
    device_bytes: int | None = None  # None: no limit known (CPU)

    @property
    def total(self) -> int:
        return sum(getattr(self, p) for p in PARTS)

    @property
    def usable(self) -> float | None:
        return None if self.device_bytes is None else self.device_bytes * (1 - HEADROOM)

    @property
    def fits(self) -> bool:
        return self.usable is None or self.total <= self.usable

    def describe(self) -> str:
        w = self.workload
        parts = ", ".join(f"{p} {getattr(self, p) / GB:.1f}" for p in PARTS)
        limit = "" if self.device_bytes is None else f" of {self.device_bytes / GB:.1f}"
        split = ""
        if w.sequence_parallel > 1:
            split = f" ({w.device_tokens} per device over {w.sequence_parallel} ranks)"
        return (
            f"draft memory plan: {self.total / GB:.1f}{limit} GiB per device "
            f"({parts}) for {self.trainable_params / 1e6:.0f}M trainable parameters, "
            f"{w.max_tokens} tokens{split}, {w.ttt_steps} TTT steps, {w.world_size} ranks, "
            f"activation checkpointing {'on' if self.activation_checkpointing else 'off'}"
        )


class MemoryPlanError(ValueError):
    pass


def meta_draft(cfg: DraftConfig) -> Eagle3Draft:
    """The draft at its real shape, without memory."""
    with torch.device("meta"):
        return Eagle3Draft(cfg)


def step_bytes(cfg: DraftConfig, workload: Workload) -> tuple[int, int, int]:
    """(step_full, step_ckpt, workspace): bytes per token that one TTT step keeps for
    backward, without and with activation checkpointing, and the attention kernel's own."""
    a = COMPUTE_BYTES[workload.device_type]
    h, d, heads = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    q, kv = heads * d, cfg.num_key_value_heads * d
    if cfg.decoder == "mla":
        ql, kl, r = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        vw = heads * cfg.v_head_dim  # v and the attention output (o) are this wide
        kept = kv * a + vw * a + 2 * r * F32  # k, v and RoPE's cos, sin
        attention = ql * (a + 2 * F32) + (kl + r) * a + 2 * kl * F32
        attention += q * a + 2 * vw * a + kept
    else:
        kept = 2 * kv * a + 2 * d * F32
        attention = 3 * q * a + kept
    full = h * (5 * a + 6 * F32) + attention
    full += 4 * cfg.intermediate_size * a + cfg.draft_vocab_size * a
    ckpt = h * (2 * a + 2 * F32) + kept + cfg.draft_vocab_size * a
    kernel = kernel_for(cfg.attention, torch.device(workload.device_type))
    workspace = 0
    if kernel == "dense":  # the [heads, N, N + S] softmax, fp32 and in the compute dtype
        scores = heads * (workload.max_tokens + workload.ttt_steps)
        full += scores * (F32 + a % F32)
        workspace = scores * F32 * DENSE_COPIES
    elif kernel == "blockwise":
        workspace = heads * BLOCK * F32 * BLOCKWISE_COPIES
    return full, ckpt, workspace


def plan_memory(cfg: DraftConfig, workload: Workload, device_bytes: int | None = None):
    """The `MemoryPlan` of training `cfg` (its `attention` and `activation_checkpointing`
    included) on `workload`; `device_bytes`: the device's memory (None: no limit)."""
    model = meta_draft(cfg)
    p = sum(t.numel() for t in model.parameters() if t.requires_grad)
    buffers = sum(t.numel() * t.element_size() for t in model.buffers())
    a = COMPUTE_BYTES[workload.device_type]
    n, s, w = workload.device_tokens, workload.ttt_steps, workload.world_size
    kv = cfg.num_key_value_heads * cfg.head_dim
    kv += cfg.num_attention_heads * cfg.v_head_dim if cfg.decoder == "mla" else kv  # + v
    gathered = workload.max_tokens * kv * a if workload.sequence_parallel > 1 else 0
    full, ckpt, workspace = step_bytes(cfg, workload)
    backward = max(full, workspace)  # one step's gradients, or the kernel's workspace
    if cfg.activation_checkpointing:  # and the step being recomputed
        per_token = s * ckpt + full + backward
    else:
        per_token = s * full + backward
    head = cfg.draft_vocab_size * cfg.hidden_size * HEAD_BYTES + cfg.hidden_size * F32
    return MemoryPlan(
        workload=workload,
        activation_checkpointing=cfg.activation_checkpointing,
        attention=cfg.attention,
        trainable_params=p,
        params=-(-4 * p // w),
        grads=-(-4 * p // w),
        optimizer=-(-8 * p // w),
        working=(a * p if a != F32 else 0) + (8 * p if w > 1 else 0),
        frozen=buffers + head,
        inputs=n * (cfg.num_aux + 1) * cfg.hidden_size * a,
        activations=n * per_token + gathered,
        loss=n * cfg.draft_vocab_size * (8 * s + 8),
        device_bytes=device_bytes,
    )


def _advice(cfg: DraftConfig, plan: MemoryPlan) -> str:
    """The one change that makes the plan fit, as a phrase naming its config key."""
    w = plan.workload

    def fits(cfg_=cfg, **changes) -> bool:
        return plan_memory(cfg_, replace(w, **changes), plan.device_bytes).fits

    if not cfg.activation_checkpointing and fits(replace(cfg, activation_checkpointing=True)):
        return "set draft.activation_checkpointing: true"
    for parts in range(w.sequence_parallel + 1, w.world_size + 1):
        if w.world_size % parts == 0 and fits(sequence_parallel=parts):
            return f"set draft.sequence_parallel: {parts} (ranks that share a pack)"
    for ranks in (2 * w.world_size, 4 * w.world_size, 8 * w.world_size):
        if fits(world_size=ranks):
            return f"train on {ranks} ranks (draft.nodes x draft.processes_per_node)"
    if fits(max_tokens=TOKEN_STEP):  # the largest multiple of TOKEN_STEP that fits
        lo, hi = 1, w.max_tokens // TOKEN_STEP
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(max_tokens=mid * TOKEN_STEP) else (lo, mid - 1)
        return f"lower draft.max_tokens to {lo * TOKEN_STEP}"
    for steps in range(w.ttt_steps - 1, 0, -1):
        if fits(max_tokens=TOKEN_STEP, ttt_steps=steps):
            return f"lower draft.ttt_steps to {steps} and draft.max_tokens"
    return "no draft.max_tokens fits, so train on devices with more memory (draft.device_memory_gb)"


def check_plan(cfg: DraftConfig, plan: MemoryPlan) -> MemoryPlan:
    """`plan`, or a `MemoryPlanError` whose message is one sentence naming the key to change."""
    if plan.fits:
        return plan
    w = plan.workload
    raise MemoryPlanError(
        f"Draft training needs {plan.total / GB:.1f} GiB per device ({plan.activations / GB:.1f}"
        f" GiB activations, {plan.loss / GB:.1f} GiB loss at draft.max_tokens {w.max_tokens} "
        f"and draft.ttt_steps {w.ttt_steps}) where {plan.usable / GB:.1f} of the device's "
        f"{plan.device_bytes / GB:.1f} GiB are usable: {_advice(cfg, plan)}."
    )


def device_memory(device_memory_gb: float | None, device: torch.device) -> int | None:
    """Bytes of one device: `draft.device_memory_gb` when set, else CUDA's own figure, else
    None (CPU: no limit is checked)."""
    if device_memory_gb:
        return int(device_memory_gb * GB)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


def check_memory(draft_cfg, cfg, pack_tokens: int, world: int, device, log) -> MemoryPlan:
    """Refuse, before the device is touched, a run whose largest pack (its slice per rank,
    under sequence splitting) cannot fit; the plan goes to the log. `cfg`: the TrainConfig."""
    workload = Workload(pack_tokens, cfg.ttt_steps, world, device.type, cfg.sequence_parallel)
    plan = plan_memory(draft_cfg, workload, device_memory(cfg.device_memory_gb or None, device))
    log(plan.describe())
    try:
        return check_plan(draft_cfg, plan)
    except ValueError as e:
        if pack_tokens > cfg.max_tokens:  # the pack of the longest sample, not max_tokens
            raise type(e)(
                f"{str(e).rstrip('.')}, or set draft.max_sample_tokens below the longest "
                f"training sample ({pack_tokens} tokens, trained as a pack of its own)."
            ) from None
        raise
