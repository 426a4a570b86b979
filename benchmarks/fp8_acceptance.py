"""Acceptance length of drafts trained on fp8-stored against bf16-stored hidden states.

For each arm (`bf16`: the default storage; `fp8`: `capture.storage_dtype: float8_e4m3fn`) and
each seed of `--seeds`, runs the default target of the workflow in the repository root
(`snakemake all --forcerun train_draft`, with a `--configfile` setting `draft.seed` and the
storage dtype), so the draft is trained, exported and evaluated again, and copies the run's
`acceptance.json`, `metrics.csv` and train log to `<results_dir>/fp8-acceptance/<arm>-seed<N>/`.
Both arms share the regenerated dataset and the token shards; the hidden states of each arm are
extracted once (the storage dtype is in the fingerprint, so they live side by side).

Draft and evaluation outputs are keyed by the fingerprint only, not by the seed. The trainer
does not resume a checkpoint in `draft/<fp>/train.work/` written under another seed
(`eagleflow.plan.settings.recipe_of`), but it would resume its own finished one, so every
`train.work/` is removed before a run: a repeated seed trains again. `--repeat ARM...` runs the
first seed of each arm named once more at the end, to check that training and evaluation are
deterministic.

Prints one row per run (vLLM eagle3 acceptance length, per-position acceptance, drafts; the
reference loop's acceptance length; the mean training loss of the last 10 steps) and per arm
the mean and min-max of the vLLM acceptance length and per-position acceptance; for a repeated
run, whether its training metrics (but the time) and every path's generated tokens equal the
first run's.
`--table-only` prints the table from the copies already there.

Usage: python benchmarks/fp8_acceptance.py [--seeds 0 1 2] [--repeat bf16 fp8] [--table-only]
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")
ARMS = {"bf16": "bfloat16", "fp8": "float8_e4m3fn"}


def results_dir(configfiles: list[str]) -> Path:
    results = yaml.safe_load((REPO / "config" / "config.yaml").read_text())["results_dir"]
    for path in configfiles:
        results = (yaml.safe_load(Path(path).read_text()) or {}).get("results_dir", results)
    return Path(results)


def run_arm(arm: str, seed: int, results: Path, configfiles: list[str], out: Path) -> None:
    """One training + export + evaluation of `arm` with `seed`; its figures copied to `out`."""
    for work in results.glob("draft/*/train.work"):
        shutil.rmtree(work)
    override = out / "override.yaml"
    out.mkdir(parents=True, exist_ok=True)
    override.write_text(
        yaml.safe_dump({"capture": {"storage_dtype": ARMS[arm]}, "draft": {"seed": seed}})
    )
    cmd = [SNAKEMAKE, "all", "--cores", "all", "--forcerun", "train_draft", "--configfile"]
    cmd += [*configfiles, str(override)]
    print(f"{arm} seed {seed}: {' '.join(cmd)}", flush=True)
    t0 = time.time()
    with open(out / "snakemake.log", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode:
        sys.exit(f"{arm} seed {seed}: snakemake failed (exit {proc.returncode}); see {log.name}")
    # The run's evaluation is the newest acceptance report; its directory names the fingerprint.
    report = max(results.glob("eval/*/acceptance.json"), key=lambda p: p.stat().st_mtime)
    if report.stat().st_mtime < t0:
        sys.exit(f"{arm} seed {seed}: no acceptance report written by this run")
    fp = report.parent.name
    shutil.copyfile(report, out / "acceptance.json")
    shutil.copyfile(results / "draft" / fp / "train" / "metrics.csv", out / "metrics.csv")
    shutil.copyfile(results / "logs" / "train_draft" / f"{fp}.log", out / "train_draft.log")
    (out / "run.json").write_text(
        json.dumps({"arm": arm, "seed": seed, "fingerprint": fp, "wall_s": time.time() - t0})
    )


def fingerprint_of_run(out: Path) -> tuple:
    """What a deterministic rerun reproduces: every metric but the time, and each path's
    generated tokens."""
    with open(out / "metrics.csv") as f:
        metrics = [{k: v for k, v in r.items() if k != "elapsed_s"} for r in csv.DictReader(f)]
    results = json.loads((out / "acceptance.json").read_text())["results"]
    return metrics, {name: r.get("output_token_ids") for name, r in results.items()}


def same_as(out: Path, original: Path) -> bool:
    return fingerprint_of_run(out) == fingerprint_of_run(original)


def row(out: Path) -> dict:
    run = json.loads((out / "run.json").read_text())
    run["repeat"] = out.name.endswith("-repeat")
    results = json.loads((out / "acceptance.json").read_text())["results"]
    eagle, ref = results["vllm_eagle3"], results.get("reference", {})
    with open(out / "metrics.csv") as f:
        last = list(csv.DictReader(f))[-10:]
    return {
        **run,
        "length": eagle["acceptance_length"],
        "per_pos": eagle["acceptance_rate_per_pos"],
        "drafts": eagle["num_drafts"],
        "reference": ref.get("acceptance_length"),
        "loss": statistics.mean(float(r["loss"]) for r in last),
    }


def fmt_pos(values) -> str:
    return " / ".join(f"{v:.3f}" for v in values)


def table(rows: list[dict]) -> None:
    print(
        "| arm | seed | fingerprint | acceptance length (vLLM eagle3) | per-position | drafts "
        "| reference loop | loss, last 10 steps |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['arm']} | {r['seed']}{' (repeat)' if r['repeat'] else ''} | "
            f"{r['fingerprint']} | {r['length']:.3f} | "
            f"{fmt_pos(r['per_pos'])} | {r['drafts']} | {r['reference']:.3f} | {r['loss']:.4f} |"
        )
    for arm in ARMS:
        mine = [r for r in rows if r["arm"] == arm and not r["repeat"]]
        if not mine:
            continue
        lengths = [r["length"] for r in mine]
        per_pos = list(zip(*(r["per_pos"] for r in mine)))
        print(
            f"{arm}: {len(mine)} runs, acceptance length mean {statistics.mean(lengths):.3f} "
            f"(min {min(lengths):.3f}, max {max(lengths):.3f}); per-position mean "
            f"{fmt_pos(statistics.mean(p) for p in per_pos)}, min "
            f"{fmt_pos(min(p) for p in per_pos)}, max {fmt_pos(max(p) for p in per_pos)}"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="draft.seed values")
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    ap.add_argument("--configfile", nargs="*", default=[], help="merged before the arm's")
    ap.add_argument(
        "--repeat", nargs="+", choices=list(ARMS), default=[], help="arms to run the first seed of"
    )
    ap.add_argument("--table-only", action="store_true", help="print the table, run nothing")
    args = ap.parse_args()
    args.configfile = [str(Path(p).resolve()) for p in args.configfile]
    results = results_dir(args.configfile)
    if not results.is_absolute():
        results = REPO / results
    root = results / "fp8-acceptance"
    runs = [(seed, arm, f"{arm}-seed{seed}") for seed in args.seeds for arm in args.arms]
    for arm in args.repeat:
        seed = args.seeds[0]
        runs.append((seed, arm, f"{arm}-seed{seed}-repeat"))
    if not args.table_only:
        for seed, arm, name in runs:
            run_arm(arm, seed, results, args.configfile, root / name)
    done = [name for _, _, name in runs if (root / name / "run.json").exists()]
    table([row(root / name) for name in done])
    for name in done:
        original = root / name.removesuffix("-repeat")
        if name.endswith("-repeat") and (original / "run.json").exists():
            same = same_as(root / name, original)
            print(
                f"{name}: training metrics and generated tokens "
                f"{'identical to' if same else 'DIFFER from'} {original.name}"
            )


if __name__ == "__main__":
    main()
