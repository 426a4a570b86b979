"""Content-addressed outputs: what a rerun does after appends, edits, config changes and damage.

Decisions are read from Snakemake's own dry-run job table, so these tests are exact and cheap;
the append case is also run for real."""

import json

import pandas as pd
import pytest

from eagleflow.store.headers import read_header
from support.workflow_runner import (
    SMALL,
    copy_workdir,
    hidden_dir,
    job_counts,
    snakemake,
    started_jobs,
)

pytestmark = pytest.mark.vllm


def user_dataset(workdir, rows):
    path = workdir / "my-data.jsonl"
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def bundled_rows(workdir):
    with open(workdir / "resources" / "data" / "bundled-chat.jsonl") as f:
        return [json.loads(line) for line in f]


def dry_run(workdir, config):
    # Sharding, validation and the capture plan are cheap and decide the jobs: run them, then
    # ask what extraction would do.
    snakemake(workdir, "prepare", config=config)
    proc = snakemake(workdir, "-n", "extract", config=config)
    return job_counts(proc.stdout + proc.stderr), proc.stdout + proc.stderr


def test_progress_reports_everything_done(extracted_workdir, tmp_path):
    work = copy_workdir(extracted_workdir, tmp_path / "w")  # Snakemake locks and logs there
    proc = snakemake(work, "progress", config=SMALL)
    assert "shards: 4 total, 4 done, 0 to do" in proc.stdout
    assert "tokens_to_do" not in proc.stdout and "bytes to write: 0.000 GiB" in proc.stdout


def test_same_content_in_another_file_reuses_every_shard(extracted_workdir, tmp_path):
    work = copy_workdir(extracted_workdir, tmp_path / "w")
    data = user_dataset(work, bundled_rows(work))
    counts, _ = dry_run(work, {**SMALL, "data": {**SMALL["data"], "path": str(data)}})
    assert counts.get("extract_shard", 0) == 0


def test_editing_one_sample_re_extracts_only_its_shard(extracted_workdir, tmp_path):
    work = copy_workdir(extracted_workdir, tmp_path / "w")
    rows = bundled_rows(work)
    rows[150]["messages"][-1]["content"] += " Really."
    data = user_dataset(work, rows)
    counts, out = dry_run(work, {**SMALL, "data": {**SMALL["data"], "path": str(data)}})
    assert counts["extract_shard"] == 1, out[-3000:]


def test_changing_layer_ids_extracts_into_a_new_fingerprint_and_keeps_the_old(
    extracted_workdir, tmp_path
):
    work = copy_workdir(extracted_workdir, tmp_path / "w")
    old = hidden_dir(work)
    before = sorted(p.name for p in old.iterdir())
    counts, out = dry_run(work, {**SMALL, "capture": {"layer_ids": [2, 4, 8]}})
    assert counts["extract_shard"] == 4 and old.name not in out.split("Job stats")[-1]
    assert sorted(p.name for p in old.iterdir()) == before


def test_appending_samples_extracts_only_the_new_shard(extracted_workdir, tmp_path):
    from eagleflow.embedded.bundled_data import generate_conversations

    work = copy_workdir(extracted_workdir, tmp_path / "w")
    new = [{**r, "id": f"appended-{i}"} for i, r in enumerate(generate_conversations(100, seed=7))]
    rows = bundled_rows(work) + new
    data = user_dataset(work, rows)
    config = {**SMALL, "data": {**SMALL["data"], "path": str(data)}}
    fp_dir = hidden_dir(work)
    old = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in fp_dir.glob("*.safetensors")}
    proc = snakemake(work, "extract", config=config)
    started = started_jobs(proc.stdout + proc.stderr)
    assert (
        started["shard"] == 1 and started["extract_shard"] == 1 and started["verify_summary"] == 1
    ), started
    new = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in fp_dir.glob("*.safetensors")}
    assert len(new) == 5 and all(new[name] == stat for name, stat in old.items())
    assert pd.read_csv(fp_dir / "verify_summary.tsv", sep="\t")["ok"].all()


def test_truncated_shard_is_quarantined_and_re_extracted(extracted_workdir, tmp_path):
    work = copy_workdir(extracted_workdir, tmp_path / "w")
    fp_dir = hidden_dir(work)
    victim = sorted(fp_dir.glob("*.safetensors"))[0]
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    # A dry run (`snakemake -n`, perhaps beside a running extract) only reports.
    proc = snakemake(work, "-n", "extract", config=SMALL)
    out = proc.stdout + proc.stderr
    assert f"shard {victim.stem} fails the integrity check" in out and "dry run" in out
    assert victim.exists() and not (fp_dir / "quarantine").exists()
    # The run moves it aside and extracts it again.
    proc = snakemake(work, "extract", config=SMALL)
    out = proc.stdout + proc.stderr
    assert f"shard {victim.stem} failed the integrity check" in out
    assert job_counts(out)["extract_shard"] == 1
    (moved,) = (fp_dir / "quarantine").glob(f"{victim.stem}-*")
    assert "truncated" in (moved / "reason.txt").read_text()
    # The summary that listed it is set aside too (else Snakemake would see nothing to do).
    (summary,) = (fp_dir / "quarantine").glob("summary-*")
    assert victim.stem in (summary / "reason.txt").read_text()


def test_verify_deep_names_a_flipped_byte(extracted_workdir, tmp_path):
    work = copy_workdir(extracted_workdir, tmp_path / "w")
    fp_dir = hidden_dir(work)
    victim = sorted(fp_dir.glob("*.safetensors"))[1]
    _, start = read_header(victim)
    with open(victim, "r+b") as f:
        f.seek(start + 12345)
        b = f.read(1)
        f.seek(start + 12345)
        f.write(bytes([b[0] ^ 0x01]))
    assert (
        job_counts(snakemake(work, "-n", "extract", config=SMALL).stdout).get("extract_shard", 0)
        == 0
    )
    proc = snakemake(work, "verify_deep", config=SMALL, check=False)
    assert proc.returncode != 0
    log = (work / "results" / "logs" / "verify_deep.log").read_text()
    assert f"shard {victim.stem}" in log and "sha256" in log
