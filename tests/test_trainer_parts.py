"""The trainer's parts that a CPU can check on their own: the precision policy chosen per
device (FSDP's mixed precision on CUDA, fp32 on CPU), a draft whose parameters are cast to
bf16 as that policy casts them running without autocast, and the objective's figures.

The CUDA path itself (FSDP2 with `MixedPrecisionPolicy` over nccl) is not run here."""

import pytest
import torch

from eagleflow.draft.model import DraftConfig, Eagle3Draft
from eagleflow.train.objective import FIGURES, figures
from eagleflow.train.parallel import Parallelism, mixed_precision
from support.draft_fixtures import TINY_DRAFT, H, V


def test_fsdp_casts_to_bf16_and_reduces_in_fp32_on_cuda_only():
    policy = mixed_precision(torch.device("cuda", 0))
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert mixed_precision(torch.device("cpu")) is None
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    # autocast only where no FSDP policy casts: one process on CUDA
    assert not Parallelism(0, 2, cuda, fsdp=True, mixed_precision=True).autocast
    assert Parallelism(0, 1, cuda).autocast
    assert not Parallelism(0, 2, cpu, fsdp=True).autocast and not Parallelism(0, 1, cpu).autocast


def test_a_draft_cast_to_bf16_runs_without_autocast_close_to_fp32():
    """What FSDP's policy hands the forward: bf16 parameters (the frozen embedding is bf16
    already) and bf16 states, no autocast."""
    cfg = DraftConfig(
        hidden_size=H, vocab_size=V, draft_vocab_size=16, num_aux=3, attention="eager", **TINY_DRAFT
    )
    torch.manual_seed(0)
    model = Eagle3Draft(cfg)
    n, steps = 12, 3
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(n, 3 * H, generator=g)
    tokens = torch.randint(0, V, (steps, n), generator=g)
    positions, doc = torch.arange(n) + 1, torch.zeros(n, dtype=torch.long)
    full = model(aux, tokens, positions, doc, steps)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    half = model(aux.bfloat16(), tokens, positions, doc, steps)
    for a, b in zip(full, half):
        assert b.dtype == torch.bfloat16
        torch.testing.assert_close(b.float(), a, rtol=0.1, atol=0.05)
    sum(x.float().sum() for x in half).backward()  # gradients in bf16, as communicated
    assert model.fc.weight.grad.dtype == torch.bfloat16


def test_figures_weigh_every_token_once():
    """Two TTT steps: the objective per token of each step, weighted by step_weight**k; the
    KL apart; the acceptance length from the conditional accuracies."""
    sums = torch.zeros(2, len(FIGURES), dtype=torch.float64)
    # objective, kl, tokens, correct, cond_correct, cond_tokens
    sums[0] = torch.tensor([6.0, 4.0, 3, 2, 2, 3])
    sums[1] = torch.tensor([2.0, 2.0, 2, 1, 1, 2])
    out = figures(sums, 0.5)
    assert out["loss"] == pytest.approx(6 / 3 + 0.5 * 2 / 2)
    assert out["kl"] == pytest.approx(4 / 3 + 0.5 * 2 / 2)
    assert out["acc_0"] == pytest.approx(2 / 3) and out["cond_acc_1"] == pytest.approx(0.5)
    assert out["simulated_acceptance_length"] == pytest.approx(1 + 2 / 3 + 2 / 3 * 0.5)
    assert out["tokens"] == 3


def test_muon_steps_as_torchs_in_bf16_and_orthogonalizes_in_float32_on_a_cpu(monkeypatch):
    """The trainer's Muon is torch's step: with bf16 iterations (CUDA's) it gives torch's
    weights and state exactly; on a CPU it iterates in float32, within bf16 rounding of them,
    and its update is about orthogonal (singular values near 1)."""
    from eagleflow.train import optimizer

    torch.manual_seed(0)
    weights = [torch.randn(48, 24), torch.randn(16, 40)]
    grads = [[torch.randn_like(w) for w in weights] for _ in range(3)]

    def stepped(cls):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        opt = cls(params, lr=0.02, weight_decay=0.1)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        return [p.detach() for p in params], opt.state_dict()["state"]

    assert optimizer.newton_schulz_dtype(torch.device("cpu")) == torch.float32
    assert optimizer.newton_schulz_dtype(torch.device("cuda", 0)) == torch.bfloat16
    reference, reference_state = stepped(torch.optim.Muon)
    float32, _ = stepped(optimizer.Muon)
    monkeypatch.setattr(optimizer, "newton_schulz_dtype", lambda device: torch.bfloat16)
    bf16, bf16_state = stepped(optimizer.Muon)
    for ours, theirs in zip(bf16, reference):
        assert torch.equal(ours, theirs)
    for k, v in reference_state.items():
        assert torch.equal(bf16_state[k]["momentum_buffer"], v["momentum_buffer"])
    for ours, theirs in zip(float32, reference):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3)
        assert not torch.equal(ours, theirs)
    singular = torch.linalg.svdvals(
        optimizer.orthogonalize(grads[0][0], (3.4445, -4.7750, 2.0315), 5, 1e-7, torch.float32)
    )
    assert 0.5 < singular.min() and singular.max() < 1.5
