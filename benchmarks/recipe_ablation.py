"""One recipe change at a time against the workflow's draft recipe, on one extraction.

Each arm is the workflow's `draft:` settings (config/config.yaml, plus `--configfile`s) with one
change (`ARMS`), trained by eagleflow's trainer as `train_draft` runs it at one rank, exported
from `best/`, and evaluated through the `evaluate` rule's vLLM path (vLLM eagle3, k =
`evaluate.speculative_tokens`, the same held-out prompts for every run): the training and
evaluation are `trainer_head_to_head`'s own (`train_ours`, `evaluate_export`). Seeds pair the
runs: seed s of an arm and seed s of the baseline share the draft's initialisation and the
data order, so their difference is the change's, plus what the change does to the seed's luck.

Per arm: the vLLM acceptance length (AL) per seed and its mean, the simulated AL the trainer
validated with (held-out samples, `summary.json`), and the paired difference to the baseline
with its standard error. An arm "helps" when its difference exceeds twice its standard error.
Runs already finished in `--workdir` are read back, not redone. Last line:
`baseline_al=<mean> best=<arm> best_al=<mean>`.

Usage (from the repository root, after `snakemake --cores all all`, which leaves the shards,
the vocabulary and the trained target there):
  .venv/bin/python benchmarks/recipe_ablation.py
  .venv/bin/python benchmarks/recipe_ablation.py --arms baseline fc_norm --seeds 0 1 2 \\
      --configfile more-prompts.yaml
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_head_to_head import (  # noqa: E402
    EMBEDDED_TARGET,
    RunSetup,
    evaluate_export,
    paired_difference,
    train_ours,
)

# arm: (TrainConfig changes, DraftConfig changes), each one change from the anchors
ARMS = {
    "baseline": ({}, {}),
    "fc_norm": ({}, {"fc_norm": True}),  # Eagle 3.1's fc norm (speculators PR #610)
    "eagle3.1": ({}, {"fc_norm": True, "norm_output": True}),  # and its normed recurrence
    "lk_hybrid": ({"loss": "lk_hybrid"}, {}),  # LK losses, arXiv 2602.23881
    "noise_0.05": ({"noise_std": 0.05}, {}),  # speculators' noise std
    "ttt_7": ({"ttt_steps": 7}, {}),  # SpecForge's TTT length
    "mask_oov": ({"mask_oov": True}, {}),
    "lr_1e-4": ({"lr": 1e-4}, {}),  # the anchors' learning rate
    "lm_head_target": ({"lm_head": "target"}, {}),
    "lm_head_target_frozen": ({"lm_head": "target_frozen"}, {}),  # speculators' draft
    "adamw": ({"optimizer": "adamw"}, {}),  # the published recipes' (the default is Muon)
    "muon_lr_3e-3": ({"muon_lr": 3e-3}, {}),  # Muon at the AdamW lr, speculators' CLI default
}


def run_arm(name, cfg, overrides, seed, shards, target, vocab, engine, prompts, ev, work):
    changes, arch = ARMS[name]
    run = work / "runs" / f"{name}-seed{seed}"
    done = run / "result.json"
    if done.exists():
        return json.loads(done.read_text())
    print(f"--- {name}, seed {seed}", flush=True)
    trained = train_ours(
        shards, target, vocab, replace(cfg, seed=seed, **changes), overrides | arch, run
    )
    summary = json.loads((run / "train" / "summary.json").read_text())
    measured = evaluate_export(trained["export"], engine, prompts, ev, run / "eval")
    result = trained | measured | {"arm": name, "seed": seed}
    result["simulated_al"] = summary["simulated_acceptance_length"]["total"]
    done.write_text(json.dumps(result))
    print(f"{name} seed {seed}: AL {measured['acceptance_length']:.3f}", flush=True)
    return result


def print_table(results: dict, arms: list[str], seeds: list[int]) -> dict:
    """One row per arm, over the seeds it has finished (an arm with fewer seeds than asked
    says so; its difference is paired over the seeds it shares with the baseline, and needs
    at least two to say whether it helps); returns the arms' mean AL."""
    print(
        f"{'arm':<22} {'AL mean':>7}  {'AL per seed':<22} {'simulated':>9} "
        f"{'vs baseline':>16} {'helps':>5} {'train_s':>7}"
    )
    means = {}
    for arm in arms:
        done = [s for s in seeds if (arm, s) in results]
        if not done:
            continue
        runs = [results[(arm, s)] for s in done]
        als = [r["acceptance_length"] for r in runs]
        means[arm] = statistics.fmean(als)
        simulated = statistics.fmean(r["simulated_al"] for r in runs)
        seconds = statistics.fmean(r["train_seconds"] for r in runs)
        paired = [s for s in done if ("baseline", s) in results]
        versus = helps = ""
        if arm != "baseline" and paired:
            diff, se = paired_difference(
                [results[(arm, s)]["acceptance_length"] for s in paired],
                [results[("baseline", s)]["acceptance_length"] for s in paired],
            )
            versus = f"{diff:+.3f} +- {se:.3f}"
            helps = ("yes" if diff > 2 * se else "no") if len(paired) > 1 else "n/a"
        per_seed = " / ".join(f"{a:.3f}" for a in als)
        if len(done) < len(seeds):
            per_seed += f" (seeds {done})"
        print(
            f"{arm:<22} {means[arm]:>7.3f}  {per_seed:<22} "
            f"{simulated:>9.3f} {versus:>16} {helps:>5} {seconds:>7.0f}"
        )
    return means


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="/tmp/ef-recipe-ablation")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    p.add_argument("--configfile", nargs="*", default=[], help="merged over config.yaml")
    p.add_argument("--shards", nargs="*", help="default: the working directory's results/")
    p.add_argument("--target", default=EMBEDDED_TARGET)
    p.add_argument("--vocab", help="vocab.safetensors (default: the working directory's)")
    p.add_argument("--dataset", help="the dataset of the held-out prompts (default: data.path)")
    p.add_argument("--report", action="store_true", help="only the table of finished runs")
    args = p.parse_args(argv)
    arms = ["baseline"] + [a for a in args.arms if a != "baseline"]
    work = Path(args.workdir)
    if args.report:
        results = {}
        for arm in arms:
            for seed in args.seeds:
                done = work / "runs" / f"{arm}-seed{seed}" / "result.json"
                if done.exists():
                    results[(arm, seed)] = json.loads(done.read_text())
        print_table(results, arms, args.seeds)
        return

    setup = RunSetup.read(args)
    cfg, overrides, shards, vocab = setup.cfg, setup.overrides, setup.shards, setup.vocab
    target, engine, ev, prompts = setup.target, setup.engine, setup.ev, setup.prompts
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"{len(shards)} shards, vocabulary {vocab}, target {target}; {len(prompts)} held-out "
        f"prompts, k={ev.k}; seeds {args.seeds}; arms {arms}"
    )
    results = {}
    for seed in args.seeds:
        for arm in arms:
            results[(arm, seed)] = run_arm(
                arm, cfg, overrides, seed, shards, target, vocab, engine, prompts, ev, work
            )
    print()
    means = print_table(results, arms, args.seeds)
    best = max(means, key=means.get)
    print(f"baseline_al={means['baseline']:.3f} best={best} best_al={means[best]:.3f}")


if __name__ == "__main__":
    main()
