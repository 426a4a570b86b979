"""Model loads with and without engine reuse, on the real workflow, in one invocation.

The embedded default (the bundled conversations, the embedded DeepseekV3 target) cut into
`--shards` shards or more is prepared once (`snakemake prepare`: shards, fingerprint, capture
plan; no model), copied, and extracted twice with `snakemake --cores all extract`:
  1. per-shard engines (`extract.engine_reuse: false`): every extract job loads the model;
  2. engine reuse (the default): the first job starts an engine server, the others use it.
For each arm it prints the model loads, the wall time of the extract run, the seconds spent
starting engines, and their share of the wall time; last line `load_share=<value>` for the
reuse arm. Arms alternate with `--repeats` > 1 (medians).

As in the tests, the target is the untrained embedded target and regeneration is off (the
trained target costs minutes of CPU and loads like the untrained one).

Usage: .venv/bin/python benchmarks/engine_reuse.py [--shards 24] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

from eagleflow.serve.client import LOADED  # noqa: E402

SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")


def merged(base: dict, override: dict) -> dict:
    out = dict(base)
    for k, v in override.items():
        out[k] = merged(base.get(k, {}), v) if isinstance(v, dict) else v
    return out


def run(workdir: Path, target: str, config: dict) -> float:
    cfg = merged(yaml.safe_load((REPO / "config" / "config.yaml").read_text()), config)
    path = workdir / "bench-config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [SNAKEMAKE, target, "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir)]
    cmd += ["--configfile", str(path), "--cores", "all"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def engine_figures(workdir: Path) -> tuple[int, float, int]:
    """(model loads, seconds spent starting engines, shards) of an extract run."""
    hidden = next((workdir / "results" / "hidden").iterdir())
    records = [json.loads(p.read_text()) for p in hidden.glob("[0-9a-f]*[0-9a-f].json")]
    records = [r for r in records if "shard_id" in r]
    logs = list((workdir / "results" / "logs" / "extract").glob("*/engine-*.log"))
    if logs:  # servers: their logs count the loads and time them
        lines = [ln for p in logs for ln in p.read_text().splitlines() if LOADED in ln]
        seconds = sum(float(ln.split(" in ")[-1].rstrip(" s")) for ln in lines)
        return len(lines), seconds, len(records)
    loaded = [r for r in records if r["model_loaded"]]
    return len(loaded), sum(r["seconds"]["engine_start"] for r in loaded), len(records)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=24, help="at least this many shards")
    ap.add_argument("--conversations", type=int, default=3000, help="bundled conversations")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--workdir", help="where to build (default: a temporary directory)")
    args = ap.parse_args()
    base = {
        "target": {"path": "resources/targets/tiny-deepseek-v3"},
        "data": {
            "bundled_conversations": args.conversations,
            "shard_size": args.conversations // args.shards,
            "regenerate": {"enabled": False},
        },
    }
    root = Path(args.workdir or tempfile.mkdtemp(prefix="engine-reuse-"))
    prepared = root / "prepared"
    prepared.mkdir(parents=True, exist_ok=True)
    print(f"preparing {root} ({os.cpu_count()} cores) ...", flush=True)
    run(prepared, "prepare", base)
    arms = {"per_shard": {"extract": {"engine_reuse": False}}, "reuse": {}}
    results = {name: [] for name in arms}
    for rep in range(args.repeats):
        order = list(arms) if rep % 2 == 0 else list(reversed(arms))
        for name in order:
            work = root / f"{name}-{rep}"
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(prepared, work, symlinks=True)
            wall = run(work, "extract", merged(base, arms[name]))
            loads, start_s, shards = engine_figures(work)
            results[name].append((wall, loads, start_s, shards))
            print(
                f"{name} (run {rep + 1}): {shards} shards, {loads} model loads, wall "
                f"{wall:.1f} s, engine starts {start_s:.1f} s, load share {start_s / wall:.3f}",
                flush=True,
            )
    print(f"load average: {os.getloadavg()[0]:.2f}")
    share = {}
    for name, rows in results.items():
        wall = statistics.median(r[0] for r in rows)
        start_s = statistics.median(r[2] for r in rows)
        share[name] = start_s / wall
        print(
            f"{name}: {rows[0][3]} shards, {rows[0][1]} loads, median wall {wall:.1f} s, "
            f"median engine starts {start_s:.1f} s, load share {share[name]:.3f}"
        )
    print(f"load_share={share['reuse']:.3f}")


if __name__ == "__main__":
    main()
