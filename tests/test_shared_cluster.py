"""Safe on a shared cluster (docs/security.md). Each test acts as another user of the machine,
a hostile or broken client, or a crash would: a pre-created engine registry, a planted key, a
pickle on the wire, clients that fail the handshake, stall or vanish, an integrity check
during a running extract, two trainers on one folder, a SIGKILLed server's scratch, a
10,000-deep row, a results directory that is a shell injection. No vLLM: the engine is the
fake one (tests/support/fake_engine_server.py) behind the real serving loop."""

import json
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

import pandas as pd
import pytest

from eagleflow.engine.settings import EngineSettings
from eagleflow.serve.client import LOADED, EngineClient, ServerSpec, alive, release_idle_servers
from support.datasets import write_jsonl
from support.fake_engine_server import reply
from support.workflow_runner import REPO

FAKE_SERVER = "support.fake_engine_server"
OTHER_UID = 4242  # another user of the machine (the tests run as root in CI: chown works)
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")


def python_env():
    paths = [str(REPO / "workflow"), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in paths if p)


@pytest.fixture
def spec(tmp_path, monkeypatch):
    """A generate server's spec whose registry is this test's own ($XDG_RUNTIME_DIR); every
    server started here is killed after, with its process group."""
    monkeypatch.setenv("PYTHONPATH", python_env())
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    spec = ServerSpec(
        EngineSettings("unused-target"),
        None,
        engine_dir=tmp_path / "results" / ".engine",
        log_dir=tmp_path / "logs",
        idle_seconds=60,
        watch_pid=os.getpid(),  # the server stops with this test run at the latest
        kind="generate",
        handshake_seconds=1.0,
    )
    started = []
    yield spec, started
    for pid in started:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def connect(spec, started):
    client = EngineClient(spec, FAKE_SERVER, log=lambda *_: None).__enter__()
    if client.started_here:
        started.append(client.server_pid)
    return client


class Listener(threading.Thread):
    """Another user's listener on an abstract unix socket: counts the connections it gets."""

    def __init__(self):
        super().__init__(daemon=True)
        self.address = f"\0eagleflow-planted-{os.getpid()}-{time.time_ns()}"
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(self.address)
        self.sock.listen(8)
        self.sock.settimeout(0.1)
        self.connections, self.stop = 0, threading.Event()
        self.start()

    def run(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.close()  # a real attacker would send its pickle here


# ---------------------------------------------------------------- private places


@needs_root
@pytest.mark.parametrize("planted", ["owned by another user", "mode 0777"])
def test_a_precreated_registry_is_refused_and_its_planted_entry_gets_no_connection(
    tmp_path, monkeypatch, planted
):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    registry = tmp_path / f"eagleflow-engines-{os.getuid()}"
    registry.mkdir()
    registry.chmod(0o777)
    if planted == "owned by another user":
        os.chown(registry, OTHER_UID, OTHER_UID)
    # The other user's entry: a live pid, this run, their key, their listener.
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "k.key").write_text(os.urandom(32).hex())
    listener = Listener()
    run = (os.getpid(), "")
    entry = {
        "key": "0" * 16,
        "kind": "generate",
        "pid": os.getpid(),
        "address": listener.address,
        "family": "AF_UNIX",
        "keyfile": str(evil / "k.key"),
        "run": list(run),
        "log": str(evil / "log"),
    }
    (registry / f"{'0' * 16}.json").write_text(json.dumps(entry))
    try:
        with pytest.raises(RuntimeError, match=f"will not use {registry}"):
            release_idle_servers(run, log=lambda m: None)
        time.sleep(0.3)
        assert listener.connections == 0
    finally:
        listener.stop.set()
        listener.join(timeout=5)


@pytest.mark.parametrize("planted", ["another user's folder", "a group-writable folder"])
def test_a_planted_key_in_an_engine_folder_not_yours_is_refused(spec, planted):
    if planted == "another user's folder" and os.getuid() != 0:
        pytest.skip("chown to another uid needs root")
    spec, started = spec
    folder = spec.engine_dir
    folder.mkdir(parents=True)
    key = spec.file(".key")
    key.write_text(os.urandom(32).hex())
    key.chmod(0o600)
    if planted == "another user's folder":
        os.chown(folder, OTHER_UID, OTHER_UID)
        os.chown(key, OTHER_UID, OTHER_UID)
    else:
        folder.chmod(0o775)
    client = EngineClient(spec, FAKE_SERVER, log=lambda *_: None)
    try:
        with pytest.raises(RuntimeError, match=f"will not use the engine files in {folder}"):
            client.__enter__()
    finally:
        if client.server_pid:  # the code before the fix started a server with the key
            started.append(client.server_pid)
    # The server itself refuses a spec from such a folder (its target, trust_remote_code).
    spec_file = spec.file(".spec.json")
    spec_file.write_text(json.dumps(spec.to_json() | {"idle_seconds": 1}))
    proc = subprocess.run(
        [sys.executable, "-m", FAKE_SERVER, str(spec_file)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and f"engine files in {folder}" in proc.stderr


def test_a_key_readable_by_others_is_refused(spec):
    spec, _ = spec
    spec.engine_dir.mkdir(parents=True, mode=0o700)
    key = spec.file(".key")
    key.write_text(os.urandom(32).hex())
    key.chmod(0o644)
    from eagleflow.serve.client import read_key

    with pytest.raises(RuntimeError, match=f"will not read {key}: its mode is 0644"):
        read_key(key)


# ---------------------------------------------------------------- the wire


class RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_of_os_system_is_rejected_without_running(spec, tmp_path):
    """A peer that holds the key (or relays a hijacked connection) sends a pickle, as
    `multiprocessing.connection` frames one: the server drops that connection, runs nothing,
    and serves the next job with the engine it has."""
    from eagleflow.serve import wire

    spec, started = spec
    first = connect(spec, started)
    first.__exit__(None, None, None)
    marker = tmp_path / "pwned"
    payload = pickle.dumps(RunsCode(marker))
    key = bytes.fromhex(spec.file(".key").read_text())
    conn = wire.connect(spec.address, socket.AF_UNIX, key, 30)
    assert conn.recv(30)[0] == "hello"
    conn.sock.sendall(struct.pack("!i", len(payload)) + payload)
    with pytest.raises((EOFError, OSError)):
        conn.recv(30)  # the server closed it
    conn.close()
    # Nor does a client run anything the server sends: a pickle is not a message.
    with pytest.raises(wire.WireError):
        wire.decode(payload, [])
    deep = json.dumps({"m": None, "f": []})[:-1] + ', "x": ' + "[" * 10_000 + "]" * 10_000 + "}"
    with pytest.raises(wire.WireError, match="does not parse"):
        wire.decode(deep.encode(), [])
    again = connect(spec, started)
    assert not again.started_here and again.server_pid == first.server_pid
    assert again.generate([[1, 2]], 4) == [reply([1, 2], 4)]
    again.__exit__(None, None, None)
    assert not marker.exists()
    assert spec.log_path.read_text().count(LOADED) == 1


VANISH = """
import os, signal, socket, sys
from eagleflow.serve import wire
key = bytes.fromhex(open(sys.argv[2]).read())
conn = wire.connect("\\0" + sys.argv[1], socket.AF_UNIX, key, 30)
conn.recv(30)
# the start of a request that promises a frame of 1 MB, then the process is gone
conn.sock.sendall(wire.encode(["generate", {"prompts": b"x" * 1000}])[0][:-5])
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(120)
def test_a_wrong_key_a_silent_and_a_vanished_client_leave_the_server_serving(spec):
    from eagleflow.serve import wire

    spec, started = spec
    first = connect(spec, started)
    first.__exit__(None, None, None)
    # A client with another key: refused, the serving loop goes on.
    with pytest.raises(wire.AuthenticationFailed):
        wire.connect(spec.address, socket.AF_UNIX, os.urandom(32), 30)
    # A client that connects and sends nothing: dropped after the handshake limit (1 s here).
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(spec.address)
    # A client killed in the middle of a request.
    vanished = subprocess.run(
        [sys.executable, "-c", VANISH, spec.address[1:], str(spec.file(".key"))],
        env=dict(os.environ, PYTHONPATH=python_env()),
        capture_output=True,
        timeout=60,
    )
    assert vanished.returncode == -signal.SIGKILL, vanished.stderr
    t0 = time.time()
    job = connect(spec, started)
    assert time.time() - t0 < 20
    assert not job.started_here and job.server_pid == first.server_pid  # no reload
    assert job.generate([[3, 4, 5]], 8) == [reply([3, 4, 5], 8)]
    job.__exit__(None, None, None)
    silent.close()
    log = spec.log_path.read_text()
    assert log.count(LOADED) == 1 and alive(first.server_pid)
    assert log.count("a client was refused") >= 2 and "a client went away" in log


# ---------------------------------------------------------------- crash leftovers


def test_the_integrity_check_leaves_a_running_extract_s_shard_alone_and_a_dry_run_moves_nothing(
    tokenizer, tmp_path
):
    from eagleflow.extract.shard import shard_lock
    from eagleflow.store.integrity import check_finished_shards
    from support.synthetic import FP, make_extracted_shard, make_token_shards

    running, damaged = make_token_shards(tokenizer, n=8, size=4)
    for shard in (running, damaged):
        make_extracted_shard(shard, tmp_path)
    d = tmp_path / FP
    ids = [running.shard_id, damaged.shard_id]
    # The running job has linked its shard into place and not yet written its record.
    (d / f"{running.shard_id}.json").unlink()
    with open(d / f"{damaged.shard_id}.safetensors", "r+b") as f:
        f.truncate(1000)
    messages = []
    with shard_lock(d / ".partial" / running.shard_id, running.shard_id):
        # snakemake -n while the job runs: reported, nothing moved
        assert check_finished_shards(d, ids, FP, log=messages.append, dry_run=True) == [
            damaged.shard_id
        ]
        assert not (d / "quarantine").exists()
        assert any("dry run" in m for m in messages)
        # a real run: the damaged shard goes to quarantine, the running job's shard stays
        assert check_finished_shards(d, ids, FP, log=messages.append) == [damaged.shard_id]
    assert (d / f"{running.shard_id}.safetensors").exists()
    assert not list((d / "quarantine").glob(f"{running.shard_id}-*"))


def test_a_foreign_safetensors_header_is_quarantined(tokenizer, tmp_path):
    from eagleflow.store.integrity import check_finished_shards
    from support.synthetic import FP, make_extracted_shard, make_token_shards

    shard = make_token_shards(tokenizer, n=4, size=4)[0]
    make_extracted_shard(shard, tmp_path)
    d = tmp_path / FP
    header = json.dumps(["not", "a", "dict"]).encode()
    (d / f"{shard.shard_id}.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    bad = check_finished_shards(d, [shard.shard_id], FP, log=lambda m: None)
    assert bad == [shard.shard_id]
    reason = next((d / "quarantine").glob("*/reason.txt")).read_text()
    assert "not a safetensors header" in reason


def test_a_second_trainer_on_the_same_work_folder_stops_with_a_sentence(tmp_path):
    """The first trainer holds the work folder; the second (another invocation sharing
    results_dir) stops before it touches a checkpoint; once the first is killed, a rerun
    goes ahead."""
    from eagleflow.plan.settings import TrainConfig
    from eagleflow.train.trainer import train

    work, holding = tmp_path / "train.work", tmp_path / "holding"
    first = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import pathlib, sys, time\n"
            "from eagleflow.store.locks import work_lock\n"
            "with work_lock(sys.argv[1], 'the trainer work folder', 'train.lock'):\n"
            "    pathlib.Path(sys.argv[2]).touch()\n"
            "    time.sleep(120)\n",
            str(work),
            str(holding),
        ],
        env=dict(os.environ, PYTHONPATH=python_env()),
    )
    try:
        deadline = time.time() + 60
        while not holding.exists():
            assert first.poll() is None and time.time() < deadline, "the first trainer never held"
            time.sleep(0.05)
        cfg = TrainConfig(max_steps=1, device="cpu")
        with pytest.raises(RuntimeError, match=f"{work} is in use by another process"):
            train([], tmp_path / "no-target", None, work, cfg)
    finally:
        first.kill()
        first.wait(timeout=60)
    from eagleflow.store.locks import work_lock

    with work_lock(work, "the trainer's work folder", "train.lock"):  # nothing left behind
        pass


KILLED_SERVER = """
import os, signal, sys
from eagleflow.extract.stream import StreamCapture
capture = StreamCapture(None, None, "bfloat16", sys.argv[1], "0123456789abcdef")
scratch = capture.new_scratch()
(scratch / "pack.safetensors").write_bytes(b"s" * 4096)
print(scratch, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # mid-pack
"""


def test_a_sigkilled_server_s_scratch_is_removed_by_the_next_server(tmp_path):
    from eagleflow.extract.stream import StreamCapture

    shm = tmp_path / "shm"
    shm.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_SERVER, str(shm)],
        env=dict(os.environ, PYTHONPATH=python_env()),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = [p for p in shm.iterdir()]
    assert len(left) == 1 and str(left[0]) == proc.stdout.strip()
    assert left[0].stat().st_mode & 0o777 == 0o700  # private while it existed
    live = StreamCapture(None, None, "bfloat16", shm, "fedcba9876543210")
    mine = live.new_scratch()  # a live server's folder is kept
    StreamCapture(None, None, "bfloat16", shm, "0123456789abcdef")  # the rerun's server
    assert list(shm.iterdir()) == [mine]


def test_a_10000_deep_row_is_a_named_reject_under_skip(tokenizer_dir, tmp_path):
    from eagleflow.data.shards import TokenShardOutputs, shard_dataset
    from eagleflow.embedded.bundled_data import generate_conversations

    rows = [
        {"id": f"r{i}", "messages": r["messages"]} for i, r in enumerate(generate_conversations(6))
    ]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    with open(data, "a") as f:
        f.write('{"id": "deep", "messages": ' + "[" * 10_000 + "]" * 10_000 + "}\n")
    out = TokenShardOutputs(tmp_path / "t", tmp_path / "m.parquet", tmp_path / "rej.jsonl")
    summary = shard_dataset(
        data, tokenizer_dir, out, shard_size=4, max_length=512, on_bad_row="skip"
    )
    assert summary["conversations"] == 6 and summary["rejected"] == 1
    rejects = pd.read_json(tmp_path / "rej.jsonl", lines=True)
    assert rejects[["source_row", "reason"]].values.tolist() == [
        [7, "JSON nested too deeply to read"]
    ]


# ---------------------------------------------------------------- SLURM


def test_a_results_dir_with_a_space_and_a_command_substitution_works_under_slurm(
    spec, tmp_path, monkeypatch
):
    """A TCP server started from inside an allocation is an `sbatch --wrap` job; here `sbatch`
    and `squeue` are stand-ins that run the wrapped command on this host as SLURM would (with
    `bash -c`) and report it running while it lives."""
    from dataclasses import replace

    spec, started = spec
    results = tmp_path / "my results $(touch injected)"
    spec = replace(spec, engine_dir=results / ".engine", log_dir=results / "logs", tcp=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pid_file = tmp_path / "server.pid"
    (bin_dir / "sbatch").write_text(
        "#!/bin/bash\n"
        'for a in "$@"; do case $a in --output=*) out=${a#--output=};; esac; done\n'
        "wrap=${@: -1}\n"
        'EAGLEFLOW_SERVER_HOST=127.0.0.1 setsid bash -c "$wrap" >>"$out" 2>&1 </dev/null &\n'
        f"echo $! > '{pid_file}'\n"
        "echo 4242\n"
    )
    (bin_dir / "squeue").write_text(
        f"#!/bin/bash\nkill -0 $(cat '{pid_file}') 2>/dev/null && echo RUNNING\nexit 0\n"
    )
    (bin_dir / "scancel").write_text("#!/bin/bash\nexit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.chdir(tmp_path)
    try:
        client = connect(spec, started)
        assert client.generate([[7, 8]], 4) == [reply([7, 8], 4)]
        client.__exit__(None, None, None)
    finally:
        if pid_file.exists():
            started.append(int(pid_file.read_text()))
    assert not (tmp_path / "injected").exists()
    assert not list(results.parent.glob("**/injected"))


def test_a_tls_server_is_reached_only_with_the_run_s_certificate(spec, monkeypatch, tmp_path):
    """`draft.stream_tls`: the server's TCP port speaks TLS with a certificate made for the
    run beside its key; a client pinned to it is served; one that speaks plain TCP, or pins
    another certificate, never reaches the key check."""
    from dataclasses import replace

    from eagleflow.serve import wire
    from eagleflow.serve.tls import client_context, make_certificate

    spec, started = spec
    monkeypatch.setenv("EAGLEFLOW_SERVER_HOST", "127.0.0.1")
    with pytest.raises(ValueError, match="TLS is for a TCP server"):
        replace(spec, tls=True)
    spec = replace(spec, tcp=True, tls=True)
    client = connect(spec, started)
    assert client.generate([[1, 2, 3]], 4) == [reply([1, 2, 3], 4)]
    client.__exit__(None, None, None)
    assert spec.file(".tls.pem").stat().st_mode & 0o777 == 0o600
    key = bytes.fromhex(spec.file(".key").read_text())
    address = spec.tcp_address()
    with pytest.raises((OSError, EOFError)):  # plain TCP
        wire.connect(address, socket.AF_INET, key, 10)
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    make_certificate(other / "c.pem", other / "k.pem", "someone else")
    with pytest.raises(OSError):  # ssl.SSLCertVerificationError
        wire.connect(address, socket.AF_INET, key, 10, client_context(other / "c.pem"))
    again = connect(spec, started)  # the server serves on, with the model it loaded
    assert not again.started_here and again.generate([[5]], 4) == [reply([5], 4)]
    again.__exit__(None, None, None)


def test_a_server_without_the_key_is_not_believed(tmp_path):
    """Another user listens under the server's name first (the abstract socket name is
    findable): the client's half of the handshake finds that it does not hold the key."""
    from eagleflow.serve import wire

    address = f"\0eagleflow-squatter-{os.getpid()}-{time.time_ns()}"
    squatter = socket.socket(socket.AF_UNIX)
    squatter.bind(address)
    squatter.listen(1)

    def pose():
        conn, _ = squatter.accept()
        conn.settimeout(10)
        conn.sendall(wire.HELLO + os.urandom(wire.NONCE))
        conn.recv(2 * wire.NONCE)
        conn.sendall(os.urandom(wire.NONCE))  # it cannot compute the proof
        conn.close()

    thread = threading.Thread(target=pose, daemon=True)
    thread.start()
    with pytest.raises(wire.AuthenticationFailed, match="does not hold the key"):
        wire.connect(address, socket.AF_UNIX, os.urandom(32), 10)
    thread.join(timeout=10)
    squatter.close()


def test_a_queued_engine_job_is_cancelled_when_its_submitter_fails(spec, tmp_path, monkeypatch):
    """The job that submitted the engine server is interrupted while the server waits in the
    queue: the queued job is cancelled, not left to start an engine nobody will use."""
    import eagleflow.serve.client as client_module

    spec, _ = spec
    from dataclasses import replace

    spec = replace(spec, tcp=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cancelled = tmp_path / "cancelled"
    (bin_dir / "sbatch").write_text("#!/bin/bash\necho 4343\n")  # queued, never started
    (bin_dir / "squeue").write_text("#!/bin/bash\necho PENDING\n")
    (bin_dir / "scancel").write_text(f"#!/bin/bash\necho \"$@\" >> '{cancelled}'\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "1")

    def interrupted(job_id):
        raise KeyboardInterrupt  # the job's own time limit, a Ctrl-C, any error

    monkeypatch.setattr(client_module, "slurm_job_alive", interrupted)
    with pytest.raises(KeyboardInterrupt):
        EngineClient(spec, FAKE_SERVER, log=lambda *_: None).__enter__()
    assert cancelled.read_text().split() == ["4343"]


def test_messages_are_json_and_bytes_and_anything_else_is_a_named_wire_error():
    """What the wire carries, and what a peer that breaks it gets: a WireError naming why,
    for that connection only."""
    from eagleflow.serve import wire

    a, b = socket.socketpair()
    left, right = wire.Connection(a), wire.Connection(b)
    value = ["done", {"ids": [1, 2], "x": 0.5, "none": None, "raw": b"\x00\xff", "t": (1, "s")}]
    left.send(value)
    got = right.recv(10)
    assert got == [
        "done",
        {"ids": [1, 2], "x": 0.5, "none": None, "raw": b"\x00\xff", "t": [1, "s"]},
    ]
    with pytest.raises(TypeError):
        left.send(["x", {1, 2}])  # a set is not a wire value
    for junk, why in [
        (b"GET / HTTP/1.1\r\n\r\n", "magic bytes"),
        (wire.MAGIC + struct.pack("<I", wire.MAX_HEADER + 1), "header of"),
        (wire.MAGIC + struct.pack("<I", 4) + b"[1,2", "does not parse"),
        (wire.MAGIC + struct.pack("<I", 21) + b'{"m": {"$b": 3}, "f": []}'[:21], "does not parse"),
    ]:
        a.sendall(junk)
        with pytest.raises(wire.WireError, match=why):
            right.recv(10)
        a.close(), b.close()
        a, b = socket.socketpair()
        left, right = wire.Connection(a), wire.Connection(b)
    frame_ref = b'{"m": {"$b": 3}, "f": []}'
    a.sendall(wire.MAGIC + struct.pack("<I", len(frame_ref)) + frame_ref)
    with pytest.raises(wire.WireError, match="names no frame"):
        right.recv(10)
    with pytest.raises(wire.PeerSilent):
        right.recv(0.2)  # nothing more comes
    a.close(), b.close()
