"""The draft's attention kernels against the dense reference, on CPU with tiny shapes.

"flex" on CPU runs the blockwise kernel (torch 2.13 has no flex_attention backward there);
flex_attention itself, with the pack's BlockMask, is checked through its eager (dense maths)
implementation, which is what the CUDA kernel is tested against upstream.
"""

import pytest
import torch
from torch.nn.attention import flex_attention as fa
from torch.utils._python_dispatch import TorchDispatchMode

from eagleflow.draft.model import (
    BLOCK,
    DraftConfig,
    Eagle3Draft,
    attend,
    doc_causal_block_mask,
    pack_mask,
)
from support.draft_fixtures import SPECULATORS_NAMES

H, V, DV = 32, 64, 24
STEPS = 3
SHAPE = dict(
    hidden_size=H,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=V,
    draft_vocab_size=DV,
    num_aux=3,
)
# An MLA draft (vLLM's Eagle3DeepseekV2ForCausalLM layer): q.k over nope + rope = 16 dims,
# v of 12, DeepSeek's YaRN (its softmax mscale and cos/sin magnitude both away from 1).
MLA_SHAPE = dict(
    SHAPE,
    num_key_value_heads=4,
    decoder="mla",
    q_lora_rank=24,
    kv_lora_rank=20,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    rope_scaling=dict(
        rope_type="yarn",
        factor=40.0,
        original_max_position_embeddings=64,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=0.7,
    ),
)
MLA_PARAMETERS = {
    "fc.weight",
    "layers.0.input_layernorm.weight",
    "layers.0.hidden_norm.weight",
    "layers.0.post_attention_layernorm.weight",
    *(
        f"layers.0.self_attn.{name}.weight"
        for name in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa")
        + ("kv_a_layernorm", "kv_b_proj", "o_proj")
    ),
    *(f"layers.0.mlp.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")),
    "norm.weight",
    "lm_head.weight",
}


def draft(attention="flex", checkpointing=False, dtype=torch.float64, seed=0, shape=SHAPE):
    cfg = DraftConfig(**shape, attention=attention, activation_checkpointing=checkpointing)
    torch.manual_seed(seed)
    m = Eagle3Draft(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    m.set_embedding(torch.randn(V, H, generator=g))
    with torch.no_grad():  # non-trivial norms, so every placement shows in the gradients
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return m.to(dtype)


def pack(lengths, seed=1, dtype=torch.float64, steps=STEPS):
    """A packed sequence of samples of `lengths` tokens (positions restart per sample)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    doc = torch.cat([torch.full((n_i,), i) for i, n_i in enumerate(lengths)])
    positions = torch.cat([torch.arange(n_i) + 1 for n_i in lengths])
    aux = torch.randn(n, 3 * H, generator=g, dtype=dtype)
    tokens = torch.randint(0, V, (steps, n), generator=g)
    return aux, tokens, positions, doc


def loss_and_grads(m, batch):
    logits = m(*batch, STEPS)
    g = torch.Generator().manual_seed(5)
    loss = sum((lg * torch.randn(lg.shape, generator=g, dtype=lg.dtype)).sum() for lg in logits)
    m.zero_grad()
    loss.backward()
    return logits, {n: p.grad.clone() for n, p in m.named_parameters()}


# Samples crossing block boundaries, one of a single token, one longer than a block.
LENGTHS = [150, 40, 1, 109, 300]


def test_flex_equals_eager_forward_and_gradients():
    batch = pack(LENGTHS)
    ref_logits, ref_grads = loss_and_grads(draft("eager"), batch)
    logits, grads = loss_and_grads(draft("flex"), batch)
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    assert grads.keys() == ref_grads.keys() and len(grads) == 13
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-8, atol=1e-10)


def test_mla_flex_equals_eager_forward_and_gradients():
    """The MLA draft: the blockwise kernel (flex on CPU) equals the dense reference in the
    logits of every step and in the gradient of every parameter (q.k over 16 dims, v 12)."""
    batch = pack(LENGTHS)
    ref_logits, ref_grads = loss_and_grads(draft("eager", shape=MLA_SHAPE), batch)
    logits, grads = loss_and_grads(draft("flex", shape=MLA_SHAPE), batch)
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    assert grads.keys() == ref_grads.keys() == MLA_PARAMETERS
    for name in grads:
        assert grads[name].abs().sum() > 0, name
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("shape", [SHAPE, MLA_SHAPE], ids=["llama", "mla"])
def test_each_sample_of_a_pack_equals_that_sample_alone_at_every_step(shape):
    m = draft("flex", shape=shape)
    aux, tokens, positions, doc = pack(LENGTHS)
    with torch.no_grad():
        packed = m(aux, tokens, positions, doc, STEPS)
        s = 0
        for n_i in LENGTHS:
            alone = m(aux[s : s + n_i], tokens[:, s : s + n_i], positions[s : s + n_i],
                      doc[s : s + n_i], STEPS)  # fmt: skip
            for k in range(STEPS):
                torch.testing.assert_close(alone[k], packed[k][s : s + n_i], rtol=1e-9, atol=1e-10)
            s += n_i


def _qkv(n, seed=3, kv_heads=2, dv=16):
    """q [4, n, 16]; per step (k [kv_heads, n, 16], v [kv_heads, n, dv]): GQA by default,
    MLA's shape with kv_heads=4 (one k and v per head) and dv != 16."""
    g = torch.Generator().manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)

    q = leaf(4, n, 16)
    keys = [(leaf(kv_heads, n, 16), leaf(kv_heads, n, dv)) for _ in range(STEPS)]
    return q, keys


def _attend_grads(q, keys, mask):
    out = attend(q, keys, mask, 0.25)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    leaves = [q, *(t for kv in keys for t in kv)]
    return out, torch.autograd.grad((out * w).sum(), leaves)


KV_SHAPES = pytest.mark.parametrize(
    "kv_heads,dv", [(2, 16), (4, 12)], ids=["gqa", "mla-v-narrower"]
)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@KV_SHAPES
def test_flex_attention_kernel_with_the_pack_block_mask_equals_eager(monkeypatch, kv_heads, dv):
    """The CUDA path's maths on CPU: flex_attention with the pack's BlockMask returning its
    log-sum-exp, merged with the diagonal keys; forward, and gradients through the lse (the
    CPU device check is lifted so flex runs its eager backward). GQA, and MLA's v narrower
    than q.k."""
    aux, tokens, positions, doc = pack(LENGTHS)
    n = doc.numel()
    q, keys = _qkv(n, kv_heads=kv_heads, dv=dv)
    flex, dense = pack_mask(doc, "flex"), pack_mask(doc, "dense")
    q0, keys0 = q.detach(), [(k.detach(), v.detach()) for k, v in keys]  # no backward: allowed
    torch.testing.assert_close(
        attend(q0, keys0, flex, 0.25), attend(q0, keys0, dense, 0.25), rtol=1e-10, atol=1e-12
    )
    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
    out, grads = _attend_grads(q, keys, flex)
    ref_out, ref_grads = _attend_grads(q, keys, dense)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_block_mask_from_sample_runs_equals_create_block_mask():
    doc = torch.cat([torch.full((n_i,), i) for i, n_i in enumerate([300, 40, 1, 109, 262])])
    mask = pack_mask(doc, "flex")
    n = doc.numel()

    def mask_mod(b, h, q, kv):
        return (doc[q] == doc[kv]) & (kv <= q)

    ref = fa.create_block_mask(mask_mod, None, None, n, n, device="cpu", BLOCK_SIZE=BLOCK)
    ours = doc_causal_block_mask(mask.segment, mask.start)
    assert ours.shape == ref.shape == (1, 1, n, n)
    for a, b in ((ours.kv_num_blocks, ref.kv_num_blocks),
                 (ours.full_kv_num_blocks, ref.full_kv_num_blocks)):  # fmt: skip
        assert torch.equal(a, b)
    assert torch.equal(ours.to_dense(), ref.to_dense())
    assert int(ours.full_kv_num_blocks.sum()) > 0  # the 300-token sample has full blocks


class LargestTensor(TorchDispatchMode):
    """The largest number of elements of any tensor an op produced (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def saved_bytes(fn):
    """Bytes of the distinct storages autograd saved for backward while `fn` ran."""
    storages = {}

    def pack_hook(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        out = fn()
    return sum(storages.values()), out


@pytest.mark.parametrize("lengths", [[2048], [700, 1000, 348]])
def test_flex_never_holds_an_n_by_n_tensor_where_eager_does(lengths):
    """At N = 2048 (4 heads): eager makes [heads, N, N] scores and keeps them for backward;
    flex's largest tensor is one query block's scores [heads, 128, <= N] and it saves an
    order of magnitude less."""
    batch = pack(lengths, dtype=torch.float32)
    n = sum(lengths)
    largest, saved = {}, {}
    for attention in ("eager", "flex"):
        m = draft(attention, dtype=torch.float32)
        with LargestTensor() as probe:
            saved[attention], logits = saved_bytes(lambda: m(*batch, STEPS))
            sum(lg.sum() for lg in logits).backward()
        largest[attention] = probe.numel
    assert largest["eager"] >= 4 * n * n
    assert largest["flex"] <= 4 * BLOCK * n < n * n
    assert saved["eager"] > 4 * n * n * 4  # the softmax probabilities, fp32
    assert saved["flex"] * 10 < saved["eager"]


@pytest.mark.parametrize("shape", [SHAPE, MLA_SHAPE], ids=["llama", "mla"])
@pytest.mark.parametrize("attention", ["flex", "eager"])
def test_activation_checkpointing_gives_equal_gradients_and_saves_less(attention, shape):
    batch = pack([200, 57])
    grads, saved = {}, {}
    for ckpt in (False, True):
        m = draft(attention, checkpointing=ckpt, shape=shape)
        saved[ckpt], logits = saved_bytes(lambda: m(*batch, STEPS))
        loss = sum((lg * lg).sum() for lg in logits)
        m.zero_grad()
        loss.backward()
        grads[ckpt] = {n: p.grad.clone() for n, p in m.named_parameters()}
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=1e-10, atol=1e-12)
    assert saved[True] < saved[False] / 2


def test_frozen_embedding_is_bf16_outside_parameters_and_checkpoints_but_exported():
    m = draft(dtype=torch.float32)
    emb = m.embed_tokens.weight
    assert emb.dtype == torch.bfloat16 and not emb.requires_grad
    params = dict(m.named_parameters())
    assert "embed_tokens.weight" not in params
    assert sum(p.numel() for p in params.values()) == sum(
        p.numel() for p in m.parameters() if p.requires_grad
    )
    assert "embed_tokens.weight" not in m.state_dict()
    exported = m.export_state_dict()
    assert set(exported) == SPECULATORS_NAMES
    assert torch.equal(exported["embed_tokens.weight"], emb)
    # an export or an old checkpoint (which held the embedding) still loads, embedding included
    back = draft(dtype=torch.float32, seed=7)
    back.load_state_dict({k: v.float() for k, v in exported.items()})
    assert torch.equal(back.embed_tokens.weight, emb)
    for name, t in m.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name


def test_draft_config_new_fields_have_defaults_and_are_not_architecture():
    old = dict(
        **SHAPE,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        norm_before_residual=True,
    )  # a checkpoint's draft_config before these fields existed
    cfg = DraftConfig(**old)
    assert (cfg.attention, cfg.activation_checkpointing) == ("flex", False)
    assert cfg.architecture() == old
    assert DraftConfig(**old, attention="eager").architecture() == old
    assert DraftConfig(**old, fc_norm=True).architecture() == {**old, "fc_norm": True}
    with pytest.raises(ValueError, match="attention 'sdpa'"):
        DraftConfig(**old, attention="sdpa")


# ---------------------------------------------------------------- one slice of the pack


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@KV_SHAPES
@pytest.mark.parametrize("kernel", ["dense", "blockwise", "flex"])
def test_a_slice_of_the_queries_equals_those_rows_of_the_whole_pack(
    kernel, monkeypatch, kv_heads, dv
):
    """Sequence splitting's attention: queries [offset, offset + n) against the pack's
    step-0 keys and their own diagonal keys give the whole pack's rows there, and the
    same gradients (the CPU device check lifted so flex runs its eager backward)."""
    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
    doc = pack(LENGTHS)[3]
    n_all = doc.numel()  # 600: slices of 256 (the last one short)
    q, keys = _qkv(n_all, kv_heads=kv_heads, dv=dv)
    ref_out, ref_grads = _attend_grads(q, keys, pack_mask(doc, "dense"))
    for offset in (0, 256, 512):
        n = min(256, n_all - offset)
        rows = slice(offset, offset + n)
        keys_s = [keys[0]] + [(k[:, rows], v[:, rows]) for k, v in keys[1:]]
        with torch.no_grad():
            out = attend(q[:, rows], keys_s, pack_mask(doc, kernel, offset, n), 0.25)
        torch.testing.assert_close(out, ref_out[:, rows], rtol=1e-10, atol=1e-12)
    # gradients: the slices' backward passes add up to the whole pack's
    w = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(9), dtype=ref_out.dtype)
    leaves = [q, *(t for kv in keys for t in kv)]
    total = [torch.zeros_like(t) for t in leaves]
    for offset in (0, 256, 512):
        n = min(256, n_all - offset)
        rows = slice(offset, offset + n)
        keys_s = [keys[0]] + [(k[:, rows], v[:, rows]) for k, v in keys[1:]]
        out = attend(q[:, rows], keys_s, pack_mask(doc, kernel, offset, n), 0.25)
        grads = torch.autograd.grad((out * w[:, rows]).sum(), leaves, allow_unused=True)
        total = [t + (g if g is not None else 0) for t, g in zip(total, grads)]
    for a, b in zip(total, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_block_mask_of_a_slice_equals_create_block_mask_with_offset_queries():
    doc = torch.cat([torch.full((n_i,), i) for i, n_i in enumerate([300, 40, 1, 109, 262])])
    n, offset, queries = doc.numel(), 256, 384
    ours = pack_mask(doc, "flex", offset, queries).block_mask

    def mask_mod(b, h, q, kv):
        return (doc[q + offset] == doc[kv]) & (kv <= q + offset)

    ref = fa.create_block_mask(mask_mod, None, None, queries, n, device="cpu", BLOCK_SIZE=BLOCK)
    assert ours.shape == ref.shape == (1, 1, queries, n)
    assert torch.equal(ours.kv_num_blocks, ref.kv_num_blocks)
    assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)
    assert torch.equal(ours.to_dense(), ref.to_dense())
