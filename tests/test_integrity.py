import json

import pytest

from eagleflow.store.integrity import check_finished_shards, set_aside_incomplete_manifest
from support.synthetic import FP, make_extracted_shard, make_token_shards


def test_damaged_shards_are_quarantined_with_their_reason(tokenizer, tmp_path):
    shards = make_token_shards(tokenizer, n=12, size=4)
    for shard in shards:
        make_extracted_shard(shard, tmp_path)
    d = tmp_path / FP
    good, truncated, no_record = (s.shard_id for s in shards)
    with open(d / f"{truncated}.safetensors", "r+b") as f:
        f.truncate(1000)
    (d / f"{no_record}.json").unlink()
    messages = []
    bad = check_finished_shards(
        d, [s.shard_id for s in shards] + ["f" * 20], FP, log=messages.append
    )
    assert bad == [truncated, no_record]
    assert (d / f"{good}.safetensors").exists()
    assert (
        not (d / f"{truncated}.safetensors").exists()
        and not (d / f"{no_record}.safetensors").exists()
    )
    reasons = {
        p.parent.name.split("-")[0]: p.read_text() for p in (d / "quarantine").glob("*/reason.txt")
    }
    assert "truncated" in reasons[truncated] and "record unreadable" in reasons[no_record]
    assert any(truncated in m for m in messages)
    # The quarantined files are kept, not deleted.
    assert len(list((d / "quarantine").glob(f"{truncated}-*/{truncated}.safetensors"))) == 1


def test_a_file_from_another_fingerprint_is_quarantined(tokenizer, tmp_path):
    shard = make_token_shards(tokenizer, n=4, size=4)[0]
    _, out, record = make_extracted_shard(shard, tmp_path, fp="fedcba9876543210")
    d = tmp_path / FP
    d.mkdir()
    out.rename(d / out.name)
    (d / f"{shard.shard_id}.json").write_text(json.dumps(record))
    assert check_finished_shards(d, [shard.shard_id], FP, log=lambda m: None) == [shard.shard_id]


def test_summary_is_set_aside_only_when_a_shard_is_unfinished(tokenizer, tmp_path):
    shards = make_token_shards(tokenizer, n=8, size=4)
    for shard in shards:
        make_extracted_shard(shard, tmp_path)
    d = tmp_path / FP
    ids = [s.shard_id for s in shards]
    for shard_id in ids:
        (d / f"{shard_id}.verify.json").write_text("{}")
    (d / "verify_summary.tsv").write_text("shard_id\tok\n")
    (d / "manifest.parquet").write_bytes(b"x")
    # Every shard finished: the summary stays.
    assert check_finished_shards(d, ids, FP, log=lambda m: None) == []
    assert (d / "verify_summary.tsv").exists()
    # One shard's verification report deleted by hand: nothing is damaged, but the summary
    # must go, or Snakemake would take the run for complete.
    (d / f"{ids[1]}.verify.json").unlink()
    messages = []
    assert check_finished_shards(d, ids, FP, log=messages.append) == []
    assert not (d / "verify_summary.tsv").exists() and not (d / "manifest.parquet").exists()
    (moved,) = (d / "quarantine").glob("summary-*")
    assert ids[1] in (moved / "reason.txt").read_text() and (moved / "verify_summary.tsv").exists()
    assert any("summary" in m for m in messages)


def write_manifest(shards_dir, shard_ids):
    import pandas as pd

    (shards_dir / "tokens").mkdir(parents=True)
    pd.DataFrame({"shard_id": [s for s in shard_ids for _ in range(3)]}).to_parquet(
        shards_dir / "manifest.parquet"
    )
    for s in shard_ids:
        (shards_dir / "tokens" / f"{s}.safetensors").write_bytes(b"tokens")


def test_a_manifest_listing_a_deleted_token_shard_is_set_aside(tmp_path):
    ids = [c * 20 for c in "abc"]
    write_manifest(tmp_path, ids)
    messages = []
    assert set_aside_incomplete_manifest(tmp_path, log=messages.append) is None
    assert (tmp_path / "manifest.parquet").exists() and messages == []

    (tmp_path / "tokens" / f"{ids[1]}.safetensors").unlink()
    dest = set_aside_incomplete_manifest(tmp_path, log=messages.append)
    assert not (tmp_path / "manifest.parquet").exists()
    assert (dest / "manifest.parquet").exists() and dest.parent == tmp_path / "quarantine"
    assert f"token shard {ids[1]}.safetensors is missing" in (dest / "reason.txt").read_text()
    (message,) = messages
    assert f"1 token shard(s) listed in {tmp_path / 'manifest.parquet'} are missing" in message
    assert "sharded again" in message
    # Nothing left to set aside: the checkpoint re-shards.
    assert set_aside_incomplete_manifest(tmp_path, log=messages.append) is None


def test_an_unreadable_manifest_is_set_aside(tmp_path):
    write_manifest(tmp_path, ["a" * 20])
    (tmp_path / "manifest.parquet").write_bytes(b"not parquet")
    messages = []
    dest = set_aside_incomplete_manifest(tmp_path, log=messages.append)
    assert dest is not None and not (tmp_path / "manifest.parquet").exists()
    assert "is unreadable" in messages[0]


@pytest.mark.slow
def test_deleted_token_shard_makes_the_workflow_reshard(prepared_workdir, tmp_path):
    """End to end, sharding only (no model): a token shard deleted by hand while the manifest
    stays re-shards instead of failing every later run with a MissingInputException."""
    from support.workflow_runner import SMALL, copy_workdir, job_counts, snakemake

    work = copy_workdir(prepared_workdir, tmp_path / "w")
    tokens = work / "results" / "shards" / "tokens"
    deleted = sorted(tokens.iterdir())[1]
    deleted.unlink()
    proc = snakemake(work, "-n", "extract", config=SMALL)
    out = proc.stdout + proc.stderr
    assert "MissingInputException" not in out
    assert f"(first: {deleted.stem}); the manifest was moved to" in out, out[-3000:]
    assert job_counts(out).get("shard") == 1
    # The checkpoint runs again and writes the same (content-addressed) shard back.
    snakemake(work, "results/shards/manifest.parquet", config=SMALL)
    assert deleted.exists()
