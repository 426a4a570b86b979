"""`snakemake progress` (what extraction has left to do) in a fresh directory: it shards first,
then reads the target (the embedded one is built on the way), and loads no model."""

from support.workflow_runner import SMALL, snakemake


def test_progress_in_a_fresh_directory(tmp_path):
    snakemake(tmp_path, "progress", config=SMALL)
    report = (tmp_path / "results" / "logs" / "progress.log").read_text()
    assert "shards: 4 total, 0 done, 4 to do" in report, report
    assert "estimated time: unknown until a shard has been extracted" in report


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
    # 300 prompts x 20 tokens per reply at 100 tok/s, plus two engine starts of 20 s
    assert plan["generated_tokens_to_do"] == 6000 and plan["estimated_seconds"] == 100.0
    assert "1.7 min at 100.0 generated tok/s" in format_regeneration_plan(plan)
