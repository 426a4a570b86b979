"""Crash safety: SIGKILL an extract job at several points; the rerun resumes after the last
committed chunk, keeps every committed row byte for byte, and the shard ends equal to an
uninterrupted extraction (tokens exactly; states up to the engine's run-to-run noise)."""

import json
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagleflow.data.shards import read_token_shard
from eagleflow.store.chunks import chunk_ranges
from eagleflow.store.headers import file_sha256
from eagleflow.store.verify import cheap_check
from support.workflow_runner import (
    SMALL,
    copy_workdir,
    hidden_dir,
    run_and_kill,
    snakemake,
)

pytestmark = pytest.mark.vllm

# Small chunks and one sample per engine forward (the token budget cannot go below 2,048 on
# vLLM's CPU MLA path without AMX; the sample count can), so one shard of ~2,700 tokens in 100
# samples commits its ~10 chunks one by one over ~100 forwards (a chunk is committed as soon as
# its rows are in). With AMX a forward of this target takes milliseconds: larger forwards
# committed several chunks between two polls and the last kill point fell after the last chunk.
# Each job with its own engine: the kill points sit in that job's prefill (a shared server,
# already loaded, prefills a shard faster than a kill can be aimed; its own kill-and-resume
# test is in test_engine_reuse.py).
CHUNKED = {
    **SMALL,
    "extract": {"chunk_tokens": 300, "max_num_seqs": 1, "engine_reuse": False},
}


def shard_targets(workdir, shard_id):
    d = hidden_dir(workdir)
    return [str((d / f"{shard_id}{s}").relative_to(workdir)) for s in (".safetensors", ".json")]


def forget_shard(workdir, shard_id):
    for suffix in (".safetensors", ".json", ".verify.json"):
        (hidden_dir(workdir) / f"{shard_id}{suffix}").unlink(missing_ok=True)


def kill_shard_job(workdir, shard_id, when):
    """Run the extract job for one shard through Snakemake and SIGKILL it all (Snakemake too, as
    on a crashed node: the rerun follows a `--unlock`) once `when(partial_dir)` is true; polled
    often, since a chunk is committed every forward or so."""
    partial = hidden_dir(workdir) / ".partial" / shard_id
    run_and_kill(
        workdir,
        shard_targets(workdir, shard_id),
        CHUNKED,
        lambda: when(partial),
        poll_s=0.02,
    )


def chunks(partial):
    """The chunk markers committed in a shard's partial directory."""
    return sorted(partial.glob("chunk-*.json")) if partial.exists() else []


def test_sigkill_at_any_point_then_resume_gives_the_uninterrupted_result(
    extracted_workdir, tmp_path
):
    # The uninterrupted result is the shared fixture's own extraction of the same shard (chunk
    # size and batch limits are not in the fingerprint: same directory, same tensors up to noise).
    reference = extracted_workdir
    shard_id = sorted(p.stem for p in hidden_dir(reference).glob("*.safetensors"))[0]
    # Extracted by an engine (with engine reuse only the first job of the run pays the load).
    assert json.loads((hidden_dir(reference) / f"{shard_id}.json").read_text())[
        "tokens_extracted_now"
    ]

    work = copy_workdir(extracted_workdir, tmp_path / "killed")
    forget_shard(work, shard_id)
    d = hidden_dir(work)
    started = time.time()
    kill_points = [
        ("engine starting, nothing committed", lambda p, before: time.time() - started > 8),
        ("one chunk committed", lambda p, before: len(chunks(p)) >= 1),
        ("two more chunks committed", lambda p, before: len(chunks(p)) >= before + 2),
    ]
    committed = [0]
    for name, when in kill_points:
        started = time.time()
        kill_shard_job(work, shard_id, lambda p: when(p, committed[-1]))
        # Nothing a later run could take for a finished shard: no file, or one that fails the check.
        out = d / f"{shard_id}.safetensors"
        record = d / f"{shard_id}.json"
        assert not (
            out.exists()
            and record.exists()
            and not cheap_check(out, json.loads(record.read_text()), d.name)
        ), name
        committed.append(len(chunks(d / ".partial" / shard_id)))
    tokens = read_token_shard(work / "results" / "shards" / "tokens" / f"{shard_id}.safetensors")
    total = len(chunk_ranges(tokens.offsets, CHUNKED["extract"]["chunk_tokens"]))
    # Three distinct kill points, the last still mid-shard.
    assert committed[1] == 0 and 1 <= committed[2] and committed[2] + 2 <= committed[3] < total, (
        committed
    )

    # What the kills left committed (rows in the shard file, in place), to find byte for byte
    # in the finished shard.
    partial = d / ".partial" / shard_id
    ranges = [json.loads(p.read_text())["tokens"] for p in chunks(partial)]
    with safe_open(str(partial / "shard.safetensors"), framework="pt") as f:
        kept = {(lo, hi): f.get_slice("hidden_states")[lo:hi] for lo, hi in ranges}
    snakemake(work, *shard_targets(work, shard_id), config=CHUNKED)
    record = json.loads((d / f"{shard_id}.json").read_text())
    # The rerun loaded the model once and extracted only what the kills had not committed.
    assert record["model_loaded"]
    assert 0 < record["tokens_extracted_now"] < record["n_tokens"]
    assert file_sha256(d / f"{shard_id}.safetensors") == record["sha256"]
    assert not partial.exists()
    final, ref = (
        load_file(str(d / f"{shard_id}.safetensors")),
        load_file(str(hidden_dir(reference) / f"{shard_id}.safetensors")),
    )
    assert kept and all(
        torch.equal(final["hidden_states"][lo:hi], t) for (lo, hi), t in kept.items()
    )
    for key in ("input_ids", "loss_mask", "offsets"):
        assert torch.equal(final[key], ref[key]), key
    # Against the uninterrupted run: the same states up to the CPU engine's run-to-run noise
    # (bf16, thread-parallel reductions; a misplaced row would be off by 50% or more).
    a, b = final["hidden_states"].float(), ref["hidden_states"].float()
    rel = ((a - b).norm(dim=-1) / b.norm(dim=-1)).flatten()
    assert float(rel.median()) < 0.02 and float((rel < 0.1).float().mean()) > 0.9


def test_a_job_whose_chunks_are_all_committed_never_loads_the_model(extracted_workdir, tmp_path):
    work = copy_workdir(extracted_workdir, tmp_path / "w")
    shard_id = sorted(p.stem for p in hidden_dir(work).glob("*.safetensors"))[1]
    forget_shard(work, shard_id)
    d = hidden_dir(work)
    tokens = read_token_shard(work / "results" / "shards" / "tokens" / f"{shard_id}.safetensors")
    total = len(chunk_ranges(tokens.offsets, CHUNKED["extract"]["chunk_tokens"]))
    # Kill once the last chunk is committed (the job is then shutting the engine down, about
    # two seconds, before finishing): the rerun only verifies and finishes.
    kill_shard_job(work, shard_id, lambda p: len(chunks(p)) == total)
    snakemake(work, *shard_targets(work, shard_id), config=CHUNKED)
    record = json.loads((d / f"{shard_id}.json").read_text())
    assert record["model_loaded"] is False and record["tokens_extracted_now"] == 0
    log = (work / "results" / "logs" / "extract" / d.name / f"{shard_id}.log").read_text()
    assert "already committed" in log


def test_a_worker_error_reaches_the_job_log_with_its_traceback(extracted_workdir, tmp_path):
    """An exception inside vLLM's worker (here: the patched forward calling an embedding method
    the model does not have) fails the job, and the log holds the worker's traceback."""
    work = copy_workdir(extracted_workdir, tmp_path / "w")
    d = hidden_dir(work)
    shard_id = sorted(p.stem for p in d.glob("*.safetensors"))[2]
    forget_shard(work, shard_id)
    plan = json.loads((d / "capture_plan.json").read_text())
    plan["strategy"] = "patched_forward"
    plan["introspection"]["embedding_method"] = "embed_tokens_that_do_not_exist"
    (d / "capture_plan.json").write_text(json.dumps(plan))
    proc = snakemake(work, *shard_targets(work, shard_id), config=SMALL, check=False)
    assert proc.returncode != 0
    log = (work / "results" / "logs" / "extract" / d.name / f"{shard_id}.log").read_text()
    assert f"shard {shard_id}:" in log
    assert "Traceback (most recent call last)" in log
    assert "AttributeError" in log and "embed_tokens_that_do_not_exist" in log
    assert "capture/worker.py" in log  # the frame inside the worker, not just the driver's
    assert not (d / f"{shard_id}.safetensors").exists()
