"""Regeneration in the workflow, through real Snakemake and vLLM on the embedded (untrained) tiny
target: one job per source shard, SIGKILL and resume, an edited row, appended rows, a no-op
rerun. The measured figures are printed (pytest -s) for docs/measurements/regeneration.md."""

import json
import time

import pandas as pd
import pytest

from support.workflow_runner import (
    SHORT_REGENERATION,
    SMALL,
    copy_workdir,
    run_and_kill,
    snakemake,
    started_jobs,
)

pytestmark = pytest.mark.vllm

# 200 conversations in 2 source shards of 100 (= data.shard_size: one token shard each), chunks
# of 20 conversations; short replies (the untrained target loops until max_new_tokens).
REGEN = {
    "data": {
        # the user's own dataset: editing the bundled one would rebuild the embedded target
        "path": "my-data.jsonl",
        # the embedded target of the shared prepared run (tests/conftest.py: prepared_workdir)
        "bundled_conversations": SMALL["data"]["bundled_conversations"],
        "shard_size": 100,
        "regenerate": {**SHORT_REGENERATION, "shard_rows": 100, "chunk_rows": 20},
    }
}


def sources(workdir):
    return json.loads((workdir / "results" / "regenerated" / "sources.json").read_text())


def dataset(workdir):
    return workdir / "my-data.jsonl"


def token_shard_ids(workdir):
    manifest = pd.read_parquet(workdir / "results" / "shards" / "manifest.parquet")
    return list(dict.fromkeys(manifest["shard_id"]))


@pytest.fixture(scope="module")
def regenerated_workdir(prepared_workdir, tmp_path_factory):
    from eagleflow.embedded.bundled_data import generate_conversations

    workdir = copy_workdir(prepared_workdir, tmp_path_factory.mktemp("regen"))
    with open(dataset(workdir), "w") as f:
        for row in generate_conversations(200, seed=7):
            f.write(json.dumps(row) + "\n")
    t0 = time.time()
    proc = snakemake(workdir, "extract", config=REGEN)
    print(f"\nregenerate + extract, 200 conversations: {time.time() - t0:.0f} s")
    jobs = started_jobs(proc.stdout + proc.stderr)
    assert jobs["regenerate_shard"] == 2 and jobs["extract_shard"] == 2, jobs
    return workdir


def test_one_job_per_source_shard_and_every_row_accounted_for(regenerated_workdir):
    w = regenerated_workdir
    split = sources(w)
    assert [s["rows"] for s in split["shards"]] == [[0, 100], [100, 200]]
    kept = rejected = loads = 0
    for s in split["shards"]:
        summary = json.loads(
            (w / "results" / "regenerated" / f"{s['id']}.summary.json").read_text()
        )
        assert summary["chunks"] == 5 and summary["tokens_per_second"] > 0
        # engine reuse (the default): both jobs answered by one generate server
        assert summary["engine"]["server"]
        loads += summary["model_loaded"]
        kept, rejected = kept + summary["rows_kept"], rejected + summary["rows_rejected"]
        log = (w / "results" / "logs" / "regenerate" / f"{s['id']}.log").read_text()
        assert "generated tok/s" in log  # the progress bar
        assert (
            log.rstrip().splitlines()[-1].startswith(f"source shard {s['id']} done: 100 rows read")
        )
    assert loads == 1
    manifest = pd.read_parquet(w / "results" / "shards" / "manifest.parquet")
    shard_rejects = (w / "results" / "shards" / "rejects.jsonl").read_text().splitlines()
    assert kept + rejected == 200 == len(manifest) + len(shard_rejects)
    # the manifest names the dataset's rows; one token shard per source shard
    assert manifest["source_row"].tolist() == list(range(1, 201))
    assert len(token_shard_ids(w)) == 2


def test_a_noop_rerun_loads_no_model(regenerated_workdir):
    t0 = time.time()
    proc = snakemake(regenerated_workdir, "extract", config=REGEN)
    out = proc.stdout + proc.stderr
    assert "Nothing to be done" in out and not started_jobs(out), out[-2000:]
    print(f"\nno-op rerun: {time.time() - t0:.1f} s")


def test_sigkill_mid_shard_then_resume_gives_the_uninterrupted_shard(regenerated_workdir, tmp_path):
    reference = regenerated_workdir / "results" / "regenerated"
    work = copy_workdir(regenerated_workdir, tmp_path / "killed")
    sid = sources(work)["shards"][0]["id"]
    d = work / "results" / "regenerated"
    outputs = [d / f"{sid}{s}" for s in (".jsonl", ".rejects.jsonl", ".summary.json")]
    for p in outputs:
        p.unlink()
    partial = d / ".partial" / sid

    def chunks():
        return sorted(partial.glob("chunk-*.json")) if partial.exists() else []

    t0 = time.time()
    run_and_kill(
        work, [str(p.relative_to(work)) for p in outputs], REGEN, lambda: len(chunks()) >= 2
    )
    killed_after = time.time() - t0
    kept = {p.name: p.read_bytes() for p in chunks()}
    assert 2 <= len(kept) < 5 and not outputs[0].exists()
    t0 = time.time()
    proc = snakemake(work, *[str(p.relative_to(work)) for p in outputs], config=REGEN)
    resumed_in = time.time() - t0
    assert started_jobs(proc.stdout + proc.stderr) == {"regenerate_shard": 1}
    summary = json.loads(outputs[2].read_text())
    assert summary["chunks_resumed"] == len(kept) and summary["model_loaded"]
    assert summary["replies_now"] < summary["replies"]
    # committed replies kept byte for byte, and the same shard as the uninterrupted run
    rows = outputs[0].read_text().splitlines()
    committed = [
        json.dumps(r, ensure_ascii=False) for b in kept.values() for r in json.loads(b)["rows"]
    ]
    assert rows[: len(committed)] == committed
    assert outputs[0].read_bytes() == (reference / f"{sid}.jsonl").read_bytes()
    print(
        f"\nkill-and-resume: killed after {killed_after:.0f} s with {len(kept)} of "
        f"{summary['chunks']} chunks committed; rerun {resumed_in:.0f} s, 1 job, "
        f"{summary['replies_now']} of {summary['replies']} replies regenerated"
    )


def test_editing_one_row_and_appending_rows_regenerate_and_extract_only_those_shards(
    regenerated_workdir, tmp_path
):
    """One row of the second source shard edited and 10 rows appended, then one `snakemake
    extract`: the edited shard and the appended rows' new source shard are regenerated (one
    server), their token shards extracted; the first shard, untouched, is neither."""
    work = copy_workdir(regenerated_workdir, tmp_path / "edited")
    before_sources = [s["id"] for s in sources(work)["shards"]]
    before_tokens = token_shard_ids(work)
    lines = dataset(work).read_text().splitlines()
    row = json.loads(lines[149])
    row["messages"][0]["content"] = "What is the capital of Spain?"
    lines[149] = json.dumps(row)
    appended = [json.dumps({"id": f"new{i}", "turns": [f"Count to {i + 2}."]}) for i in range(10)]
    dataset(work).write_text("\n".join(lines + appended) + "\n")
    t0 = time.time()
    proc = snakemake(work, "extract", config=REGEN)
    jobs = started_jobs(proc.stdout + proc.stderr)
    assert jobs["regenerate_shard"] == 2 and jobs["extract_shard"] == 2, jobs
    after_sources = [s["id"] for s in sources(work)["shards"]]
    assert len(after_sources) == 3 and after_sources[0] == before_sources[0]
    assert after_sources[1] != before_sources[1]
    after_tokens = token_shard_ids(work)
    assert len(after_tokens) == 3 and after_tokens[0] == before_tokens[0]
    assert after_tokens[1] != before_tokens[1]
    summaries = [
        json.loads((work / "results" / "regenerated" / f"{sid}.summary.json").read_text())
        for sid in after_sources[1:]
    ]
    assert [s["rows_kept"] + s["rows_rejected"] for s in summaries] == [100, 10]
    assert sum(s["model_loaded"] for s in summaries) == 1  # both jobs, one server
    print(
        f"\nedit one row and append 10: {time.time() - t0:.0f} s, jobs {jobs}, "
        f"{[s['replies_now'] for s in summaries]} replies regenerated"
    )
