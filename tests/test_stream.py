"""Streamed states (`draft.states: stream | cached`, docs/streaming.md) without vLLM: the real
server loop and `StreamCapture` around a fake capture (tests/support/fake_capture_server.py),
against stored shards holding the same states. Stream mode gives the stored batches; the
cache never exceeds its budget and serves later epochs; a dead server fails the read with a
sentence naming it and its log, and the next read starts a new one; a server in another
process is reached over TCP; a trainer killed mid-epoch resumes at the same data position.
The real engine's stream is tested in test_draft.py (`test_stream_run_...`)."""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from eagleflow.capture.plan import CapturePlan, Strategy
from eagleflow.data.shards import build_shards, write_token_shard
from eagleflow.data.templating import Tokenized
from eagleflow.draft.vocab import build_draft_vocab
from eagleflow.draft.weights import load_trained
from eagleflow.engine.settings import EngineSettings
from eagleflow.extract.stream import to_wire
from eagleflow.plan.settings import TrainConfig
from eagleflow.serve.client import ServerSpec, alive, registry_dir, stop_server
from eagleflow.store.quant import FP8
from eagleflow.store.shardfile import plan_shard_file, prepare
from eagleflow.store.state_cache import StateCache, sample_index
from eagleflow.train import states as states_module
from eagleflow.train.data import PackDataset, PackPlan, layout_of, read_layout, sample_table
from eagleflow.train.states import ServedStates, StreamedStatesInvalid, StreamSource, check_sample
from eagleflow.train.trainer import train
from support.draft_fixtures import TINY_DRAFT, H, L, V, write_target
from support.fake_capture_server import fake_states
from support.workflow_runner import REPO

FAKE_SERVER = "support.fake_capture_server"
LAYER_IDS = [1, 2, 3, L]


def make_plan(storage_dtype="bfloat16"):
    return CapturePlan(
        Strategy.PATCHED_FORWARD,
        "auto",
        LAYER_IDS,
        L,
        H,
        "DeepseekV3ForCausalLM",
        None,
        None,
        "test",
        "cpu",
        [],
        fingerprint="f" * 16,
        storage_dtype=storage_dtype,
    )


def write_token_shards(d, n_shards=2, n_samples=12, seed=0):
    """Token shards of samples of 6-13 tokens, ids below V; every third token not trained."""
    g = torch.Generator().manual_seed(seed)
    convs, toks = [], []
    for i in range(n_shards * n_samples):
        n = int(torch.randint(6, 14, (1,), generator=g))
        ids = torch.randint(0, V, (n,), generator=g).numpy().astype(np.int64)
        mask = (np.arange(n) % 3 != 0).astype(np.uint8)
        convs.append(type("C", (), {"sample_id": f"s{i}"})())
        toks.append(Tokenized(ids, mask))
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in build_shards(convs, toks, n_samples, "tok"):
        path = d / f"{shard.shard_id}.safetensors"
        write_token_shard(shard, path)
        paths.append((path, shard))
    return paths


def write_stored(d, token_shards, plan):
    """The extracted shards of `token_shards`, holding `fake_states` (what the fake server
    streams), in the extraction's own file layout."""
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for _, shard in token_shards:
        shard_file, header = plan_shard_file(
            d / f"{shard.shard_id}.safetensors", shard, plan, "bfloat16", plan.fingerprint
        )
        prepare(shard_file, header, shard, lambda: None)
        states, scales = fake_states(
            shard.input_ids, shard.offsets, len(LAYER_IDS), H, "bfloat16", plan.storage_dtype
        )
        shard_file.write_rows(0, 0, states, scales)
        paths.append(str(shard_file.path))
    return sorted(paths)


@pytest.fixture
def server_env(tmp_path, monkeypatch):
    """PYTHONPATH for the `python -m` server; every server started here is killed after."""
    paths = [str(REPO / "workflow"), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    yield
    for path in registry_dir().glob("*.json"):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if str(tmp_path) in entry.get("keyfile", ""):
            try:
                os.kill(entry["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
            path.unlink(missing_ok=True)


def source_for(tmp_path, mode="stream", storage="bfloat16", budget=0, tcp=False):
    spec = ServerSpec(
        EngineSettings("unused-target"),
        make_plan(storage),
        engine_dir=tmp_path / "hidden" / ".engine",
        log_dir=tmp_path / "logs",
        idle_seconds=60,
        watch_pid=os.getpid(),  # the server stops with this test run at the latest
        tcp=tcp,
    )
    cache = str(tmp_path / "hidden" / "cache") if mode == "cached" else None
    return StreamSource(mode, spec, str(tmp_path / "shm"), cache, budget, FAKE_SERVER)


def datasets(tmp_path, mode="stream", storage="bfloat16", budget=0, steps=3):
    tokens = write_token_shards(tmp_path / "tokens")
    plan = make_plan(storage)
    stored = write_stored(tmp_path / "stored", tokens, plan)
    layout = read_layout(stored, L)
    table = sample_table(layout.paths)
    source = source_for(tmp_path, mode, storage, budget)
    token_paths = sorted(str(p) for p, _ in tokens)
    served_layout = layout_of(token_paths, LAYER_IDS, L)
    served_table = sample_table(served_layout.paths)
    served = ServedStates(source, served_layout.paths)
    return (
        PackDataset(layout, table, steps),
        PackDataset(served_layout, served_table, steps, source=served),
        source,
    )


def packs_of(dataset, max_tokens=40, seed=0, epoch=0):
    plan = PackPlan(dataset.table, max_tokens, 1, seed)
    return [plan.pack(epoch, p) for p in range(plan.num_packs(epoch))]


def assert_same_batch(a, b):
    for name in ("states", "scales", "tokens", "target_index", "valid", "positions", "doc"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name
    assert a.samples == b.samples


def served_lines(source) -> list[str]:
    return [x for x in source.server.log_path.read_text().splitlines() if x.startswith("states: ")]


def requests_served(source) -> int:
    return len(served_lines(source))


def samples_served(source) -> int:
    return sum(int(x.split()[1]) for x in served_lines(source))


@pytest.mark.parametrize("storage", ["bfloat16", FP8])
def test_streamed_packs_are_the_stored_packs(tmp_path, server_env, storage):
    """Every pack of an epoch, read through DataLoader workers that each ask the server for
    their packs, equals the stored pack: same token ids, same states, same fp8 scales."""
    stored, streamed, source = datasets(tmp_path, storage=storage)
    packs = packs_of(stored)
    assert len(packs) > 4
    loader = DataLoader(
        streamed,
        sampler=packs + [()],
        batch_size=None,
        num_workers=2,
        # workers from a fresh server process: a pytest worker runs threads (gloo's, other
        # tests' OpenMP pools), and a worker forked from it deadlocked in libgomp
        multiprocessing_context="forkserver",
    )
    for pack, batch in zip(packs + [()], loader):
        assert_same_batch(stored[pack] if pack else stored.padding(), batch)
    assert requests_served(source) == len(packs)  # one request per pack, none for padding
    assert not any((tmp_path / "shm").glob("**/*.safetensors"))  # nothing left in memory
    assert not (tmp_path / "hidden" / "cache").exists()  # stream: nothing on disk


def test_cache_keeps_within_its_budget_and_serves_later_epochs(tmp_path, server_env):
    probe, probing, probe_source = datasets(tmp_path / "probe", mode="cached", budget=10**9)
    for pack in packs_of(probe):
        probing[pack]
    budget = probe_source.cache.used_bytes() // 2  # about half of what the whole run takes
    stored, cached, source = datasets(tmp_path, mode="cached", budget=budget)
    cache = source.cache
    first = packs_of(stored, epoch=0)
    for pack in first:
        assert_same_batch(stored[pack], cached[pack])
        assert cache.used_bytes() <= budget
    have = sum(len(cache.cached(s.shard_id)) for s in map(cached.source.shard, range(2)))
    assert 0 < have < len(stored.table.length)  # half the states fit, not all
    before = samples_served(source)
    served = cached.source

    def is_cached(i):
        s = int(stored.table.shard[i])
        j = sample_index(served.shard(s), int(stored.table.start[i]))
        return j in cache.cached(served.shard(s).shard_id)

    uncached = sum(not is_cached(i) for i in stored.table.train)
    for pack in packs_of(stored, epoch=1):
        assert_same_batch(stored[pack], cached[pack])
    assert cache.used_bytes() <= budget
    # only the samples not cached were prefilled again
    assert samples_served(source) - before == uncached < len(stored.table.train)


def test_a_fully_cached_run_never_starts_the_engine(tmp_path, server_env):
    stored, cached, source = datasets(tmp_path, mode="cached", budget=10**9)
    for pack in packs_of(stored):
        cached[pack]
    assert cached.source.all_cached(cached.table)
    pid = json.loads(next(registry_dir().glob(f"{source.server.key}.json")).read_text())["pid"]
    assert stop_server(source.server)
    deadline = time.time() + 10
    while alive(pid) and time.time() < deadline:
        time.sleep(0.05)
    assert not alive(pid)
    served = ServedStates(source, cached.source.paths)
    fresh = PackDataset(cached.layout, cached.table, 3, source=served)
    for pack in packs_of(stored, epoch=3):
        assert_same_batch(stored[pack], fresh[pack])
    assert not source.server.registry_file.exists()  # no server was started


def test_a_dead_server_fails_the_read_naming_it_and_its_log_then_a_new_one_serves(
    tmp_path, server_env, monkeypatch
):
    stored, streamed, source = datasets(tmp_path)
    packs = packs_of(stored)
    die = tmp_path / "die-after"
    die.write_text("2")  # the server dies on its 3rd request
    monkeypatch.setenv("EAGLEFLOW_FAKE_DIE_FILE", str(die))
    streamed[packs[0]], streamed[packs[1]]
    with pytest.raises(RuntimeError) as e:
        streamed[packs[2]]
    message = str(e.value)
    assert "engine server (pid" in message and "died while capturing a training pack" in message
    assert str(source.server.log_path) in message
    die.unlink()
    assert_same_batch(stored[packs[2]], streamed[packs[2]])  # a new server
    assert source.server.log_path.read_text().count("model loaded") == 2


def test_a_bad_streamed_sample_is_named():
    ids = torch.arange(5)
    good = torch.ones(5, 4, H, dtype=torch.bfloat16)
    check_sample(good, None, ids, ids, torch.bfloat16, 4, H, "sample 's1' (#1) of shard x")
    cases = {
        "shape": (good[:4], None, ids[:4]),
        "token ids differ": (good, None, ids + 1),
        "all-zero rows [2]": (good.index_fill(0, torch.tensor([2]), 0), None, ids),
        "not finite": (good.index_fill(0, torch.tensor([1]), float("nan")), None, ids),
        "dtype": (good.float(), None, ids),
    }
    for problem, (states, scales, got) in cases.items():
        with pytest.raises(StreamedStatesInvalid, match=r"sample 's1' \(#1\) of shard x: .*"):
            check_sample(
                states, scales, got, ids, torch.bfloat16, 4, H, "sample 's1' (#1) of shard x"
            )
        try:
            check_sample(states, scales, got, ids, torch.bfloat16, 4, H, "where")
        except StreamedStatesInvalid as err:
            assert problem.split()[0] in str(err), (problem, str(err))


def test_a_server_in_another_process_is_reached_over_tcp(tmp_path, server_env):
    """The SLURM layout on loopback: the server started on its own (as another allocation's
    job would start it), listening on TCP and publishing host and port; a trainer-side reader
    in this process finds it by the address file and gets the stored packs."""
    stored, _, _ = datasets(tmp_path)
    source = source_for(tmp_path, tcp=True)
    spec = source.server
    spec.engine_dir.mkdir(parents=True, exist_ok=True)
    spec.file(".key").write_text(os.urandom(32).hex())
    spec.file(".key").chmod(0o600)  # a key file is read only when private (docs/security.md)
    spec.file(".spec.json").write_text(json.dumps(spec.to_json()))
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, EAGLEFLOW_SERVER_HOST="127.0.0.1")
    with open(spec.log_path, "a") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", FAKE_SERVER, str(spec.file(".spec.json"))],
            stdout=log,
            stderr=log,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.time() + 60
        while spec.tcp_address() is None and time.time() < deadline:
            time.sleep(0.1)
        host, port = spec.tcp_address()
        assert host == "127.0.0.1" and port > 0
        token_paths = sorted(str(p) for p in (tmp_path / "tokens").glob("*.safetensors"))
        layout = layout_of(token_paths, LAYER_IDS, L)
        streamed = PackDataset(
            layout, sample_table(token_paths), 3, source=ServedStates(source, token_paths)
        )
        for pack in packs_of(stored)[:4]:
            assert_same_batch(stored[pack], streamed[pack])
        assert server.poll() is None  # the reader used the running server, started none
        assert "engine: starting" not in spec.log_path.read_text()
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=60)


def train_config(steps, **kw):
    return TrainConfig(
        epochs=100,
        max_steps=steps,
        batch_packs=1,
        ttt_steps=3,
        lr=3e-3,
        warmup_ratio=0.2,
        weight_decay=0.0,
        max_tokens=40,
        save_every=4,
        eval_every=0,
        # no loader worker in this process: a fork from a pytest worker, which runs threads,
        # can deadlock in the child. Workers asking the server for their packs:
        # test_streamed_packs_are_the_stored_packs and the stream rule run (test_draft.py).
        num_workers=0,
        device="cpu",
        **kw,
    )


def test_trainer_streams_the_stored_run_and_resumes_at_the_same_data_position(tmp_path, server_env):
    """The trainer on streamed states takes the stored run's steps (same packs, order and
    states: the same losses and weights); killed after step 7, it resumes from its step-4
    checkpoint at the same data position and ends with the uninterrupted run's draft."""
    stored, streamed, source = datasets(tmp_path)
    target = write_target(tmp_path / "target")
    vocab = build_draft_vocab(stored.layout.paths, V, 48)
    token_paths = streamed.layout.paths
    cfg = train_config(10)
    train(stored.layout.paths, target, vocab, tmp_path / "stored-run", cfg, TINY_DRAFT)
    train(token_paths, target, vocab, tmp_path / "stream-run", cfg, TINY_DRAFT, stream=source)
    first = train(
        token_paths,
        target,
        vocab,
        tmp_path / "killed",
        cfg,
        TINY_DRAFT,
        stop_after=7,
        stream=source,
    )
    assert first["end_step"] == 7
    second = train(token_paths, target, vocab, tmp_path / "killed", cfg, TINY_DRAFT, stream=source)
    assert second["start_step"] == 4
    runs = [load_trained(tmp_path / d)[0] for d in ("stored-run", "stream-run", "killed")]
    for name, x in runs[0].state_dict().items():
        for other in runs[1:]:
            assert torch.equal(x, other.state_dict()[name]), name
    losses = [
        [r.split(",")[3] for r in (tmp_path / d / "metrics.csv").read_text().splitlines()[1:]]
        for d in ("stored-run", "stream-run", "killed")
    ]
    assert losses[0] == losses[1] == losses[2]
    # the rerun reused the server the killed run had started: one model load in all
    assert source.server.log_path.read_text().count("model loaded") == 1


def test_cache_budget_counts_allocated_blocks(tmp_path):
    tokens = write_token_shards(tmp_path / "tokens", n_shards=1)
    _, shard = tokens[0]
    plan = make_plan()
    states, _ = fake_states(shard.input_ids, shard.offsets, 4, H, "bfloat16", "bfloat16")
    rows = [(j, states[shard.offsets[j] : shard.offsets[j + 1]], None) for j in range(12)]
    for budget in (0, 20_000, 60_000, 10**8):
        cache = StateCache(tmp_path / f"cache-{budget}", budget)
        cache.add(shard, rows, plan, "bfloat16")
        assert cache.used_bytes() <= budget
        if budget == 10**8:
            assert cache.complete(shard)
        for j in cache.cached(shard.shard_id):
            got, *_ = cache.read(shard, j)
            assert torch.equal(got, rows[j][1])


def test_a_truncated_cache_index_is_rebuilt(tmp_path):
    """A crash left a cache index cut short: it counts as empty, with a warning, and the next
    `add` writes it whole again (streaming goes on, nobody deletes anything by hand)."""
    tokens = write_token_shards(tmp_path / "tokens", n_shards=1)
    _, shard = tokens[0]
    plan = make_plan()
    states, _ = fake_states(shard.input_ids, shard.offsets, 4, H, "bfloat16", "bfloat16")
    rows = [(j, states[shard.offsets[j] : shard.offsets[j + 1]], None) for j in range(12)]
    cache = StateCache(tmp_path / "cache", 10**8)
    cache.add(shard, rows[:6], plan, "bfloat16")
    index = cache.index_file(shard.shard_id)
    index.write_bytes(index.read_bytes()[:7])  # '{"sampl'
    with pytest.warns(UserWarning, match="unreadable"):
        assert cache.cached(shard.shard_id) == set()
    with pytest.warns(UserWarning):
        cache.add(shard, rows, plan, "bfloat16")
    assert cache.complete(shard)
    for j in range(12):
        assert torch.equal(cache.read(shard, j)[0], rows[j][1])


def test_a_tcp_server_started_inside_slurm_is_a_job_of_its_own(tmp_path, server_env, monkeypatch):
    """Inside an allocation (SLURM_JOB_ID), the trainer-side reader of a TCP source submits the
    server with `sbatch` (the engine's nodes and GPUs, its log) and waits for its address; here
    `sbatch` and `squeue` are stand-ins that start the job's command on this host."""
    from dataclasses import replace

    from eagleflow.serve.client import server_job_command

    gpu = replace(
        source_for(tmp_path, tcp=True).server,
        settings=EngineSettings(
            "t", device="cuda", tensor_parallel_size=8, pipeline_parallel_size=2, nodes=2
        ),
    )
    cmd = server_job_command(gpu, "eagleflow.extract.capture_server", python="/py")
    assert cmd[:2] == ["sbatch", "--parsable"]
    assert {"--nodes=2", "--gres=gpu:8", "--exclusive"} <= set(cmd)
    assert f"--output={gpu.log_path.resolve()}" in cmd
    spec_file = gpu.file(".spec.json").resolve()
    assert cmd[-2:] == ["--wrap", f"/py -m eagleflow.extract.capture_server {spec_file}"]

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        "#!/bin/bash\n"
        'for a in "$@"; do case $a in --output=*) out=${a#--output=};; esac; done\n'
        "wrap=${@: -1}\n"
        'EAGLEFLOW_SERVER_HOST=127.0.0.1 setsid bash -c "$wrap" >>"$out" 2>&1 </dev/null &\n'
        "echo 4242\n"
    )
    (bin_dir / "squeue").write_text("#!/bin/bash\necho RUNNING\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    stored, _, _ = datasets(tmp_path)
    source = source_for(tmp_path, tcp=True)
    token_paths = sorted(str(p) for p in (tmp_path / "tokens").glob("*.safetensors"))
    served = ServedStates(source, token_paths)
    logs = []
    engine = served.start_server(logs.append)
    assert engine["loaded_here"] and any("SLURM job 4242" in line for line in logs), logs
    streamed = PackDataset(layout_of(token_paths, LAYER_IDS, L), sample_table(token_paths), 3)
    streamed.source = served
    for pack in packs_of(stored)[:3]:
        assert_same_batch(stored[pack], streamed[pack])
    assert stop_server(source.server)


def test_a_server_killed_mid_epoch_fails_the_trainer_naming_it_and_the_rerun_completes(
    tmp_path, server_env, monkeypatch
):
    stored, streamed, source = datasets(tmp_path)
    target = write_target(tmp_path / "target")
    vocab = build_draft_vocab(stored.layout.paths, V, 48)
    cfg = train_config(10)
    train(stored.layout.paths, target, vocab, tmp_path / "stored-run", cfg, TINY_DRAFT)
    die = tmp_path / "die-after"
    die.write_text("6")  # the server dies on its 7th pack, in step 7
    monkeypatch.setenv("EAGLEFLOW_FAKE_DIE_FILE", str(die))
    paths, run = streamed.layout.paths, tmp_path / "stream-run"
    with pytest.raises(RuntimeError) as e:
        train(paths, target, vocab, run, cfg, TINY_DRAFT, stream=source)
    assert "died while capturing a training pack" in str(e.value)
    assert str(source.server.log_path) in str(e.value)
    die.unlink()
    again = train(paths, target, vocab, run, cfg, TINY_DRAFT, stream=source)
    assert again["start_step"] == 4 and again["end_step"] == 10  # from the step-4 checkpoint
    a, b = load_trained(tmp_path / "stored-run")[0], load_trained(run)[0]
    for name, x in a.state_dict().items():
        assert torch.equal(x, b.state_dict()[name]), name


def test_a_stream_source_refuses_a_plan_whose_states_go_to_files(tmp_path):
    """vLLM's extract_hidden_states connector writes every state to files: not streamable."""
    from dataclasses import replace

    import yaml
    from snakemake.utils import validate

    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["draft"]["states"] = "stream"
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    plan = replace(make_plan(), strategy=Strategy.EXTRACT_HIDDEN_STATES)
    plan.save(tmp_path / "capture_plan.json")
    with pytest.raises(ValueError, match=r"capture_plan.json uses vLLM's extract_hidden_states"):
        StreamSource.for_job(config, tmp_path / "capture_plan.json", tmp_path / "x.log")


# ---------------------------------------------------------------- the checks of issue 35


def test_a_cached_sample_whose_token_ids_differ_is_refused(tmp_path):
    """A cache hit is checked as a streamed sample is, token ids included: a cache written for
    other tokens under the same shard id fails the read, naming the sample."""
    stored, cached, source = datasets(tmp_path, mode="cached", budget=10**9)
    shard = cached.source.shard(0)
    other = replace(shard, input_ids=(shard.input_ids + 1) % V)
    states, _ = fake_states(
        other.input_ids, other.offsets, len(LAYER_IDS), H, "bfloat16", "bfloat16"
    )
    a, b = int(other.offsets[0]), int(other.offsets[1])
    source.cache.add(other, [(0, states[a:b], None)], source.plan, "bfloat16")
    first = next(i for i in range(len(cached.table.shard)) if cached.table.shard[i] == 0)
    assert sample_index(shard, int(cached.table.start[first])) == 0
    with pytest.raises(StreamedStatesInvalid, match=r"#0\) of token shard .*token ids differ"):
        cached[(first,)]


def test_a_server_answering_fewer_samples_than_asked_is_refused(tmp_path, monkeypatch):
    """An answer short of samples fails the request with a sentence naming the first one
    missing, not a KeyError later."""
    _, streamed, source = datasets(tmp_path)
    served = streamed.source
    shard = served.shard(0)

    class ShortAnswer:
        engine = {}

        def __init__(self, *args, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def states(self, request):
            offsets = shard.offsets[:2].tolist()  # the first sample only
            states, _ = fake_states(
                shard.input_ids[: offsets[1]], offsets, len(LAYER_IDS), H, "bfloat16", "bfloat16"
            )
            ids = torch.from_numpy(shard.input_ids[: offsets[1]].astype(np.int64))
            return {
                "states": to_wire(states),
                "scales": None,
                "input_ids": to_wire(ids),
                "offsets": offsets,
            }

    monkeypatch.setattr(states_module, "EngineClient", ShortAnswer)
    with pytest.raises(StreamedStatesInvalid, match=r"1 of 2 samples.*#1\) of token shard"):
        served.request([(0, 0), (0, 1)], [0, 1])


def test_the_trainer_refuses_streamed_states_split_over_ranks(tmp_path):
    """draft.sequence_parallel > 1 with streamed states is refused by the trainer itself (not
    only by the workflow's preflight), with a sentence naming both keys."""
    stored, streamed, source = datasets(tmp_path)
    target = write_target(tmp_path / "target")
    vocab = build_draft_vocab(stored.layout.paths, V, 48)
    cfg = replace(train_config(4), sequence_parallel=2)
    with pytest.raises(ValueError, match="streamed states"):
        train(
            streamed.layout.paths, target, vocab, tmp_path / "run", cfg, TINY_DRAFT, stream=source
        )
