"""How long Snakemake takes to decide that a finished extraction has nothing to do.

Builds 1,000 and 10,000 completed synthetic shards (every file a finished run leaves: token
shards, hidden-state shards with valid headers, extraction records, verification reports,
summary) for the real workflow, then times `snakemake --cores 1 extract` (which must print
"Nothing to be done"), with the workflow's own per-run integrity check of every shard included.
Prints seconds per 1,000 shards; the last line is `seconds_per_1000_shards=<value at 10,000>`.
Target on a 2-core machine: under 5 s for 1,000 shards and under 30 s for 10,000.

Usage: .venv/bin/python benchmarks/rerun_overhead.py [--sizes 1000 10000] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

from streaming_writer import StreamingWriter  # noqa: E402

from eagleflow.data.shards import TokenShard, write_token_shard  # noqa: E402
from eagleflow.embedded.tiny_target import build_tiny_target  # noqa: E402
from eagleflow.extract.fingerprint import config_fingerprint  # noqa: E402

SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")


def build(workdir: Path, n_shards: int, target: Path) -> Path:
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    data = workdir / "data.jsonl"
    data.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                ]
            }
        )
        + "\n"
    )
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["target"]["path"] = str(target)
    config["data"]["path"] = str(data)
    # The synthetic shards are made from this file as it is (no response regeneration).
    config["data"]["regenerate"] = {"enabled": False}
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    from snakemake.utils import validate

    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))  # fills defaults
    fp, record = config_fingerprint(config)
    layer_ids = [2, 4, 5, 8]
    results = workdir / "results"
    tokens_dir, hidden = results / "shards" / "tokens", results / "hidden" / fp
    tokens_dir.mkdir(parents=True)
    hidden.mkdir(parents=True)
    ids = [secrets.token_hex(10) for _ in range(n_shards)]
    rows, summary = [], []
    input_ids = torch.arange(8, dtype=torch.int64)
    for shard_id in ids:
        shard = TokenShard(
            shard_id,
            [shard_id],
            input_ids.numpy(),
            torch.ones(8, dtype=torch.uint8).numpy(),
            torch.tensor([0, 8]).numpy(),
        )
        write_token_shard(shard, tokens_dir / f"{shard_id}.safetensors")
        rows.append(
            {
                "sample_id": shard_id,
                "shard_id": shard_id,
                "n_tokens": 8,
                "n_loss_tokens": 8,
                "source_file": str(data),
                "source_row": len(rows) + 1,
            }
        )
    (results / "shards" / "rejects.jsonl").write_text("")
    pd.DataFrame(rows).to_parquet(results / "shards" / "manifest.parquet", index=False)
    (hidden / "fingerprint.json").write_text(json.dumps(record))
    (hidden / "validate_env.json").write_text("{}")
    (hidden / "capture_plan.json").write_text(
        json.dumps(
            {"layer_ids": layer_ids, "strategy": "aux_layers", "hidden_size": 16, "fingerprint": fp}
        )
    )
    for shard_id in ids:
        meta = {"fingerprint": fp, "shard_id": shard_id, "layer_ids": json.dumps(layer_ids)}
        w = StreamingWriter(
            hidden / f"{shard_id}.safetensors",
            [("hidden_states", torch.bfloat16, (8, 4, 16)), ("input_ids", torch.int64, (8,))],
            meta,
        )
        w.write("hidden_states", torch.ones(8, 4, 16, dtype=torch.bfloat16))
        w.write("input_ids", input_ids)
        sha, size = w.close()
        rec = {
            "shard_id": shard_id,
            "sha256": sha,
            "bytes": size,
            "n_tokens": 8,
            "tokens_per_second": 1.0,
        }
        (hidden / f"{shard_id}.json").write_text(json.dumps(rec))
        (hidden / f"{shard_id}.verify.json").write_text(
            json.dumps({"shard_id": shard_id, "ok": True})
        )
        summary.append(rec)
    pd.DataFrame(summary).to_csv(hidden / "verify_summary.tsv", sep="\t", index=False)
    pd.DataFrame(summary).to_parquet(hidden / "manifest.parquet", index=False)
    # Outputs newer than their inputs, as after a real run.
    t = time.time() - 3600
    order = [
        data,
        *target.iterdir(),
        *tokens_dir.iterdir(),
        tokens_dir,
        results / "shards" / "manifest.parquet",
        results / "shards" / "rejects.jsonl",
        hidden / "fingerprint.json",
        hidden / "validate_env.json",
        hidden / "capture_plan.json",
    ]
    for i, p in enumerate(order):
        os.utime(p, (t + i * 1e-3, t + i * 1e-3))
    for suffix, step in ((".safetensors", 10), (".json", 10), (".verify.json", 20)):
        for shard_id in ids:
            os.utime(hidden / f"{shard_id}{suffix}", (t + 60 + step, t + 60 + step))
    for name in ("verify_summary.tsv", "manifest.parquet"):
        os.utime(hidden / name, (t + 120, t + 120))
    return workdir


def time_noop(workdir: Path) -> float:
    cmd = [
        SNAKEMAKE,
        "--snakefile",
        str(REPO / "Snakefile"),
        "--directory",
        str(workdir),
        "--configfile",
        str(workdir / "config.yaml"),
        "--cores",
        "1",
        "extract",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 or "Nothing to be done" not in out:
        raise SystemExit(f"not a no-op run ({proc.returncode}):\n{out[-4000:]}")
    return elapsed


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/eagleflow-rerun-bench"))
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    target = args.workdir / "target"
    if not (target / "config.json").exists():
        from eagleflow.embedded.bundled_data import generate_conversations

        rows = generate_conversations(200)
        build_tiny_target([m["content"] for r in rows for m in r["messages"]], target)
    per_1000 = None
    for n in args.sizes:
        work = build(args.workdir / f"shards-{n}", n, target)
        times = sorted(time_noop(work) for _ in range(args.repeats))
        best = times[0]
        per_1000 = best / n * 1000
        print(
            f"{n} shards: no-op rerun decision {best:.2f} s (runs: "
            f"{', '.join(f'{x:.2f}' for x in times)}), "
            f"{per_1000:.2f} s per 1,000 shards"
        )
    print(f"seconds_per_1000_shards={per_1000:.3f}")


if __name__ == "__main__":
    main()
