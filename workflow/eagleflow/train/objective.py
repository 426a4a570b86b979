"""The draft's training objective with training-time test (TTT), and its figures.

objective = sum_k  step_weight**k * (sum of the step-k objective over the global batch's
            anchors trained at step k) / (their number)

per token over the whole global batch (every pack of the optimizer step, on every rank): a
padding pack weighs nothing, a long pack more than a short one. The step-k objective of an
anchor is KL(target_k || draft_k) ("kl"), or the LK hybrid ("lk_hybrid"); target_k is the
target's own distribution at position t+1+k (its final norm and lm_head applied to the
stored final pre-norm state, over the draft vocabulary), draft_k the draft's after k
unrolled steps (`Eagle3Draft.ttt_forward`).

Figures stay on the device: `ttt_loss` returns them as a tensor [steps, len(FIGURES)] of
sums, added over packs and all-reduced once per step by the trainer; nothing here reads a
value back to the host (no synchronisation per TTT step). `figures` turns the reduced sums
into the logged numbers: the objective (`loss`), the KL apart (`kl`), accuracy and
conditional accuracy per TTT step and, for validation, the simulated acceptance length.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

LK_ETA = 3.0  # the LK paper's best hybrid blend temperature (speculators' default)
# Sums per TTT step, in this order (columns of the figures tensor).
FIGURES = ("objective", "kl", "tokens", "correct", "cond_correct", "cond_tokens")
OBJECTIVE, KL, TOKENS, CORRECT, COND_CORRECT, COND_TOKENS = range(len(FIGURES))


def ttt_loss(logits: list, target_logits, batch, step_weight: float, loss="kl", tokens=None):
    """(the weighted objective of this pack or slice, its figures [steps, FIGURES]).

    `tokens` [steps]: the anchors trained at step k the objective is averaged over (the whole
    global batch's, so that the packs' objectives add up to the batch's); the pack's own
    (`batch.step_tokens`) by default.

    loss "kl": KL(target || draft). "lk_hybrid" (arXiv 2602.23881, as speculators 0.9's
    `lk_hybrid_loss`): w KL + (1 - w) TV per anchor, TV = 1 - sum min(p, q) (one minus the
    acceptance rate), w = exp(-eta sg[sum min(p, q)]): KL's gradient while the draft is far
    off, the acceptance rate itself once it is close. Every anchor is computed and the
    untrained ones masked (no boolean indexing: its size would be read back to the host)."""
    # at least float32 (bf16 logits are upcast; float64 ones, as in the exactness tests, stay)
    compute = torch.promote_types(logits[0].dtype, torch.float32)
    denominators = (batch.step_tokens if tokens is None else tokens).to(logits[0].device)
    denominators = denominators.to(compute).clamp(min=1)
    target_logp = F.log_softmax(target_logits.to(compute), dim=-1)
    total = logits[0].new_zeros((), dtype=compute)
    prev_ok = batch.valid[0].clone()
    rows = []
    for k, step_logits in enumerate(logits):
        valid = batch.valid[k]
        tgt = target_logp[batch.target_index[k]]
        logq = F.log_softmax(step_logits.to(compute), dim=-1)
        kl = torch.where(valid, (tgt.exp() * (tgt - logq)).sum(-1), 0.0)
        objective = kl
        if loss == "lk_hybrid":
            overlap = torch.minimum(tgt.exp(), logq.exp()).sum(-1)
            weight = torch.exp(-LK_ETA * overlap.detach())
            objective = torch.where(valid, weight * kl + (1 - weight) * (1 - overlap), 0.0)
        total = total + step_weight**k * objective.sum() / denominators[k]
        correct = valid & (logq.argmax(-1) == tgt.argmax(-1))
        cond = prev_ok & valid
        sums = (objective.detach(), kl.detach(), valid, correct, correct & cond, cond)
        rows.append(torch.stack([x.sum().to(torch.float64) for x in sums]))
        prev_ok = prev_ok & correct
    return total, torch.stack(rows)


def figures(sums, step_weight: float) -> dict:
    """The logged numbers of summed figures [steps, FIGURES] (a tensor or an array): the
    weighted objective and KL, per TTT step its objective, accuracy (top-1 agreement with the
    target) and conditional accuracy (given that every earlier step agreed), and the
    simulated acceptance length: the draft proposes greedily and position k is accepted
    while every position up to k agreed, AL = 1 + sum_k prod_{j<=k} cond_acc_j (vLLM's mean
    accepted length + 1)."""
    s = np.asarray(sums.cpu() if isinstance(sums, torch.Tensor) else sums, dtype=np.float64)
    per_token = s / np.maximum(s[:, TOKENS : TOKENS + 1], 1)
    weights = step_weight ** np.arange(len(s))
    out = {
        "loss": float((weights * per_token[:, OBJECTIVE]).sum()),
        "kl": float((weights * per_token[:, KL]).sum()),
        "tokens": int(s[0, TOKENS]),
    }
    accepted, run = [], 1.0
    for k, row in enumerate(s):
        cond_acc = row[COND_CORRECT] / max(row[COND_TOKENS], 1)
        out |= {
            f"loss_{k}": float(per_token[k, OBJECTIVE]),
            f"acc_{k}": float(per_token[k, CORRECT]),
            f"cond_acc_{k}": float(cond_acc),
        }
        run *= cond_acc
        accepted.append(float(run))
    out["acceptance_per_position"] = accepted
    out["simulated_acceptance_length"] = 1.0 + sum(accepted)
    return out


def noise_generator(seed: int, step: int, key: int, part: int, device) -> torch.Generator:
    """The generator of one pack's noise: a pure function of the run's seed, the step, the
    pack (`Batch.key`, from its samples) and its slice, so a resumed run, and a run at
    another world size, draws the same noise for the same pack; no global generator (the
    CPU's or a device's) is touched."""
    state = np.random.SeedSequence([seed, step, key, part]).generate_state(2, np.uint32)
    generator = torch.Generator(device=device)
    generator.manual_seed(int(state[0]) << 32 | int(state[1]))
    return generator


def add_noise(aux: torch.Tensor, hidden: int, std: float, generator=None) -> torch.Tensor:
    """aux [n, n_aux*H] plus Gaussian noise of `std` times each state's RMS (per token and
    layer: a target's layers differ in scale by orders), drawn from `generator`."""
    states = aux.view(aux.shape[0], -1, hidden)
    rms = states.float().pow(2).mean(-1, keepdim=True).sqrt().to(aux.dtype)
    noise = torch.randn(states.shape, generator=generator, device=states.device, dtype=states.dtype)
    return (states + std * rms * noise).flatten(1)
