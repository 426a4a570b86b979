"""The shared engine's client/server plumbing without vLLM (docs/engine-reuse.md): a generate
server with a fake engine (tests/support/fake_engine_server.py), started and reused the way
regenerate_shard jobs start and reuse the real one, answers regeneration's rounds; the shards
come out byte for byte as with the job's own generator, the summaries say which job loaded
the model, and a failed request or a dead server fails the job with the reason."""

import importlib
import json
import os
import signal
import time
from contextlib import ExitStack
from dataclasses import replace

import pytest

from eagleflow.engine.settings import EngineSettings
from eagleflow.extract.shard import CAPTURE_SERVER
from eagleflow.regenerate.replies import GENERATE_SERVER, Generator, served_generator
from eagleflow.regenerate.shard import Regeneration, SourceShard, regenerate_source_shard
from eagleflow.regenerate.sources import split_sources
from eagleflow.serve.client import LOADED, EngineClient, ServerSpec, alive, registry_dir
from support.datasets import rows_of, write_jsonl
from support.fake_engine_server import DIE, FAIL, HANG, reply
from support.regeneration import IDENTITY, shard_files
from support.workflow_runner import REPO

FAKE_SERVER = "support.fake_engine_server"  # the server module the tests' clients start


@pytest.fixture
def spec(tmp_path, monkeypatch):
    # The server is started with `python -m`: it must find eagleflow and the tests' support.
    paths = [str(REPO / "workflow"), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    spec = ServerSpec(
        EngineSettings("unused-target"),
        None,
        engine_dir=tmp_path / "regenerated" / ".engine",
        log_dir=tmp_path / "logs",
        idle_seconds=30,
        watch_pid=os.getpid(),  # the server stops with this test run at the latest
        kind="generate",
    )
    started = []
    yield spec, started
    for pid in started:  # the servers these tests started, by pid
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for path in registry_dir().glob("*.json"):  # and their entries in the registry
        try:
            if json.loads(path.read_text()).get("pid") in started:
                path.unlink(missing_ok=True)
        except (OSError, ValueError):
            pass


def connect(spec, started, stack=None):
    client = EngineClient(spec, FAKE_SERVER, log=lambda *_: None)
    client = stack.enter_context(client) if stack else client.__enter__()
    if client.started_here:
        started.append(client.server_pid)
    return client


def gone(pid, timeout=10):
    deadline = time.time() + timeout
    while alive(pid):
        if time.time() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_spec_round_trips_and_a_generate_server_has_no_plan(spec):
    spec, _ = spec
    assert ServerSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    with pytest.raises(ValueError, match="needs a capture plan"):
        ServerSpec(spec.settings, None, spec.engine_dir, spec.log_dir, 30)  # kind "capture"
    with pytest.raises(ValueError, match="unknown engine server kind"):
        ServerSpec(spec.settings, None, spec.engine_dir, spec.log_dir, 30, kind="both")


def test_each_kind_has_its_stage_s_server_module():
    """The modules the clients start (`python -m`) exist, each with its engine."""
    capture = importlib.import_module(CAPTURE_SERVER)
    generate = importlib.import_module(GENERATE_SERVER)
    assert capture.CaptureEngine.requests == ("prefill", "states")
    assert generate.GenerateEngine.requests == ("generate",)


def test_source_shards_through_one_shared_server_match_their_own_generator(
    spec, tmp_path, tokenizer_dir
):
    spec, started = spec
    rows = rows_of(7) + [{"id": "two", "turns": ["First question?", "And a second one?"]}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    manifest = split_sources(data, IDENTITY, 3)
    ids = [s["id"] for s in manifest["shards"]]
    assert len(ids) == 3

    def regenerate(out, sid, generator):
        out.mkdir(parents=True, exist_ok=True)
        return regenerate_source_shard(
            SourceShard(data, manifest, sid),
            shard_files(out, sid),
            Regeneration(tokenizer_dir, max_length=512, max_new_tokens=4, chunk_rows=2),
            generator,
        )

    for sid in ids:  # the job's own generator, making the same replies
        regenerate(
            tmp_path / "own", sid, lambda: Generator(lambda prompts: [reply(p, 4) for p in prompts])
        )
    summaries = []
    for sid in ids:  # one job after another, as Snakemake runs them locally
        with ExitStack() as stack:
            summaries.append(
                regenerate(
                    tmp_path / "shared",
                    sid,
                    lambda: served_generator(connect(spec, started, stack), 4),
                )
            )
    for sid in ids:
        assert (tmp_path / "shared" / f"{sid}.jsonl").read_bytes() == (
            tmp_path / "own" / f"{sid}.jsonl"
        ).read_bytes()
    assert [s["model_loaded"] for s in summaries] == [True, False, False]
    assert all(s["engine"]["server"] for s in summaries)
    assert len({s["engine"]["server_pid"] for s in summaries}) == 1 == len(started)
    assert spec.log_path.read_text().count(LOADED) == 1
    for s in summaries:  # the job keeps its figures: finish reasons, generated tokens, rate
        assert sum(s["finish_reasons_now"].values()) == s["replies_now"] > 0
        assert s["generated_tokens_now"] > 0 and s["tokens_per_second"] > 0


def test_a_failed_request_or_a_dead_server_fails_the_job_with_the_reason(spec):
    spec, started = spec
    client = connect(spec, started)
    assert client.generate([[1, 2, 3]], 8) == [reply([1, 2, 3], 8)]
    with pytest.raises(RuntimeError, match="serves no 'prefill'"):
        client._request("prefill", {}, "prefilling this shard")
    assert client.generate([[4]], 8) == [reply([4], 8)]  # still serving
    # The engine raised: the job gets its traceback; the server stops (its state is unknown).
    with pytest.raises(RuntimeError, match="(?s)failed while generating.*the fake engine failed"):
        client.generate([[1], [FAIL]], 8)
    client.__exit__(None, None, None)
    assert gone(client.server_pid)
    assert "a request failed; stopping" in spec.log_path.read_text()
    # The next job starts a fresh server; this one dies in the middle of a request.
    client = connect(spec, started)
    assert client.started_here and len(started) == 2
    with pytest.raises(RuntimeError) as e:
        client.generate([[DIE]], 8)
    message = str(e.value)
    assert f"the engine server (pid {client.server_pid}) died while generating" in message
    assert "its log" in message and LOADED in message  # the server log's tail
    client.__exit__(None, None, None)


def test_a_server_silent_past_its_limit_fails_the_job_instead_of_holding_it(spec, monkeypatch):
    """An engine that hangs (or a host lost without closing the connection) sends nothing: the
    job fails after the request's limit, naming the server and its log, instead of waiting to
    its time limit."""
    import eagleflow.serve.client as client_module

    spec, started = spec
    monkeypatch.setattr(client_module, "GENERATE_TIMEOUT_S", 2)
    client = connect(spec, started)
    t0 = time.time()
    with pytest.raises(RuntimeError) as e:
        client.generate([[HANG]], 8)
    assert time.time() - t0 < 30
    message = str(e.value)
    assert f"the engine server (pid {client.server_pid}) sent nothing for 2 s" in message
    assert "while generating this shard's replies" in message and LOADED in message
    client.__exit__(None, None, None)
    assert client_module.PREFILL_SILENCE_S == client_module.STATES_TIMEOUT_S  # seconds a chunk


def test_a_job_about_to_load_an_engine_first_stops_the_idle_servers_of_its_run(spec, tmp_path):
    """Locally, the generate server may still idle when the first extract job of the same run
    loads the capture engine: two engines must not hold the devices at once."""
    spec, started = spec
    other_run = replace(spec, engine_dir=tmp_path / "other" / ".engine", watch_pid=1)
    generate = connect(spec, started)
    unrelated = connect(other_run, started)
    generate.__exit__(None, None, None)
    unrelated.__exit__(None, None, None)
    assert spec.registry_file.exists() and other_run.registry_file.exists()
    # Another server of the same run (here a second generate server; in the workflow the
    # capture server of the first extract job) starts: the idle one is asked to stop first.
    capture_like = replace(spec, engine_dir=tmp_path / "hidden" / ".engine")
    lines = []
    client = EngineClient(capture_like, FAKE_SERVER, log=lines.append).__enter__()
    started.append(client.server_pid)
    assert client.started_here
    assert not alive(generate.server_pid) and not spec.registry_file.exists()
    assert "asked to free the devices" in spec.log_path.read_text()
    assert any(f"server pid {generate.server_pid} of this run stopped" in x for x in lines)
    assert alive(unrelated.server_pid)  # another run's server is left alone
    client.__exit__(None, None, None)
