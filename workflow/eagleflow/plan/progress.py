"""What draft training still has to do, for `snakemake progress`: tokens and epochs to train
(the token manifest's training samples), the step the trainer's latest checkpoint reached
(`progress.json` in its work directory, written at every checkpoint) and the time left at the
rate those checkpoints measured, else `draft.tokens_per_second_per_rank`: the rate and token
count train_draft's SLURM time limit uses (`eagleflow.plan.resources`). Reads small files;
loads no model and no torch."""

from __future__ import annotations

from pathlib import Path

from eagleflow.data.heldout import excluder
from eagleflow.plan.resources import TrainingTokens, measured_rate_per_rank, read_progress
from eagleflow.plan.settings import DraftSettings


def training_progress(manifest, work_dir, draft: DraftSettings, ranks: int) -> dict:
    """`manifest`: the token manifest (sample_id, n_tokens, n_loss_tokens); `work_dir`: the
    trainer's; `ranks`: nodes x processes per node (`TrainJob.ranks`)."""
    cfg = draft.train
    epoch = TrainingTokens.from_manifest(
        manifest, excluder(cfg.heldout_modulus), cfg.max_sample_tokens
    )
    total = epoch.to_train(cfg)
    progress = read_progress(work_dir) or {}
    trained = int(progress.get("tokens_trained") or 0)
    measured = measured_rate_per_rank(progress)
    rate = measured or draft.ranks.tokens_per_second_per_rank
    to_do = max(0, total - trained)
    return {
        "epochs": cfg.epochs,
        "max_steps": cfg.max_steps,
        "training_samples": epoch.samples,
        "tokens_per_epoch": epoch.loss_tokens,
        "prefill_tokens_per_epoch": epoch.tokens,  # all of them: what draft.states stream prefills
        "tokens_total": total,
        "step": progress.get("step"),
        "total_steps": progress.get("total_steps"),
        "tokens_trained": trained,
        "tokens_to_do": to_do,
        "ranks": ranks,
        "tokens_per_second_per_rank": round(rate, 1),
        "rate_measured": measured is not None,
        "estimated_seconds": round(to_do / (rate * ranks), 1),
        "work_dir": str(Path(work_dir)),
    }


def format_training_progress(plan: dict) -> str:
    extent = f"{plan['epochs']} epoch(s)"
    if plan["max_steps"]:
        extent += f", at most {plan['max_steps']} steps"
    if plan["step"] is None:
        done = "draft training checkpoint: none yet"
    else:
        done = (
            f"draft training checkpoint: step {plan['step']} of {plan['total_steps']}, "
            f"{plan['tokens_trained']:,} tokens trained ({plan['work_dir']})"
        )
    source = "measured by this run's checkpoints"
    if not plan["rate_measured"]:
        source = "assumed: draft.tokens_per_second_per_rank"
    seconds = plan["estimated_seconds"]
    eta = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
    return "\n".join(
        [
            f"draft training: {extent} of {plan['training_samples']:,} samples, "
            f"{plan['tokens_per_epoch']:,} loss-masked tokens each: "
            f"{plan['tokens_total']:,} tokens on {plan['ranks']} rank(s)",
            done,
            f"draft training tokens to do: {plan['tokens_to_do']:,}",
            f"draft training estimated time: {eta} at "
            f"{plan['tokens_per_second_per_rank']} tok/s per rank x {plan['ranks']} ({source})",
        ]
    )
