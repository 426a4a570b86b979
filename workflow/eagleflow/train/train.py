"""EAGLE-3 draft trainer with training-time test (TTT), in one process or under torchrun.

loss = sum_k  step_weight**k * KL(target_k || draft_k)   over loss-masked anchors, where
target_k is the target's own distribution at position t+1+k (its final norm and lm_head
applied to the stored final pre-norm state, restricted to the draft vocabulary) and draft_k
the draft's after k unrolled steps (`Eagle3Draft.ttt_forward`).

Data (`eagleflow.train.data`): the training samples of all shards, packed by length into
packs of about `max_tokens`, reshuffled every epoch. One optimizer step trains one global
batch of `batch_packs` packs, split over the ranks and each rank's micro-steps; its loss is
the mean of the packs' losses, so 2 ranks x 1 pack and 1 rank x 2 packs take the same step.
The held-out samples are never trained on: every `eval_every` steps they give the
validation loss and the simulated acceptance length, and the draft with the best one is
kept in `best/` (what export reads).

Parallelism (`parallelize`): under torchrun, FSDP2 (`fully_shard`) over the draft's trainable
modules, gloo on CPU and nccl on CUDA. Frozen tensors (the target's embedding and its lm_head
rows over the draft vocabulary, bf16; its final norm) are outside FSDP, replicated, in no
optimizer state and no checkpoint: they are read again from the target. A single process (no
torchrun) trains the plain module.

Writes to `out_dir` (checkpoint layout: `eagleflow.train.checkpoint`):
  checkpoints/step-N/  the latest checkpoint: one DCP save of model, optimizer, progress
                       (step, tokens and samples trained, best evaluation) and rng, every
                       `save_every` steps and at the end
  best/                the best draft so far, consolidated
  metrics.csv          one row per step: lr, loss, grad norm, per-TTT-step loss, accuracy
                       (top-1 agreement with the target) and conditional accuracy (given
                       steps < k all agreed), trained tokens, data wait
  validation.csv       one row per evaluation, with the simulated acceptance length
  curves.png           the same, plotted
  progress.json        step, total steps and rate at the last checkpoint
  summary.json         at the end (`summary`)
A rerun resumes from the latest checkpoint, at any world size, also when the run was
extended (`epochs`, `max_steps`); it starts from step 0 only when something that decides the
weights changed (`training_recipe`: data, draft, vocabulary, seed, recipe values), and says
which. The learning rate is a function of the step and the run's total steps (linear
warm-up, cosine to `min_lr_ratio`), so an extended run stretches its remaining decay.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from dataclasses import asdict, astuple, dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from eagleflow.data.heldout import excluder
from eagleflow.draft.model import DraftConfig, Eagle3Draft
from eagleflow.draft.vocab import DraftVocab
from eagleflow.plan.settings import EXTENT_KEYS, RUNTIME_KEYS, TrainConfig
from eagleflow.store.locks import work_lock
from eagleflow.target.head import (
    EMBED,
    LM_HEAD,
    TargetHead,
    read_target_config,
    read_target_tensor,
)
from eagleflow.train import checkpoint
from eagleflow.train.data import (
    HeldoutSampler,
    PackDataset,
    PackPlan,
    RankSampler,
    data_loader,
    layout_of,
    read_layout,
    sample_table,
    shard_paths,
)
from eagleflow.train.memory_plan import Workload, check_plan, device_memory, plan_memory
from eagleflow.train.optimizer import build_optimizers, set_lr
from eagleflow.train.sequence_parallel import split_groups
from eagleflow.train.states import ServedStates, StreamSource
from eagleflow.train.watchdog import Watchdog

METRICS, VALIDATION, CURVES = "metrics.csv", "validation.csv", "curves.png"
SUMMARY, PROGRESS = "summary.json", "progress.json"
FROZEN_PREFIXES = ("embed_tokens.",)  # the target's embedding: read from the target again


def training_recipe(cfg: TrainConfig, draft_config: dict, layout, vocab: DraftVocab) -> dict:
    """Everything that decides the trained weights: a checkpoint is resumed only when all of
    it is unchanged. Not the world size (the global batch is in packs), nor the extent."""
    settings = {
        k: v for k, v in asdict(cfg).items() if k not in EXTENT_KEYS and k not in RUNTIME_KEYS
    }
    return {
        "train_config": settings,
        "draft_config": draft_config,
        "shards": [Path(p).name for p in layout.paths],  # content-addressed names
        "layer_ids": list(layout.layer_ids),
        "vocab": vocab.summary(),
    }


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine down to min_ratio (of the peak lr)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


# ---------------------------------------------------------------- loss and metrics


@dataclass
class StepStats:
    """Sums over the anchors of one TTT step (added over packs, all-reduced over ranks)."""

    kl: float = 0.0
    tokens: int = 0
    correct: int = 0  # draft top-1 == target top-1
    cond_correct: int = 0  # correct where every earlier step was correct too
    cond_tokens: int = 0  # anchors where every earlier step was correct

    def __add__(self, other: StepStats) -> StepStats:
        return StepStats(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def metrics(self, k: int) -> dict:
        return {
            f"loss_{k}": self.kl / max(self.tokens, 1),
            f"acc_{k}": self.correct / max(self.tokens, 1),
            f"cond_acc_{k}": self.cond_correct / max(self.cond_tokens, 1),
        }


def all_reduce_sums(values: list[float], device) -> list[float]:
    """Sums over the ranks (one collective); the values themselves in a single process."""
    if not dist.is_initialized():
        return list(values)
    flat = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(flat)
    return flat.cpu().tolist()


def all_reduce_stats(stats: list[StepStats], device) -> list[StepStats]:
    flat = all_reduce_sums([v for s in stats for v in astuple(s)], device)
    n = len(fields(StepStats))
    return [
        StepStats(flat[i], *(int(round(v)) for v in flat[i + 1 : i + n]))
        for i in range(0, len(flat), n)
    ]


LK_ETA = 3.0  # the LK paper's best hybrid blend temperature (speculators' default)


def ttt_loss(logits: list, target_logits, batch, step_weight: float, loss: str = "kl"):
    """Weighted objective over the TTT steps (each step's mean over the pack's anchors: the
    sum over this slice's, over the pack's count), and each step's `StepStats` (KL).

    loss "kl": KL(target || draft). "lk_hybrid" (arXiv 2602.23881, as speculators 0.9's
    `lk_hybrid_loss`): w KL + (1 - w) TV per anchor, TV = 1 - sum min(p, q) (one minus the
    acceptance rate), w = exp(-eta sg[sum min(p, q)]): KL's gradient while the draft is far
    off, the acceptance rate itself once it is close."""
    total = logits[0].new_zeros((), dtype=torch.float32)
    stats = []
    target_logp = F.log_softmax(target_logits, dim=-1)
    prev_ok = batch.valid[0].clone()
    for k, step_logits in enumerate(logits):
        valid = batch.valid[k]
        n = int(valid.sum())
        tgt = target_logp[batch.target_index[k][valid]]
        logq = F.log_softmax(step_logits[valid].float(), dim=-1)
        kl = (tgt.exp() * (tgt - logq)).sum(-1)
        objective = kl
        if loss == "lk_hybrid":
            overlap = torch.minimum(tgt.exp(), logq.exp()).sum(-1)
            weight = torch.exp(-LK_ETA * overlap.detach())
            objective = weight * kl + (1 - weight) * (1 - overlap)
        loss_k = objective.sum() / max(int(batch.step_tokens[k]), 1)
        total = total + step_weight**k * loss_k
        correct = torch.zeros_like(valid)
        correct[valid] = logq.argmax(-1) == tgt.argmax(-1)
        cond = prev_ok & valid
        stats.append(
            StepStats(
                kl=float(kl.detach().sum()),
                tokens=n,
                correct=int(correct.sum()),
                cond_correct=int((correct & cond).sum()),
                cond_tokens=int(cond.sum()),
            )
        )
        prev_ok = prev_ok & correct
    return total, stats


def validation_metrics(sums: list[StepStats], step_weight: float) -> dict:
    """Loss, per-TTT-step metrics and the simulated acceptance length: the draft proposes
    greedily and position k is accepted while every position up to k agreed with the
    target, AL = 1 + sum_k prod_{j<=k} cond_acc_j (vLLM's mean accepted length + 1)."""
    out = {"loss": sum(step_weight**k * s.kl / max(s.tokens, 1) for k, s in enumerate(sums))}
    accepted, run = [], 1.0
    for k, s in enumerate(sums):
        out |= s.metrics(k)
        run *= out[f"cond_acc_{k}"]
        accepted.append(run)
    out["tokens"] = sums[0].tokens
    out["acceptance_per_position"] = accepted
    out["simulated_acceptance_length"] = 1.0 + sum(accepted)
    return out


def pack_loss(model, head, batch, cfg: TrainConfig, device: torch.device, split=None):
    """The TTT loss of one pack, or of this rank's slice of it under `split` (states
    dequantized on the device; bf16 autocast on CUDA)."""
    cuda = device.type == "cuda"
    aux, final = batch.values(torch.bfloat16 if cuda else torch.float32)
    if model.training and cfg.noise_std:
        aux = add_noise(aux, final.shape[-1], cfg.noise_std)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
        logits = model(aux, batch.tokens, batch.positions, batch.doc, cfg.ttt_steps, split)
    return ttt_loss(logits, head(final), batch, cfg.step_weight, cfg.loss)


def add_noise(aux: torch.Tensor, hidden: int, std: float) -> torch.Tensor:
    """aux [n, n_aux*H] plus Gaussian noise of `std` times each state's RMS (per token and
    layer: a target's layers differ in scale by orders)."""
    states = aux.view(aux.shape[0], -1, hidden)
    rms = states.float().pow(2).mean(-1, keepdim=True).sqrt().to(aux.dtype)
    return (states + std * rms * torch.randn_like(states)).flatten(1)


def train_step(model, head, optims, cfg, batches, micro_steps: int, device, split=None):
    """One optimizer step over `micro_steps` packs (read lazily from `batches`): each pack's
    loss / micro_steps is backpropagated, FSDP averages over the ranks, so the update is
    the gradient of the mean pack loss of the global batch. Under `split` a pack's loss is
    the sum of its slices' over `parts` ranks, so each slice's is scaled by `parts` against
    that average. Returns (sum of the packs' losses over this rank's slices, real packs,
    summed `StepStats`, gradient norm before clipping)."""
    loss_sum, packs, sums = 0.0, 0, [StepStats() for _ in range(cfg.ttt_steps)]
    scale = (split.parts if split is not None else 1) / micro_steps
    for batch in batches:
        loss, stats = pack_loss(model, head, batch, cfg, device, split)
        (loss * scale).backward()
        loss_sum += float(loss.detach())  # 0 for a padding pack
        packs += batch.samples > 0  # a pack is counted by its first slice
        sums = [a + b for a, b in zip(sums, stats)]
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or float("inf"))
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    for optim in optims:
        optim.step()
        optim.zero_grad(set_to_none=True)
    return loss_sum, packs, sums, float(norm)


@torch.no_grad()
def evaluate(
    model, head, loader, cfg: TrainConfig, device, split=None, beat=lambda: None
) -> dict | None:
    """`validation_metrics` over the held-out packs of every rank (None without any);
    `beat()` after each pack (the stall watchdog's sign of progress)."""
    model.eval()
    sums = [StepStats() for _ in range(cfg.ttt_steps)]
    for batch in loader:
        beat()
        batch = batch.to(device, non_blocking=True)
        _, stats = pack_loss(model, head, batch, cfg, device, split)
        sums = [a + b for a, b in zip(sums, stats)]
    model.train()
    sums = all_reduce_stats(sums, device)
    return validation_metrics(sums, cfg.step_weight) if sums[0].tokens else None


# ---------------------------------------------------------------- model, parallelism, state


def build_draft(
    target_dir, vocab: DraftVocab, num_aux: int, seed: int, lm_head="random", **draft_overrides
):
    """A fresh draft (seeded init) with the target's embedding and the vocab maps. lm_head
    (`draft.lm_head`): "random" (seeded init, trained), "target" (the target's lm_head rows
    over the draft vocabulary, trained from there) or "target_frozen" (those rows, never
    trained: speculators 0.9's draft)."""
    config = read_target_config(target_dir)
    cfg = DraftConfig.for_target(config, vocab.size, num_aux, **draft_overrides)
    torch.manual_seed(seed)
    model = Eagle3Draft(cfg)
    model.set_vocab(vocab.d2t, vocab.t2d)
    model.set_embedding(read_target_tensor(target_dir, EMBED))
    if lm_head != "random":
        with torch.no_grad():
            model.lm_head.weight.copy_(read_target_tensor(target_dir, LM_HEAD)[vocab.target_ids])
        model.lm_head.weight.requires_grad_(lm_head != "target_frozen")
    return model


def init_distributed(cfg: TrainConfig) -> tuple[int, int, torch.device]:
    """(rank, world size, device): a process group under torchrun (nccl on CUDA, gloo on
    CPU), none in a single process."""
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.device != "auto":
        device = torch.device(cfg.device)
    elif torch.cuda.is_available():
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not torchrun:
        return 0, 1, device
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def parallelize(model, device: torch.device) -> str:
    """FSDP2 over the trainable modules when a process group is up: each decoder layer, then
    the rest (fc, norm, lm_head) at the root; the frozen embedding is left out (replicated,
    never sharded, never in optimizer state). Returns the mode for the summary."""
    if not dist.is_initialized():
        return "single process"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    frozen = {p for p in model.parameters() if not p.requires_grad}
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=frozen or None)
    fully_shard(model, mesh=mesh, ignored_params=frozen or None)
    return f"fsdp ({dist.get_backend()})"


def trainable(state: dict) -> dict:
    return {k: v for k, v in state.items() if not k.startswith(FROZEN_PREFIXES)}


class ModelAndOptimizer:
    """Stateful: the draft's trainable weights and its optimizers, FQN-keyed (DCP reshards
    them to any world size, FSDP or not)."""

    def __init__(self, model, optims):
        self.model, self.optims = model, optims

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(ignore_frozen_params=True)
        model_state, optim_state = get_state_dict(self.model, self.optims, options=options)
        return {"model": trainable(model_state), "optim": optim_state}

    def load_state_dict(self, state):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(
            self.model,
            self.optims,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=StateDictOptions(strict=False, ignore_frozen_params=True),
        )


@dataclass
class Progress:
    """Stateful: where the run is (the data position is the step: `PackPlan`) and what it
    has done; the learning-rate schedule is a function of the step, so this is its state too."""

    step: int = 0
    tokens_trained: int = 0  # loss-masked target tokens trained on
    samples_trained: int = 0
    best_step: int = 0
    best: dict | None = None  # the best evaluation so far (`validation_metrics`)

    def state_dict(self):  # one JSON string: DCP would flatten `best` into keys of its own
        return {"json": json.dumps(asdict(self))}

    def load_state_dict(self, state):
        for k, v in json.loads(state["json"]).items():
            setattr(self, k, v)


class RngState:
    """Stateful: the CPU generator (nothing in training draws from it today; kept so a later
    noise augmentation resumes exactly)."""

    def state_dict(self):
        return {"cpu": torch.get_rng_state()}

    def load_state_dict(self, state):
        torch.set_rng_state(state["cpu"])


def full_weights(model) -> dict:
    """The trainable weights and vocab maps, whole, on the CPU (rank 0's under FSDP)."""
    if dist.is_initialized():
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)
    else:
        state = model.state_dict()
    return {k: v.detach().cpu() for k, v in trainable(state).items()}


def check_memory(draft_cfg, cfg: TrainConfig, pack_tokens: int, world: int, device, log):
    """Refuse, before the device is touched, a run whose largest pack (its slice per rank,
    under sequence splitting) cannot fit (`eagleflow.train.memory_plan`); the plan goes to
    the log."""
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


def resume(out: Path, state: dict, recipe: dict, total: int, log) -> int:
    """Load the latest checkpoint when it belongs to this run; its step (0 otherwise)."""
    path = checkpoint.latest(out)
    if path is None:
        return 0
    changed = checkpoint.changed_keys(checkpoint.read_recipe(path), recipe)
    step = checkpoint.checkpoint_step(path)
    if changed:
        log(
            f"{path}: written for another training run ({', '.join(changed)} changed); "
            "training from step 0"
        )
        return 0
    if step > total:
        log(
            f"{path}: at step {step}, past this run's end ({total} steps: epochs or max_steps "
            "reduced); training from step 0"
        )
        return 0
    checkpoint.load(state, path)
    log(f"resuming from {path} (step {step} of {total})")
    return state["progress"].step


# ---------------------------------------------------------------- the run's files


def _fmt(metrics: dict, k: int) -> dict:
    return {
        f"loss_{k}": f"{metrics[f'loss_{k}']:.6f}",
        f"acc_{k}": f"{metrics[f'acc_{k}']:.4f}",
        f"cond_acc_{k}": f"{metrics[f'cond_acc_{k}']:.4f}",
    }


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


class RunFiles:
    """metrics.csv, validation.csv, progress.json, curves.png and summary.json; rows are
    kept by every rank, written by rank 0, and on resume read back up to the checkpoint."""

    def __init__(self, out: Path, ttt_steps: int, start: int, rank: int):
        self.out, self.ttt_steps, self.rank = out, ttt_steps, rank
        per_step = [c for k in range(ttt_steps) for c in (f"loss_{k}", f"acc_{k}", f"cond_acc_{k}")]
        self.columns = ["step", "epoch", "lr", "loss", "grad_norm", "tokens", *per_step]
        self.columns += ["data_wait_s", "elapsed_s"]
        self.val_columns = ["step", "loss", "simulated_acceptance_length", "tokens", *per_step]
        self.rows = self._read(METRICS, start)
        self.val_rows = self._read(VALIDATION, start)

    def _read(self, name: str, up_to_step: int) -> list[dict]:
        path = self.out / name
        if self.rank != 0 or not path.exists():
            return []
        with open(path, newline="") as f:
            return [r for r in csv.DictReader(f) if int(r["step"]) <= up_to_step]

    def _write(self, name: str, columns, rows) -> None:
        tmp = self.out / (name + ".tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.out / name)

    def step(self, row: dict, sums: list[StepStats]) -> dict:
        """A step's row: `row`'s columns and each TTT step's metrics."""
        for k, stats in enumerate(sums):
            row |= _fmt(stats.metrics(k), k)
        self.rows.append(row)
        return row

    def validation(self, step: int, metrics: dict) -> None:
        row = {
            "step": step,
            "loss": f"{metrics['loss']:.6f}",
            "simulated_acceptance_length": f"{metrics['simulated_acceptance_length']:.4f}",
            "tokens": metrics["tokens"],
        }
        for k in range(self.ttt_steps):
            row |= _fmt(metrics, k)
        self.val_rows.append(row)

    def save_rows(self) -> None:
        """The rows up to a checkpoint, written before it: a run killed once its checkpoint
        exists resumes after rows that are on disk (rows past the checkpoint it resumes from
        are dropped when read back)."""
        if self.rank == 0:
            self._write(METRICS, self.columns, self.rows)
            self._write(VALIDATION, self.val_columns, self.val_rows)

    def checkpointed(self, status: dict) -> None:
        """Where the run stands (progress.json), once its checkpoint is saved."""
        if self.rank == 0:
            _write_json(self.out / PROGRESS, status)

    def finished(self, summary: dict) -> None:
        if self.rank == 0:
            plot_curves(self.rows, self.ttt_steps, self.out / CURVES, self.val_rows)
            _write_json(self.out / SUMMARY, summary)


def plot_curves(rows: list[dict], ttt_steps: int, path: Path, val_rows=()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return
    steps = [int(r["step"]) for r in rows]
    fig, (ax_loss, ax_acc, ax_al) = plt.subplots(1, 3, figsize=(16, 4))
    ax_loss.plot(steps, [float(r["loss"]) for r in rows], label="weighted total", color="black")
    for k in range(ttt_steps):
        ax_loss.plot(steps, [float(r[f"loss_{k}"]) for r in rows], label=f"TTT step {k}", alpha=0.7)
        ax_acc.plot(steps, [float(r[f"acc_{k}"]) for r in rows], label=f"TTT step {k}", alpha=0.7)
    if val_rows:
        vsteps = [int(r["step"]) for r in val_rows]
        ax_loss.plot(vsteps, [float(r["loss"]) for r in val_rows], "o-", label="held out")
        ax_al.plot(vsteps, [float(r["simulated_acceptance_length"]) for r in val_rows], "o-")
    ax_loss.set(xlabel="training step", ylabel="KL(target || draft)", yscale="log", title="loss")
    ax_acc.set(
        xlabel="training step",
        ylabel="top-1 agreement with the target",
        ylim=(0, 1),
        title="accuracy per TTT step",
    )
    ax_al.set(
        xlabel="training step",
        ylabel="1 + sum_k prod_j<=k cond_acc_j",
        title="simulated acceptance length (held out)",
    )
    ax_loss.legend()
    ax_acc.legend()
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


# ---------------------------------------------------------------- the loop


@dataclass
class TrainData:
    """What the run trains and validates on, and how many steps that makes."""

    layout: object  # ShardLayout
    table: object  # SampleTable (training, held-out and cut samples)
    plan: PackPlan
    epoch_starts: list[int]  # first step of each epoch, the epochs' total last
    total: int  # steps this run trains to (epochs, or max_steps when set)
    eval_table: object  # the table whose held-out samples are validated on
    served: object = None  # ServedStates of draft.states stream | cached; None: stored

    @classmethod
    def read(cls, shards, num_hidden_layers: int, cfg: TrainConfig, log, stream=None) -> TrainData:
        """`shards`: the extracted shards, or with `stream` (a StreamSource) the token shards,
        whose states the capture server streams."""
        if stream is None:
            layout = read_layout(shard_paths(shards), num_hidden_layers)
        else:
            layout = layout_of(shard_paths(shards), stream.plan.layer_ids, num_hidden_layers)
        table = sample_table(layout.paths, excluder(cfg.heldout_modulus), cfg.max_sample_tokens)
        for c in table.cut:
            log(
                f"sample {c['sample_id']} of {c['shard']}: {c['tokens']} tokens, more than "
                f"draft.max_sample_tokens = {cfg.max_sample_tokens}: NOT trained"
            )
        if not len(table.train):
            raise ValueError(f"no training samples in {layout.paths} outside the held-out split")
        plan = PackPlan(table, cfg.max_tokens, cfg.batch_packs, cfg.seed)
        starts = plan.epoch_starts(cfg.epochs)
        total = min(starts[-1], cfg.max_steps) if cfg.max_steps else starts[-1]
        eval_table = table
        if cfg.eval_samples and len(table.heldout) > cfg.eval_samples:
            rng = np.random.default_rng([cfg.seed, 1 << 20])
            pick = rng.choice(len(table.heldout), cfg.eval_samples, replace=False)
            eval_table = replace(table, heldout=np.sort(table.heldout[pick]))
        log(
            f"{len(table.train)} training samples ({len(table.heldout)} held out, "
            f"{len(table.cut)} not trained) in {plan.num_packs(0)} packs of up to "
            f"{cfg.max_tokens} tokens; {cfg.epochs} epochs = {starts[-1]} steps of "
            f"{cfg.batch_packs} packs; training {total}"
        )
        served = ServedStates(stream, layout.paths) if stream is not None else None
        return cls(layout, table, plan, starts, total, eval_table, served)

    def epoch_of(self, step: int) -> int:
        return int(np.searchsorted(self.epoch_starts, step, side="right")) - 1

    def loaders(self, cfg, start: int, end: int, rank: int, world: int, pin: bool, in_vocab):
        """(training loader, its sampler, validation loader) of this rank: the ranks of one
        sequence-parallel group read the same packs, each its own slice. With `mask_oov`,
        training skips positions whose next token is outside the draft vocabulary
        (`in_vocab`: t2d); validation never does (its acceptance counts every position)."""
        parts = cfg.sequence_parallel
        part, dp_rank, dp_world = rank % parts, rank // parts, world // parts
        steps, oov = cfg.ttt_steps, in_vocab if cfg.mask_oov else None
        served = self.served
        dataset = PackDataset(self.layout, self.table, steps, part, parts, oov, served)
        held_dataset = PackDataset(self.layout, self.table, steps, part, parts, None, served)
        sampler = RankSampler(self.plan, self.epoch_starts, start, end, dp_rank, dp_world)
        held = HeldoutSampler(self.eval_table, cfg.max_tokens, dp_rank, dp_world)
        return (
            data_loader(dataset, sampler, cfg.num_workers, cfg.prefetch_factor, pin),
            sampler,
            data_loader(held_dataset, held, 0, cfg.prefetch_factor, pin),  # no fork: see there
        )


def train(shards, target_dir, vocab: DraftVocab, out_dir, cfg: TrainConfig, *args, **kw) -> dict:
    """Train (or resume) into `out_dir` and return the summary (`_train`). Rank 0 holds the
    work folder's lock throughout: a second trainer on the same folder stops with a sentence
    instead of deleting this one's saves."""
    if int(os.environ.get("RANK", "0")):
        return _train(shards, target_dir, vocab, out_dir, cfg, *args, **kw)
    with work_lock(out_dir, "the trainer's work folder", "train.lock"):
        return _train(shards, target_dir, vocab, out_dir, cfg, *args, **kw)


def _train(
    shards,
    target_dir,
    vocab: DraftVocab,
    out_dir,
    cfg: TrainConfig,
    draft_overrides: dict | None = None,
    stop_after: int | None = None,
    stream: StreamSource | None = None,
) -> dict:
    """Train (or resume) and return the summary; `stop_after` ends early as a crash would
    (no checkpoint, no summary). `stream`: the states come from the capture server (and its
    cache), `shards` are the token shards (`eagleflow.train.states`)."""
    rank, world, device = init_distributed(cfg)
    if world % cfg.sequence_parallel:
        raise ValueError(
            f"draft.sequence_parallel = {cfg.sequence_parallel} ranks per pack does not divide "
            f"the {world} ranks (draft.nodes x draft.processes_per_node): make it a divisor"
        )
    split = split_groups(world, cfg.sequence_parallel, rank)

    def log(msg):
        if rank == 0:
            print(msg, flush=True)

    out = Path(out_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    num_layers = int(read_target_config(target_dir)["num_hidden_layers"])
    data = TrainData.read(shards, num_layers, cfg, log, stream)
    total, warmup = data.total, round(cfg.warmup_ratio * data.total)

    n_aux, overrides = len(data.layout.aux_ids), draft_overrides or {}
    model = build_draft(target_dir, vocab, n_aux, cfg.seed, cfg.lm_head, **overrides)
    check_memory(model.cfg, cfg, max(cfg.max_tokens, data.table.longest_train), world, device, log)
    head = TargetHead.load(target_dir, vocab.target_ids, dtype=torch.bfloat16).to(device)
    model.to(device)
    mode = parallelize(model, device)
    optims = build_optimizers(model, cfg)
    progress = Progress()
    state = {"train": ModelAndOptimizer(model, optims), "progress": progress, "rng": RngState()}
    recipe = training_recipe(cfg, model.cfg.architecture(), data.layout, vocab)
    checkpoint.clean(out, rank)
    start = resume(out, state, recipe, total, log)
    if start == 0:  # a best draft there is another run's (or this one's, made again)
        checkpoint.drop_best(out, rank)
    end = total if stop_after is None else min(total, stop_after)
    files = RunFiles(out, cfg.ttt_steps, start, rank)
    loader, sampler, val_loader = data.loaders(
        cfg, start, end, rank, world, device.type == "cuda", vocab.t2d
    )
    if split is not None:
        mode += f", sequence parallel over {split.parts} ranks"
    if data.served is not None and start < end:
        if data.served.all_cached(data.table):
            log(f"draft.states {stream.mode}: every sample is cached, no engine needed")
        else:  # the model loads here, not in the first step's data wait
            engine = data.served.start_server(log if rank == 0 else lambda m: None)
            log(f"draft.states {stream.mode}: states from the capture server: {engine}")
    log(f"{mode} on {world} rank(s), {sampler.micro_steps} pack(s) per rank and step")

    def keep_if_best(step):
        """Validate; keep the draft in best/ when its simulated acceptance length is the best
        so far (without held-out samples: the last draft)."""
        t = time.perf_counter()
        with watchdog.waiting(f"the validation at step {step} (held-out packs, all-reduce)"):
            metrics = evaluate(model, head, val_loader, cfg, device, split, watchdog.beat)
        timing["validation"] += time.perf_counter() - t
        if metrics is not None:
            files.validation(step, metrics)
            log(
                f"step {step}: held-out loss {metrics['loss']:.4f}, simulated acceptance "
                f"length {metrics['simulated_acceptance_length']:.3f}"
            )
        best = (progress.best or {}).get("simulated_acceptance_length", -1.0)
        if (metrics and metrics["simulated_acceptance_length"] > best) or (
            metrics is None and step == total
        ):
            progress.best, progress.best_step = metrics, step
            meta = {
                "draft_config": model.cfg.to_dict(),
                "aux_ids": data.layout.aux_ids,
                "layer_ids": data.layout.layer_ids,
                "target": str(target_dir),
                "vocab": vocab.summary(),
                "step": step,
                "simulated_acceptance_length": metrics and metrics["simulated_acceptance_length"],
                "validation": metrics,
                "recipe": recipe,
            }
            with watchdog.waiting(f"saving the best draft of step {step}"):
                checkpoint.save_best(full_weights(model), meta, out, rank)

    t0 = time.time()
    # this run's seconds waiting for data, stepping, and validating
    timing = {"wait": 0.0, "step": 0.0, "validation": 0.0}
    seen = {"samples": 0, "tokens": 0, "wait": 0.0}  # this step's
    tokens_run = 0
    batches = iter(loader)  # forks the training loader's workers: before any thread starts
    watchdog = Watchdog(rank, cfg.stall_timeout)

    def micro_batches():
        """This step's packs, timing the wait for each and counting what they train."""
        for _ in range(sampler.micro_steps):
            t = time.perf_counter()
            with watchdog.waiting("the training loader's next pack"):
                batch = next(batches).to(device, non_blocking=True)
            seen["wait"] += time.perf_counter() - t
            seen["samples"] += batch.samples
            seen["tokens"] += batch.trained_tokens
            yield batch

    model.train()
    for step in range(start, end):
        t_step = time.perf_counter()
        seen.update(samples=0, tokens=0, wait=0.0)
        factor = lr_factor(step, total, warmup, cfg.min_lr_ratio)
        lr = cfg.lr * factor
        set_lr(optims, factor)
        with watchdog.waiting(f"step {step + 1}: forward, backward and the gradient all-reduce"):
            loss_sum, packs, sums, norm = train_step(
                model, head, optims, cfg, micro_batches(), sampler.micro_steps, device, split
            )
            loss_sum, packs, samples, tokens, wait = all_reduce_sums(
                [loss_sum, packs, seen["samples"], seen["tokens"], seen["wait"]], device
            )
            sums = all_reduce_stats(sums, device)
        watchdog.step_took(time.perf_counter() - t_step - seen["wait"])
        timing["step"] += time.perf_counter() - t_step
        timing["wait"] += seen["wait"]
        progress.step = step + 1
        progress.tokens_trained += int(tokens)
        progress.samples_trained += int(samples)
        tokens_run += int(tokens)
        row = {
            "step": step + 1,
            "epoch": data.epoch_of(step) + 1,
            "lr": f"{lr:.3e}",
            "loss": f"{loss_sum / max(packs, 1):.6f}",
            "grad_norm": f"{norm:.4f}",
            "tokens": int(tokens),
            "data_wait_s": f"{wait / world:.4f}",
            "elapsed_s": f"{time.time() - t0:.2f}",
        }
        files.step(row, sums)
        if (step - start) % 50 == 0:
            log(f"step {step + 1}/{total}: loss {row['loss']}, acc_0 {row['acc_0']}")
        if (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or step + 1 == total:
            keep_if_best(step + 1)
        if (step + 1) % cfg.save_every == 0 or step + 1 == total:
            files.save_rows()
            with watchdog.waiting(f"saving the checkpoint of step {step + 1}"):
                checkpoint.save(state, out, step + 1, recipe, rank)
            files.checkpointed(
                {
                    "step": step + 1,
                    "total_steps": total,
                    "epochs": cfg.epochs,
                    "tokens_trained": progress.tokens_trained,
                    "tokens_per_second": tokens_run / max(time.time() - t0, 1e-9),
                    "world_size": world,
                }
            )
    if end < total:  # stopped as a crash would
        watchdog.close()
        return {"start_step": start, "end_step": end, "world_size": world}
    if start == total and not (out / checkpoint.BEST).exists():  # finished, best/ lost
        keep_if_best(total)

    with watchdog.waiting("the run's final figures (all-reduce)"):
        wait_s, step_s = all_reduce_sums([timing["wait"], timing["step"]], device)
    table, best = data.table, progress.best or {}
    summary = {
        "world_size": world,
        "parallelism": mode,
        "device": device.type,
        "epochs": cfg.epochs,
        "steps": total,
        "steps_per_epoch": [b - a for a, b in zip(data.epoch_starts, data.epoch_starts[1:])],
        "batch_packs": cfg.batch_packs,
        "micro_steps_per_rank": sampler.micro_steps,
        "sequence_parallel": cfg.sequence_parallel,
        "start_step": start,
        "end_step": end,
        "tokens_trained": progress.tokens_trained,
        "samples_trained": progress.samples_trained,
        "samples_cut": len(table.cut),
        "samples_cut_names": table.cut,
        "train_samples": len(table.train),
        "heldout_samples": len(table.heldout),
        "eval_samples": len(data.eval_table.heldout),
        "longest_sample_tokens": table.longest_train,
        "packs_per_epoch": data.plan.num_packs(0),
        "pack_fill": float(table.length[table.train].sum())
        / (data.plan.num_packs(0) * cfg.max_tokens),
        "best_step": progress.best_step,
        "simulated_acceptance_length": {
            "total": best.get("simulated_acceptance_length"),
            "per_position": best.get("acceptance_per_position"),
            "conditional_accuracy": [best.get(f"cond_acc_{k}") for k in range(cfg.ttt_steps)],
        },
        "validation_loss": best.get("loss"),
        "data_wait_share": wait_s / step_s if step_s else 0.0,
        "validation_seconds": timing["validation"],
        "seconds": time.time() - t0,
        "tokens_per_second": tokens_run / max(time.time() - t0, 1e-9),
        "last": files.rows[-1] if files.rows else None,
    }
    files.finished(summary)
    if dist.is_initialized():
        with watchdog.waiting("the other ranks at the end (barrier)"):
            dist.barrier()
    watchdog.close()
    return summary


def load_trained(path, target_dir=None):
    """(draft, meta) from a trainer's output directory or its `best/`: the best draft's
    weights, with the frozen embedding read again from the target (`target_dir`, else the
    one it was trained against). meta holds `aux_ids`, `step`, `vocab`, `draft_config`..."""
    from safetensors.torch import load_file

    path = Path(path)
    best = path if (path / checkpoint.BEST_META).exists() else path / checkpoint.BEST
    with open(best / checkpoint.BEST_META) as f:
        meta = json.load(f)
    model = Eagle3Draft(DraftConfig(**meta["draft_config"]))
    missing, unexpected = model.load_state_dict(
        load_file(str(best / checkpoint.BEST_WEIGHTS)), strict=False
    )
    if unexpected or any(not k.startswith(FROZEN_PREFIXES) for k in missing):
        raise ValueError(f"{best}: weights do not fit the draft ({missing=}, {unexpected=})")
    model.set_embedding(read_target_tensor(target_dir or meta["target"], EMBED))
    return model, meta


def main(argv=None):
    """CLI: one process, or `torchrun --nproc_per_node N -m eagleflow.train.train ...`."""
    import argparse

    from eagleflow.draft.vocab import load_vocab

    p = argparse.ArgumentParser(description="Train an EAGLE-3 draft on extracted shards.")
    p.add_argument("--shards", nargs="+", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--vocab", required=True, help="vocab.safetensors from draft_vocab")
    p.add_argument("--out", required=True)
    p.add_argument("--config", default="{}", help="TrainConfig fields: JSON, or a JSON file")
    p.add_argument("--draft", default="{}", help="DraftConfig overrides as JSON")
    p.add_argument(
        "--stop-after", type=int, default=None, help="end after this step, as a crash would"
    )
    p.add_argument(
        "--stream",
        default=None,
        help="a StreamSource JSON file: states from the capture server (--shards: token shards)",
    )
    a = p.parse_args(argv)
    config = a.config if a.config.lstrip().startswith("{") else Path(a.config).read_text()
    summary = train(
        a.shards,
        a.target,
        load_vocab(a.vocab),
        a.out,
        TrainConfig(**json.loads(config)),
        json.loads(a.draft),
        stop_after=a.stop_after,
        stream=StreamSource.load(a.stream) if a.stream else None,
    )
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary, default=str))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()
