"""One model load serves many shards (eagleflow.serve, docs/engine-reuse.md).

Locally, `snakemake --cores N extract` runs the extract jobs one after another; the first
starts an engine server and the others send it their shards. Every shard stays its own job:
its own files, log, record and verification. The loads are counted in the server logs (one
`LOADED` line per model load); every shard is checked per sample against the per-shard path
(tokens equal, states within the CPU engine's run-to-run noise), and the kill tests show that
a SIGKILL of the whole run, or of the engine alone, leaves only committed chunks that a rerun
keeps. Regeneration's jobs share a generate server the same way: one load for two source
shards, byte for byte the replies of per-job engines (greedy)."""

import json
import os
import re
import signal
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagleflow.serve.client import LOADED
from support.workflow_runner import (
    SHORT_REGENERATION,
    SMALL,
    copy_workdir,
    hidden_dir,
    merged,
    run_and_kill,
    snakemake,
    started_jobs,
)

pytestmark = pytest.mark.vllm

# For the kill tests, 7 shards of 64: enough for shards finished before the kill, one in
# flight and some not started.
SEVERAL = merged(SMALL, {"data": {"shard_size": 64}})
# Chunks of about 200 tokens and small forwards, so a kill lands inside a shard.
SEVERAL_CHUNKED = merged(SEVERAL, {"extract": {"chunk_tokens": 200, "max_num_seqs": 8}})
# One conversation per forward and chunks of about 100 tokens: a shard takes about 64 forwards,
# so a kill aimed at "a chunk committed" lands while that shard is still in flight. (With 8 per
# forward a fast CPU finishes the shard within one poll, the kill lands between shards, and the
# next job rightly starts a new server: the run succeeds and the test meant nothing.)
ONE_PER_FORWARD = merged(SEVERAL, {"extract": {"chunk_tokens": 100, "max_num_seqs": 1}})


def engine_loads(workdir, stage="extract") -> int:
    """Model loads of a run's engine servers: one LOADED line per load in their logs."""
    logs = (workdir / "results" / "logs" / stage).glob("**/engine-*.log")
    return sum(p.read_text().count(LOADED) for p in logs)


def shard_files(workdir):
    return sorted(hidden_dir(workdir).glob("*.safetensors"))


def samples(path):
    """{sample_id: (input_ids, hidden_states)} of a finished shard file."""
    with safe_open(str(path), framework="pt") as f:
        ids = json.loads(f.metadata()["sample_ids"])
    t = load_file(str(path))
    off = t["offsets"].tolist()
    return {
        s: (t["input_ids"][off[i] : off[i + 1]], t["hidden_states"][off[i] : off[i + 1]])
        for i, s in enumerate(ids)
    }


def assert_same_samples(work, reference):
    ref = {}
    for p in shard_files(reference):
        ref.update(samples(p))
    n = 0
    rels = []
    for p in shard_files(work):
        for sid, (ids, states) in samples(p).items():
            ref_ids, ref_states = ref[sid]
            assert torch.equal(ids, ref_ids), sid
            a, b = states.float(), ref_states.float()
            rels.append(((a - b).norm(dim=-1) / b.norm(dim=-1)).flatten())
            n += 1
    assert n == len(ref), (n, len(ref))
    # Run-to-run noise of the CPU engine (bf16, batch composition): as tests/test_resume.py.
    rel = torch.cat(rels)
    assert float(rel.median()) < 0.02 and float((rel < 0.1).float().mean()) > 0.9


@pytest.fixture(scope="module")
def per_shard_reference(prepared_workdir, tmp_path_factory):
    """The same conversations through the per-shard path, an engine of the job's own, in one
    shard of all 400 (the comparison is per sample, so any cut of the same rows serves)."""
    work = copy_workdir(prepared_workdir, tmp_path_factory.mktemp("per-shard"))
    per_shard = {"data": {"shard_size": 400}, "extract": {"engine_reuse": False}}
    snakemake(work, "extract", config=merged(SMALL, per_shard))
    records = [json.loads(p.with_suffix(".json").read_text()) for p in shard_files(work)]
    assert len(records) == 1
    assert all(r["model_loaded"] and not r["engine"]["server"] for r in records)
    assert engine_loads(work) == 0
    return work


def test_every_shard_of_the_run_one_load_same_states_as_per_shard(
    per_shard_reference, extracted_workdir, tmp_path
):
    """The session's extraction of the small default (`extracted_workdir`: four extract jobs
    of one `snakemake extract`) loaded the model once; each shard is its own job with its own
    log and record, and its states are the per-shard path's."""
    work = extracted_workdir  # read only
    files = shard_files(work)
    assert len(files) == 4
    assert engine_loads(work) == 1
    records = [json.loads(p.with_suffix(".json").read_text()) for p in files]
    assert all(r["engine"]["server"] for r in records)
    assert sum(r["model_loaded"] for r in records) == 1
    assert len({r["engine"]["server_pid"] for r in records}) == 1
    for r in records:  # every shard's own log has its progress and figures
        log = work / "results" / "logs" / "extract" / r["fingerprint"] / f"{r['shard_id']}.log"
        text = log.read_text()
        assert f"extract {r['shard_id']}" in text and "verified in" in text
    assert_same_samples(work, per_shard_reference)
    # A no-op rerun (on a copy) runs no extract job, so it loads nothing.
    again = copy_workdir(extracted_workdir, tmp_path / "again")
    out = snakemake(again, "extract", config=SMALL)
    assert "extract_shard" not in out.stdout + out.stderr
    assert engine_loads(again) == 1


def partial_chunks(workdir):
    d = workdir / "results" / "hidden"
    return sorted(d.glob("*/.partial/*/chunk-*.json")) if d.exists() else []


def finished(workdir):
    d = workdir / "results" / "hidden"
    return list(d.glob("*/*.verify.json")) if d.exists() else []


def server_pids(workdir):
    pids = []
    for p in (workdir / "results" / "logs" / "extract").glob("*/engine-*.log"):
        pids += [int(m) for m in re.findall(r"engine server \w+: pid (\d+)", p.read_text())]
    return pids


def gone(pid, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_sigkill_mid_run_then_rerun_finishes_every_shard(prepared_workdir, tmp_path):
    work = copy_workdir(prepared_workdir, tmp_path / "killed")
    # Two shards finished and a third one part-way (one chunk committed): kill the whole run.
    run_and_kill(
        work,
        ["extract"],
        SEVERAL_CHUNKED,
        lambda: len(finished(work)) >= 2 and len(partial_chunks(work)) >= 1,
        poll_s=0.2,
        timeout=900,
        unlock=False,  # after the server's own end, below
    )
    # What the kill left committed: chunk markers, their rows written in place in the partial
    # shard file (eagleflow.store.chunks), to find byte for byte in the finished shard.
    kept = {}
    for marker in partial_chunks(work):
        lo, hi = json.loads(marker.read_text())["tokens"]
        with safe_open(str(marker.parent / "shard.safetensors"), framework="pt") as f:
            kept[marker] = (lo, hi, f.get_slice("hidden_states")[lo:hi])
    assert kept
    # The server belongs to the killed run: it stops by itself (it is in its own session).
    (pid,) = server_pids(work)
    assert gone(pid), "the engine server outlived the killed run"
    snakemake(work, "--unlock", config=SEVERAL_CHUNKED)
    snakemake(work, "extract", config=SEVERAL_CHUNKED)
    files = shard_files(work)
    assert len(files) == 7 and len(finished(work)) == len(files)
    assert engine_loads(work) == 2  # one per run
    assert not partial_chunks(work)
    # Every chunk the kill left committed is in its shard, byte for byte, in its place.
    for marker, (lo, hi, rows) in kept.items():
        shard_id = marker.parent.name
        t = load_file(str(hidden_dir(work) / f"{shard_id}.safetensors"))
        assert torch.equal(t["hidden_states"][lo:hi], rows), f"{marker.name} of {shard_id}"


def test_engine_killed_in_flight_fails_the_shard_clearly_and_rerun_completes(
    prepared_workdir, tmp_path
):
    work = copy_workdir(prepared_workdir, tmp_path / "engine-killed")
    in_flight = set()

    def kill_the_engine(proc):
        """SIGKILL the engine server alone, with a shard in flight; the run goes on to its end."""
        (pid,) = server_pids(work)
        in_flight.update(p.parent.name for p in partial_chunks(work))
        os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=600)

    proc = run_and_kill(
        work,
        ["extract"],
        ONE_PER_FORWARD,
        lambda: len(partial_chunks(work)) >= 1,
        kill=kill_the_engine,
        poll_s=0.02,
        timeout=900,
        unlock=False,  # Snakemake was not killed: it ended by itself
    )
    assert proc.returncode != 0, "the kill missed every shard in flight"
    logs = work / "results" / "logs" / "extract"
    failed = [p for p in logs.glob("*/*.log") if "died while prefilling" in p.read_text()]
    assert {p.stem for p in failed} == in_flight
    for p in failed:  # the server log's tail is in the shard's log
        assert "engine server" in p.read_text().split("died while prefilling", 1)[1]
    snakemake(work, "extract", config=ONE_PER_FORWARD)
    files = shard_files(work)
    assert len(files) == 7 and len(finished(work)) == len(files)
    assert engine_loads(work) == 2


# The embedded default's regeneration settings on 60 conversations: two source shards of 30
# (two regenerate_shard jobs: one starts the server, the other is served), chunks of 10, short
# replies. The embedded target is the shared prepared run's.
REGEN_SHARDS = {
    "data": {
        "path": "my-data.jsonl",
        "bundled_conversations": SMALL["data"]["bundled_conversations"],
        "shard_size": 30,
        "regenerate": {**SHORT_REGENERATION, "shard_rows": 30, "chunk_rows": 10},
    }
}


def test_regeneration_two_source_shards_one_load_same_replies_as_per_job_engines(
    prepared_workdir, tmp_path
):
    from eagleflow.embedded.bundled_data import generate_conversations

    work = copy_workdir(prepared_workdir, tmp_path / "regen")
    with open(work / "my-data.jsonl", "w") as f:
        for row in generate_conversations(60, seed=7):
            f.write(json.dumps(row) + "\n")
    out = work / "results" / "regenerated"
    # The dataset, the embedded target and the split first: the arms time the jobs alone.
    snakemake(work, "results/regenerated/sources.json", config=REGEN_SHARDS)
    ids = [s["id"] for s in json.loads((out / "sources.json").read_text())["shards"]]
    assert len(ids) == 2
    figures, files = {}, {}
    for arm, reuse in (("per-job engines", False), ("engine reuse", True)):
        for i in ids:
            for suffix in (".jsonl", ".rejects.jsonl", ".summary.json"):
                (out / f"{i}{suffix}").unlink(missing_ok=True)
        t0 = time.time()
        proc = snakemake(
            work, "regenerate", config=merged(REGEN_SHARDS, {"extract": {"engine_reuse": reuse}})
        )
        wall = time.time() - t0
        assert started_jobs(proc.stdout + proc.stderr).get("regenerate_shard") == 2
        files[arm] = {i: (out / f"{i}.jsonl").read_bytes() for i in ids}
        summaries = [json.loads((out / f"{i}.summary.json").read_text()) for i in ids]
        figures[arm] = (wall, summaries)
    per_job, reuse = figures["per-job engines"][1], figures["engine reuse"][1]
    # Greedy decoding: the shared engine answers exactly as each job's own engine did.
    assert files["engine reuse"] == files["per-job engines"]
    assert all(s["model_loaded"] and not s["engine"]["server"] for s in per_job)
    assert engine_loads(work, "regenerate") == 1  # the reuse arm's only server
    (loaded,) = [s for s in reuse if s["model_loaded"]]  # the job that started the server
    assert all(s["engine"]["server"] for s in reuse)
    assert len({s["engine"]["server_pid"] for s in reuse}) == 1
    assert all(s["tokens_per_second"] > 0 for s in reuse)
    # engine_start_s: the load for the job that started the server, a connection for the rest
    assert max(s["engine_start_s"] for s in reuse if s is not loaded) < loaded["engine_start_s"]
    for i in ids:  # each job's log keeps its progress bar and its last line
        log = (work / "results" / "logs" / "regenerate" / f"{i}.log").read_text()
        assert "generated tok/s" in log and f"source shard {i} done" in log
    for arm, (wall, summaries) in figures.items():
        print(
            f"\nregeneration, 2 source shards, {arm}: {wall:.0f} s wall, "
            f"{sum(s['model_loaded'] for s in summaries)} model loads, engine start per job "
            f"{[s['engine_start_s'] for s in summaries]} s"
        )
