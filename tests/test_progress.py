"""`snakemake progress` (what extraction has left to do) in a fresh directory: it shards first,
then reads the target (the embedded one is built on the way), and loads no model."""

import pytest

from support.workflow_runner import SMALL, snakemake


@pytest.mark.slow
def test_progress_in_a_fresh_directory(tmp_path):
    snakemake(tmp_path, "progress", config=SMALL)
    report = (tmp_path / "results" / "logs" / "progress.log").read_text()
    assert "shards: 4 total, 0 done, 4 to do" in report, report
    assert "estimated time: unknown until a shard has been extracted" in report


@pytest.mark.slow
def test_progress_reports_regeneration_without_running_it(tmp_path):
    from support.workflow_runner import merged

    config = merged(SMALL, {"data": {"regenerate": {"enabled": True, "shard_rows": 100}}})
    snakemake(tmp_path, "progress", config=config)
    report = (tmp_path / "results" / "logs" / "progress.log").read_text()
    assert "regeneration source shards: 4 total, 0 done, 4 to do" in report, report
    assert "regeneration estimated time: unknown until a source shard" in report
    assert "extraction: planned once every source shard is regenerated" in report
    assert not list((tmp_path / "results" / "regenerated").glob("*.jsonl"))  # nothing ran


def test_regeneration_plan_estimates_from_finished_shards(tmp_path):
    import json

    from eagleflow.extract.progress import format_regeneration_plan, regeneration_plan

    sources = {
        "rows_read": 300,
        "shards": [{"id": s, "prompts": 150} for s in ("a", "b", "c")],
    }
    (tmp_path / "a.jsonl").write_text("")
    summary = {
        "model_loaded": True,
        "replies_now": 150,
        "generated_tokens_now": 3000,
        "tokens_per_second": 100.0,
        "engine_start_s": 20.0,
    }
    (tmp_path / "a.summary.json").write_text(json.dumps(summary))
    (tmp_path / ".partial" / "b").mkdir(parents=True)
    (tmp_path / ".partial" / "b" / "chunk-00000.json").write_text("{}")
    plan = regeneration_plan(sources, tmp_path, max_new_tokens=64)
    assert plan["source_shards_done"] == 1 and plan["prompts_to_do"] == 300
    assert plan["chunks_committed_in_unfinished_shards"] == 1
    # 300 prompts x 20 tokens per reply at 100 tok/s, plus two model loads of 20 s
    assert plan["generated_tokens_to_do"] == 6000 and plan["estimated_seconds"] == 100.0
    text = format_regeneration_plan(plan)
    assert "1.7 min at 100.0 generated tok/s" in text
    assert "a 20.0 s model load in every job" in text


def test_extraction_eta_counts_loads_as_often_as_the_finished_jobs_paid_them(tmp_path):
    """With engine reuse one job loads and the others connect: the time left counts one load
    per server, at the rate the SLURM time limits use (extract.rates.measure)."""
    import json

    import pandas as pd

    from eagleflow.extract.progress import extraction_progress, format_progress

    manifest = pd.DataFrame({"shard_id": [f"{i:020x}" for i in range(6)], "n_tokens": 1000})
    for i, (loaded, start) in enumerate([(True, 40.0), (False, 0.1)]):
        shard = f"{i:020x}"
        (tmp_path / f"{shard}.safetensors").write_bytes(b"")
        record = {
            "tokens_extracted_now": 1000,
            "tokens_per_second": 100.0,
            "model_loaded": loaded,
            "seconds": {"engine_start": start},
        }
        (tmp_path / f"{shard}.json").write_text(json.dumps(record))
    plan = extraction_progress(manifest, tmp_path, 4, 256, "bfloat16")
    assert plan["shards_done"] == 2 and plan["tokens_to_do"] == 4000
    # 4000 tokens at 100 tok/s, plus a 40 s load in half of the 4 jobs left
    assert plan["estimated_seconds"] == 40.0 + 80.0
    assert "a 40.0 s model load in 0.50 of the jobs" in format_progress(plan)
