"""Stored, streamed and cached states side by side (`draft.states`, docs/streaming.md).

One prepared run of the embedded default (`snakemake prepare`: the target built and trained,
the data sharded, the capture plan checked) is copied three times; each copy runs
`snakemake all` in one mode, with the same seed and recipe (2 epochs, so that `cached` has a
later epoch to read; its budget is half of what `stored` writes). Per mode it prints:
- bytes of states on disk (extracted shards and cache under results/hidden/),
- wall time of `snakemake all` (extraction included for `stored`),
- the trainer's `data_wait_share` (summary.json),
- the engine server's busy share while training (its log's last `states:` line; `stored`
  has no server while training),
- the evaluated eagle3 acceptance length (acceptance.json).

The last line is `stream_bytes=<n> stream_al=<x> stored_al=<y>`.
Usage: .venv/bin/python benchmarks/streaming.py [--workdir DIR] [--epochs 2] [--seed 0]
Record: docs/measurements/streaming.md.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

# `snakemake <target>` in a working directory with settings over config/config.yaml, timed:
# the engine-reuse benchmark's runner.
from engine_reuse import run  # noqa: E402


def states_bytes(hidden: Path) -> int:
    """Bytes the run's states take on disk: extracted shards and the state cache."""
    files = [p for p in hidden.rglob("*.safetensors") if p.is_file()]
    return sum(p.stat().st_blocks * 512 for p in files)


def engine_busy_share(logs: Path) -> float | None:
    """busy / alive seconds from the capture server's last `states:` line, if it served."""
    last = None
    for log in logs.glob("engine-*.log"):
        for line in log.read_text(errors="replace").splitlines():
            m = re.match(r"states: .*busy ([\d.]+) s of ([\d.]+) s", line)
            if m:
                last = float(m.group(1)) / float(m.group(2))
    return last


def measure(workdir: Path, mode: str, config: dict) -> dict:
    seconds = run(workdir, "all", config)
    (hidden,) = [p for p in (workdir / "results" / "hidden").iterdir() if p.is_dir()]
    fp = hidden.name
    summary = json.loads((workdir / "results/draft" / fp / "train/summary.json").read_text())
    report = json.loads((workdir / "results/eval" / fp / "acceptance.json").read_text())
    return {
        "mode": mode,
        "states_bytes": states_bytes(hidden),
        "wall_s": round(seconds, 1),
        "data_wait_share": round(summary["data_wait_share"], 4),
        "engine_busy_share": engine_busy_share(workdir / "results/logs/extract" / fp),
        "train_s": round(summary["seconds"], 1),
        "acceptance_length": report["results"]["vllm_eagle3"]["acceptance_length"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/eagleflow-streaming-bench"))
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    base = a.workdir / "prepared"
    draft = {"epochs": a.epochs, "seed": a.seed}
    if not (base / "prepared.ok").exists():
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        seconds = run(base, "prepare", {"draft": draft})
        (base / "prepared.ok").write_text(f"{seconds:.1f}\n")
        print(f"prepared (target, shards, plan) in {seconds:.0f} s", flush=True)
    rows = []
    for mode in ("stored", "stream", "cached"):
        work = a.workdir / mode
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(base, work, symlinks=True)
        settings = dict(draft, states=mode)
        if mode == "cached":  # half of what the stored run wrote: a later epoch streams the rest
            settings["cache_bytes"] = rows[0]["states_bytes"] // 2
        rows.append(measure(work, mode, {"draft": settings}))
        print(json.dumps(rows[-1]), flush=True)
    print(
        f"\n{'mode':8} {'states bytes':>14} {'wall s':>8} {'train s':>8} {'wait':>7} "
        f"{'engine busy':>11} {'AL':>6}"
    )
    for r in rows:
        busy = "-" if r["engine_busy_share"] is None else f"{r['engine_busy_share']:.3f}"
        print(
            f"{r['mode']:8} {r['states_bytes']:>14,} {r['wall_s']:>8.1f} {r['train_s']:>8.1f} "
            f"{r['data_wait_share']:>7.4f} {busy:>11} {r['acceptance_length']:>6.3f}"
        )
    stored, stream = rows[0], rows[1]
    print(
        f"stream_bytes={stream['states_bytes']} stream_al={stream['acceptance_length']:.3f} "
        f"stored_al={stored['acceptance_length']:.3f}"
    )


if __name__ == "__main__":
    main()
