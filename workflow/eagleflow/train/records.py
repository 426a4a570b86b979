"""The run's records, written by rank 0 into the trainer's output directory:

  metrics.csv      one row per step: lr, the objective (`loss`) and the KL apart, grad norm,
                   per TTT step the objective, accuracy (top-1 agreement with the target) and
                   conditional accuracy (given steps < k all agreed), trained tokens, data wait
  validation.csv   one row per validation: the same figures on the held-out packs, with the
                   simulated acceptance length
  curves.png       the same, plotted (the training and held-out objective on one axis)
  progress.json    step, total steps and rate at the last checkpoint
  summary.json     at the end (`summary`)

Rows are kept by every rank and written by rank 0 just before each checkpoint; on resume they
are read back up to the checkpoint's step (later rows belong to steps trained again).
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from pathlib import Path

METRICS, VALIDATION, CURVES = "metrics.csv", "validation.csv", "curves.png"
SUMMARY, PROGRESS = "summary.json", "progress.json"


def per_step_columns(ttt_steps: int) -> list[str]:
    return [c for k in range(ttt_steps) for c in (f"loss_{k}", f"acc_{k}", f"cond_acc_{k}")]


def formatted(figures: dict, ttt_steps: int) -> dict:
    """The objective, the KL and each TTT step's figures as the CSV files hold them."""
    row = {"loss": f"{figures['loss']:.6f}", "kl": f"{figures['kl']:.6f}"}
    for k in range(ttt_steps):
        row |= {
            f"loss_{k}": f"{figures[f'loss_{k}']:.6f}",
            f"acc_{k}": f"{figures[f'acc_{k}']:.4f}",
            f"cond_acc_{k}": f"{figures[f'cond_acc_{k}']:.4f}",
        }
    return row


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


@dataclass
class StepRecord:
    """What one optimizer step did, summed over the ranks."""

    step: int  # 1-based: the step just trained
    epoch: int  # 1-based
    lr: float
    figures: dict  # `objective.figures` of the step's global batch
    grad_norm: float
    tokens: int
    wait_s: float  # data wait, averaged over the ranks
    elapsed_s: float


class RunFiles:
    """metrics.csv, validation.csv, progress.json, curves.png and summary.json (module doc)."""

    def __init__(self, out: Path, ttt_steps: int, start: int, rank: int):
        self.out, self.ttt_steps, self.rank = Path(out), ttt_steps, rank
        per_step = per_step_columns(ttt_steps)
        self.columns = ["step", "epoch", "lr", "loss", "kl", "grad_norm", "tokens", *per_step]
        self.columns += ["data_wait_s", "elapsed_s"]
        self.val_columns = ["step", "loss", "kl", "simulated_acceptance_length", "tokens"]
        self.val_columns += per_step
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

    def step(self, record: StepRecord) -> dict:
        """The step's row (kept until `save_rows`)."""
        row = {
            "step": record.step,
            "epoch": record.epoch,
            "lr": f"{record.lr:.3e}",
            **formatted(record.figures, self.ttt_steps),
            "grad_norm": f"{record.grad_norm:.4f}",
            "tokens": record.tokens,
            "data_wait_s": f"{record.wait_s:.4f}",
            "elapsed_s": f"{record.elapsed_s:.2f}",
        }
        self.rows.append(row)
        return row

    def validation(self, step: int, metrics: dict) -> None:
        row = {
            "step": step,
            "simulated_acceptance_length": f"{metrics['simulated_acceptance_length']:.4f}",
            "tokens": metrics["tokens"],
            **formatted(metrics, self.ttt_steps),
        }
        self.val_rows.append(row)

    def save_rows(self) -> None:
        """The rows up to a checkpoint, written before it: a run killed once its checkpoint
        exists resumes after rows that are on disk."""
        if self.rank == 0:
            self._write(METRICS, self.columns, self.rows)
            self._write(VALIDATION, self.val_columns, self.val_rows)

    def checkpointed(self, status: dict) -> None:
        """Where the run stands (progress.json), once its checkpoint is saved."""
        if self.rank == 0:
            write_json(self.out / PROGRESS, status)

    def finished(self, summary: dict) -> None:
        if self.rank == 0:
            plot_curves(self.rows, self.ttt_steps, self.out / CURVES, self.val_rows)
            write_json(self.out / SUMMARY, summary)


def summary(run: dict, data, cfg, progress, last_row) -> dict:
    """summary.json: `run` (how this invocation ran: world, parallelism, steps, timings)
    with the data's and the best validation's figures."""
    table, best = data.table, progress.best or {}
    packs = data.plan.num_packs(0)
    return run | {
        "epochs": cfg.epochs,
        "steps": data.total,
        "steps_per_epoch": [b - a for a, b in zip(data.epoch_starts, data.epoch_starts[1:])],
        "batch_packs": cfg.batch_packs,
        "sequence_parallel": cfg.sequence_parallel,
        "tokens_trained": progress.tokens_trained,
        "samples_trained": progress.samples_trained,
        "samples_cut": len(table.cut),
        "samples_cut_names": table.cut,
        "train_samples": len(table.train),
        "heldout_samples": len(table.heldout),
        "eval_samples": len(data.eval_table.heldout),
        "longest_sample_tokens": table.longest_train,
        "packs_per_epoch": packs,
        "pack_fill": float(table.length[table.train].sum()) / (packs * cfg.max_tokens),
        "best_step": progress.best_step,
        "simulated_acceptance_length": {
            "total": best.get("simulated_acceptance_length"),
            "per_position": best.get("acceptance_per_position"),
            "conditional_accuracy": [best.get(f"cond_acc_{k}") for k in range(cfg.ttt_steps)],
        },
        "validation_loss": best.get("loss"),
        "validation_kl": best.get("kl"),
        "last": last_row,
    }


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
    ax_loss.set(xlabel="training step", ylabel="objective", yscale="log", title="loss")
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
