"""The workflow itself: config validation (fast) and the whole extraction through real vLLM."""

import json
import os
import re
import time

import pandas as pd
import pytest
from safetensors import safe_open

from eagleflow.capture.plan import CapturePlan, Strategy
from support.workflow_runner import SMALL, copy_workdir, hidden_dir, snakemake


def test_unknown_config_key_stops_the_run_naming_it(tmp_path):
    proc = snakemake(
        tmp_path, "-n", "extract", config={"extract": {"tensor_paralel_size": 2}}, check=False
    )
    assert proc.returncode != 0
    assert "tensor_paralel_size" in proc.stderr + proc.stdout


def test_bad_config_value_stops_the_run_naming_it(tmp_path):
    proc = snakemake(
        tmp_path, "-n", "extract", config={"capture": {"strategy": "guess"}}, check=False
    )
    assert proc.returncode != 0
    out = proc.stderr + proc.stdout
    assert "guess" in out and "strategy" in out


@pytest.mark.vllm
def test_extract_end_to_end_through_real_vllm(extracted_workdir):
    fp_dir = hidden_dir(extracted_workdir)
    summary = pd.read_csv(fp_dir / "verify_summary.tsv", sep="\t")
    manifest = pd.read_parquet(extracted_workdir / "results" / "shards" / "manifest.parquet")
    assert len(summary) == manifest["shard_id"].nunique() >= 4
    assert summary["ok"].all()
    assert summary["n_tokens"].sum() == manifest["n_tokens"].sum()
    plan = CapturePlan.load(fp_dir / "capture_plan.json")
    assert plan.strategy is Strategy.AUX_LAYERS and plan.layer_ids == [2, 4, 5, 8]
    shard_id = summary["shard_id"].iloc[0]
    with safe_open(str(fp_dir / f"{shard_id}.safetensors"), framework="pt") as f:
        meta = f.metadata()
        assert json.loads(meta["layer_ids"]) == [2, 4, 5, 8]
        assert meta["layer_id_convention"] == "vllm" and meta["fingerprint"] == fp_dir.name
        hs = f.get_tensor("hidden_states")
        assert hs.shape[1:] == (4, 256) and str(hs.dtype) == "torch.bfloat16"
    lines = (
        (extracted_workdir / "results" / "logs" / "extract" / fp_dir.name / f"{shard_id}.log")
        .read_text()
        .splitlines()
    )
    # The job's last line is its summary, the record's figures with a measured rate; only
    # Python's resource tracker may speak after it, at exit.
    summary_line = re.compile(
        rf"shard {re.escape(shard_id)}: (\d+) tokens, ([\d.]+) tok/s, (\d+) bytes, "
    )
    (last,) = [i for i, line in enumerate(lines) if summary_line.match(line)]
    n_tokens, rate, size = summary_line.match(lines[last]).groups()
    record = json.loads((fp_dir / f"{shard_id}.json").read_text())
    assert (int(n_tokens), float(rate), int(size)) == (
        record["n_tokens"],
        record["tokens_per_second"],
        record["bytes"],
    )
    assert float(rate) > 0 and int(size) == (fp_dir / f"{shard_id}.safetensors").stat().st_size
    assert all("resource_tracker" in line or "warnings.warn" in line for line in lines[last + 1 :])
    # No temporary or partial files are left behind.
    assert not list(fp_dir.glob("*.tmp")) and not any((fp_dir / ".partial").glob("*/chunk-*"))


@pytest.mark.vllm
def test_rerun_does_nothing_even_after_touching_inputs(extracted_workdir, tmp_path):
    work = copy_workdir(extracted_workdir, tmp_path / "w")  # the shared run stays untouched
    later = time.time() + 5
    for p in [
        work / "resources" / "data" / "bundled-chat.jsonl",
        *(work / "resources" / "targets" / "tiny-deepseek-v3").iterdir(),
    ]:
        os.utime(p, (later, later))
    proc = snakemake(work, "extract", config=SMALL)
    assert "Nothing to be done" in proc.stdout + proc.stderr, (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )
