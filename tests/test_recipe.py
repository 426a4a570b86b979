"""The recipe options measured in docs/measurements/recipe-ablation.md: the LK hybrid loss,
aux-state noise, no loss on out-of-vocabulary next tokens, and "Eagle 3.1" (fc_norm,
norm_output; their forward against vLLM's own module is in test_draft.py)."""

import json

import pytest
import torch

from eagleflow.draft.model import DraftConfig, Eagle3Draft
from eagleflow.draft.vocab import build_draft_vocab
from eagleflow.plan.settings import TrainConfig
from eagleflow.train.data import ShardLayout, build_batch
from eagleflow.train.objective import KL, OBJECTIVE, add_noise, ttt_loss
from eagleflow.train.trainer import train
from support.draft_fixtures import TINY_DRAFT, H, write_shard, write_target

LAYOUT = ShardLayout(paths=[], layer_ids=[1, 2, 3], final_id=3, aux_ids=[1, 2])


def one_pack(n=40, steps=3, seed=0, in_vocab=None, vocab=16):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n,), generator=g)
    mask = torch.rand(n, generator=g) < 0.8
    hidden = torch.randn(n, 3, 8, generator=g)
    return ids, mask, build_batch(ids, mask, hidden, [0, 15, 31], LAYOUT, steps, in_vocab=in_vocab)


def test_lk_hybrid_blends_kl_and_one_minus_acceptance_and_vanishes_at_the_target():
    _, _, batch = one_pack()
    g = torch.Generator().manual_seed(1)
    target = torch.randn(40, 16, generator=g)
    draft = [torch.randn(40, 16, generator=g, requires_grad=True) for _ in range(3)]
    kl, kl_stats = ttt_loss(draft, target, batch, 0.8, "kl")
    lk, lk_stats = ttt_loss(draft, target, batch, 0.8, "lk_hybrid")
    assert torch.equal(kl_stats[:, KL], lk_stats[:, KL])  # the KL is reported as it is
    assert not torch.equal(kl_stats[:, OBJECTIVE], lk_stats[:, OBJECTIVE])
    # by hand for step 0: w KL + (1 - w)(1 - overlap), w = exp(-3 overlap)
    valid = batch.valid[0]
    p = torch.softmax(target[batch.target_index[0][valid]], -1)
    q = torch.softmax(draft[0][valid].detach(), -1)
    overlap = torch.minimum(p, q).sum(-1)
    kl0 = (p * (p.log() - q.log())).sum(-1)
    w = torch.exp(-3 * overlap)
    expected0 = (w * kl0 + (1 - w) * (1 - overlap)).sum() / int(batch.step_tokens[0])
    one_step, _ = ttt_loss(draft[:1], target, batch, 0.8, "lk_hybrid")
    torch.testing.assert_close(one_step.detach(), expected0)
    assert float(lk.detach()) != pytest.approx(float(kl.detach()))
    lk.backward()
    assert all(d.grad is not None and d.grad.abs().sum() > 0 for d in draft)
    # a draft equal to the target: both objectives 0
    same = [target[batch.target_index[k]].clone() for k in range(3)]
    zero, _ = ttt_loss(same, target, batch, 0.8, "lk_hybrid")
    assert float(zero) == pytest.approx(0.0, abs=1e-6)


def test_noise_is_relative_to_each_states_scale():
    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([0.01, 1.0, 100.0])  # layers of very different magnitude
    aux = (torch.randn(4000, 3, 16, generator=g) * scales[None, :, None]).flatten(1)
    torch.manual_seed(0)
    noisy = add_noise(aux, 16, 0.05)
    diff = (noisy - aux).view(4000, 3, 16)
    rms = aux.view(4000, 3, 16).pow(2).mean(-1, keepdim=True).sqrt()
    for layer in range(3):
        r = (diff[:, layer] / rms[:, layer]).flatten()
        assert r.std().item() == pytest.approx(0.05, rel=0.05), layer
        assert abs(r.mean().item()) < 0.005


def test_oov_next_tokens_are_not_trained_and_nothing_else_changes():
    in_vocab = torch.ones(16, dtype=torch.bool)
    in_vocab[[3, 7, 11]] = False  # outside the draft vocabulary
    ids, _, plain = one_pack()
    _, _, masked = one_pack(in_vocab=in_vocab)
    t = torch.arange(40)
    starts = torch.tensor([0, 15, 31])
    doc = (t[:, None] >= starts[None, 1:]).sum(1)
    for k in range(3):
        label = t + 2 + k
        has = (label < 40) & (doc[label.clamp(max=39)] == doc)
        oov = has & ~in_vocab[ids[label.clamp(max=39)]]
        assert oov.any()  # the seed gives some
        assert torch.equal(masked.valid[k], plain.valid[k] & ~oov)
        assert torch.equal(masked.tokens[k], plain.tokens[k])
    assert torch.equal(masked.step_tokens, masked.valid.sum(1))


def test_eagle31_options_are_exported_and_trained(tmp_path):
    """fc_norm adds one norm per aux state, norm_output changes steps after the first; both
    train, and reach the export's config and weights."""
    from safetensors import safe_open

    from eagleflow.draft.weights import load_trained
    from eagleflow.export.speculators_format import export_draft

    cfg = DraftConfig(
        hidden_size=H,
        vocab_size=64,
        draft_vocab_size=32,
        num_aux=3,
        **TINY_DRAFT,
        fc_norm=True,
        norm_output=True,
    )
    model = Eagle3Draft(cfg)
    assert [n for n in model.state_dict() if n.startswith("fc_norm.")] == [
        f"fc_norm.{i}.weight" for i in range(3)
    ]
    target = write_target(tmp_path / "target")
    shards = [write_shard(tmp_path / "s.safetensors", 12, seed=0)]
    vocab = build_draft_vocab(shards, 64, 32)
    run = TrainConfig(epochs=2, batch_packs=1, max_tokens=64, device="cpu", num_workers=0)
    arch = dict(TINY_DRAFT, fc_norm=True, norm_output=True)
    summary = train(shards, target, vocab, tmp_path / "run", run, arch)
    assert summary["steps"] > 0
    draft, meta = load_trained(tmp_path / "run")
    assert draft.cfg.fc_norm and draft.cfg.norm_output
    assert not torch.equal(draft.fc_norm[0].weight, torch.ones(H))  # trained
    config = export_draft(draft, meta["aux_ids"], shards, target, tmp_path / "export")
    assert config["fc_norm"] is True and config["norm_output"] is True
    on_disk = json.loads((tmp_path / "export" / "config.json").read_text())
    assert on_disk["fc_norm"] and on_disk["norm_output"]
    with safe_open(str(tmp_path / "export" / "model.safetensors"), framework="pt") as f:
        assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(f.keys())
