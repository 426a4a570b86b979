"""llama against mla drafts through the rules (issue 36): `snakemake all` per arm and seed on
one finished extraction, the vLLM eagle3 acceptance length on every held-out prompt, and the
paired difference of each MLA arm to the llama draft.

Arms (`draft.architecture`; evaluate.mla null serves each as it needs):
- `llama`: the workflow's draft (GQA, heads of 64);
- `mla`: the target's own MLA shape, as the published Kimi MLA drafts keep their target's;
- `mla_matched`: MLA at the llama draft's parameter budget: the target's heads, kv_lora_rank
  and rope dims (vLLM's CPU MLA kernel takes only kv_lora_rank + rope = 576), the query rank
  and the nope and v head dims (equal, as in the published shapes) cut to the
  trainable-parameter count nearest the llama draft's.

Each run is `snakemake --cores N all --forcerun train_draft` in `--workdir` (a run whose
`extract` is done) with the workflow's config, the arm, `draft.seed` and the evaluation below,
so `train_draft`, `export_draft` and `evaluate` run as a user runs them. A run's figures are
copied to `<workdir>/arch-runs/<arm>-seed<s>/result.json` and read back, not redone, on a rerun.
Seeds pair the runs: seed s of every arm shares the data order.

Per run: the AL and its 95% interval, drafts, trainable parameters, training tokens/s (the
trainer's `summary.json`), and train_draft's wall time and peak RSS (its Snakemake benchmark
file). Per arm: the mean AL, and the paired difference to llama with its standard error.
Last line: `llama_al=<mean> mla_al=<mean> mla_matched_al=<mean>`.

Usage (from the repository root):
  .venv/bin/snakemake --cores all extract    # or any finished run
  .venv/bin/python benchmarks/draft_architecture.py --workdir . --seeds 0 1 2

Another target: its settings merged into one file, given to the extraction and to this script
alike (`--configfile`). Snakemake compares a rule's dict params by their text, so the same
sections in another key order would re-run the rules that take them (the target's training,
the regeneration), not only the draft's:
  .venv/bin/snakemake --cores all extract --configfile kimi.yaml
  .venv/bin/python benchmarks/draft_architecture.py --workdir . --configfile kimi.yaml
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pandas as pd
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_head_to_head import paired_difference  # noqa: E402

from eagleflow.plan.settings import DraftSettings  # noqa: E402

ARMS = ("llama", "mla", "mla_matched")
# Aux states the draft fuses: the capture's layer ids but the last (the target's final state).
NUM_AUX = 3
# Every held-out prompt at the published cards' k = 3, the vLLM eagle3 path alone.
K = 3
EVALUATION = {
    "speculative_tokens": [K],
    "paths": ["vllm_eagle3"],
    "sets": [{"name": "heldout"}],
}


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def with_defaults(config: dict) -> dict:
    """A copy of `config` with the schema's defaults filled, as Snakemake fills them."""
    from snakemake.utils import validate

    config = copy.deepcopy(config)
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    return config


def merged(base: dict, override: dict) -> dict:
    out = dict(base)
    for k, v in override.items():
        out[k] = merged(base.get(k) or {}, v) if isinstance(v, dict) else v
    return out


def trainable_parameters(target_config: dict, vocab_size: int, num_aux: int, overrides) -> int:
    """Trainable parameters of the draft the trainer builds (its frozen embedding left out)."""
    from eagleflow.draft.model import Eagle3Draft, draft_config_for

    with torch.device("meta"):  # counted, never allocated (a Kimi-sized draft is GBs)
        draft = Eagle3Draft(draft_config_for(target_config, vocab_size, num_aux, **overrides))
    return sum(p.numel() for p in draft.parameters() if p.requires_grad)


def matched_mla_shape(target_config: dict, vocab_size: int, num_aux: int) -> dict:
    """The MLA shape keys nearest the llama draft's trainable parameters: the target's heads,
    kv_lora_rank and rope dims kept; qk_nope_head_dim = v_head_dim as in the published shapes
    (DeepSeek-V3 and Kimi-K2.5: 128 and 128) and q_lora_rank, each a sixteenth of the
    target's or a multiple of it. Ties go to the larger query rank."""
    from eagleflow.draft.model import mla_shape_of

    text = target_config.get("text_config", target_config)
    shape = mla_shape_of(text, {})
    budget = trainable_parameters(target_config, vocab_size, num_aux, {})

    def steps(top: int) -> list[int]:  # sixteenths of the target's, none under 8
        return sorted({max(8, round(top * i / 16)) for i in range(1, 17)})

    best = None
    head_top = min(shape["qk_nope_head_dim"], shape["v_head_dim"])
    for q in steps(shape["q_lora_rank"]):
        for d in steps(head_top):
            keys = {"q_lora_rank": q, "qk_nope_head_dim": d, "v_head_dim": d}
            n = trainable_parameters(target_config, vocab_size, num_aux, {"decoder": "mla", **keys})
            key = (abs(n - budget), -q)
            if best is None or key < best[0]:
                best = (key, keys)
    return best[1]


def arm_config(arm: str, matched: dict) -> dict:
    """The arm's `draft:` keys; evaluate.mla stays null, so that vLLM's MLA follows the draft."""
    if arm == "llama":
        return {"draft": {"architecture": "llama"}}
    shape = matched if arm == "mla_matched" else {}
    return {"draft": {"architecture": "mla", **shape}}


def only(paths: list[Path], what: str) -> Path:
    if len(paths) != 1:
        sys.exit(f"expected one {what}, found {[str(p) for p in paths]}")
    return paths[0]


def run_one(args, arm: str, seed: int, base: dict, matched: dict) -> dict:
    run = args.workdir / "arch-runs" / f"{arm}-seed{seed}"
    done = run / "result.json"
    if done.exists():
        return json.loads(done.read_text())
    run.mkdir(parents=True, exist_ok=True)
    config = merged(
        merged(base, arm_config(arm, matched)),
        {"draft": {"seed": seed}, "evaluate": EVALUATION},
    )
    configfile = run / "config.yaml"
    # in the config's own key order: Snakemake compares dict params by their repr, so a
    # sorted dump would re-run the rules that take a config section as a param
    configfile.write_text(yaml.safe_dump(config, sort_keys=False))
    cmd = [
        str(Path(sys.executable).parent / "snakemake"),
        "--snakefile",
        str(REPO / "Snakefile"),
        "--directory",
        str(args.workdir),
        "--configfile",
        str(configfile),
        "--cores",
        str(args.cores),
        "--forcerun",
        "train_draft",
        "all",
    ]
    print(f"--- {arm}, seed {seed}: {' '.join(cmd)}", flush=True)
    with open(run / "snakemake.log", "w") as log:
        proc = subprocess.run(cmd, cwd=args.workdir, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.exit(f"{arm} seed {seed}: snakemake failed, see {run / 'snakemake.log'}")

    results = args.workdir / config["results_dir"]
    summary_file = only(list(results.glob("draft/*/train/summary.json")), "train summary")
    fp = summary_file.parents[1].name
    report_file = results / "eval" / fp / "acceptance.json"
    bench_file = results / "benchmarks" / "train_draft" / f"{fp}.tsv"
    for f in (summary_file, report_file, bench_file):
        shutil.copy(f, run / f.name)
    summary = json.loads(summary_file.read_text())
    report = json.loads(report_file.read_text())
    bench = pd.read_csv(bench_file, sep="\t").iloc[-1]
    figures = report["runs"]["heldout"][str(K)]["vllm_eagle3"]
    target_config = read_json(args.workdir / base["target"]["path"] / "config.json")
    draft = DraftSettings.from_config(with_defaults(config))
    result = {
        "arm": arm,
        "seed": seed,
        "acceptance_length": figures["acceptance_length"],
        "interval": figures.get("interval"),
        "num_drafts": figures.get("num_drafts"),
        "prompts": report["sets"]["heldout"]["prompts"],
        "trainable_parameters": trainable_parameters(
            target_config, draft.vocab_size, NUM_AUX, draft.model.overrides()
        ),
        "tokens_per_second": summary["tokens_per_second"],
        "tokens_trained": summary["tokens_trained"],
        "steps": summary["steps"],
        "simulated_al": summary["simulated_acceptance_length"]["total"],
        "train_wall_s": float(bench["s"]),
        "train_max_rss_mb": float(bench["max_rss"]),
        "shape": matched if arm == "mla_matched" else None,
    }
    done.write_text(json.dumps(result, indent=1))
    print(f"{arm} seed {seed}: AL {result['acceptance_length']:.3f}", flush=True)
    return result


def print_table(results: dict, seeds: list[int]) -> dict:
    print(
        f"{'arm':<12} {'seed':>4} {'AL':>6} {'95% interval':>15} {'drafts':>6} {'params':>9} "
        f"{'tok/s':>6} {'train_s':>7} {'rss_MB':>7}"
    )
    for (arm, seed), r in sorted(results.items(), key=lambda kv: (ARMS.index(kv[0][0]), kv[0][1])):
        iv = r.get("interval") or {}
        span = f"[{iv['low']:.2f}, {iv['high']:.2f}]" if "low" in iv else "-"
        print(
            f"{arm:<12} {seed:>4} {r['acceptance_length']:>6.3f} {span:>15} {r['num_drafts']:>6} "
            f"{r['trainable_parameters']:>9,} {r['tokens_per_second']:>6.1f} "
            f"{r['train_wall_s']:>7.0f} {r['train_max_rss_mb']:>7.0f}"
        )
    means = {}
    for arm in ARMS:
        runs = [results[(arm, s)] for s in seeds if (arm, s) in results]
        if not runs:
            continue
        means[arm] = statistics.fmean(r["acceptance_length"] for r in runs)
        cost = statistics.fmean(r["train_wall_s"] for r in runs)
        line = f"{arm}: mean AL {means[arm]:.3f} over {len(runs)} seeds, train {cost:.0f} s"
        paired = [s for s in seeds if (arm, s) in results and ("llama", s) in results]
        if arm != "llama" and paired:
            diff, se = paired_difference(
                [results[(arm, s)]["acceptance_length"] for s in paired],
                [results[("llama", s)]["acceptance_length"] for s in paired],
            )
            llama_cost = statistics.fmean(results[("llama", s)]["train_wall_s"] for s in paired)
            line += (
                f"; minus llama, paired by seed {paired}: {diff:+.3f} +- {se:.3f} (SE), "
                f"training cost {cost / llama_cost:.2f}x"
            )
        print(line)
    return means


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path.cwd())
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--configfile", nargs="*", default=[], help="merged over config.yaml")
    p.add_argument("--cores", type=int, default=2)
    args = p.parse_args(argv)
    args.workdir = args.workdir.resolve()
    base = yaml.safe_load((args.workdir / "config" / "config.yaml").read_text())
    for extra in args.configfile:
        base = merged(base, yaml.safe_load(Path(extra).read_text()))
    target_config = read_json(args.workdir / base["target"]["path"] / "config.json")
    vocab_size = DraftSettings.from_config(with_defaults(base)).vocab_size
    matched = matched_mla_shape(target_config, vocab_size, NUM_AUX)
    budget = trainable_parameters(target_config, vocab_size, NUM_AUX, {})
    print(f"llama draft: {budget:,} trainable parameters; mla_matched shape {matched}")
    results = {}
    for seed in args.seeds:
        for arm in args.arms:
            results[(arm, seed)] = run_one(args, arm, seed, base, matched)
    print()
    means = print_table(results, args.seeds)
    print(" ".join(f"{arm}_al={means[arm]:.3f}" for arm in ARMS if arm in means))


if __name__ == "__main__":
    main()
