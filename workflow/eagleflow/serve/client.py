"""A job's side of a shared engine (docs/engine-reuse.md); the serving loop is
`eagleflow.serve.server`. Two kinds of server, never one engine for both, each started from
its stage's own module (the caller names it: `EngineClient(spec, server_module)`):

- `capture` (extract jobs, `eagleflow.extract.capture_server`): the first extract job that has
  chunks to prefill starts a detached server process (`python -m <server_module> SPEC`), under
  a file lock so two jobs never start two. The server loads the target with the capture hooks
  installed, then listens on a Linux abstract unix socket (per host, nothing to clean up) with
  an authkey kept in a 0600 file of a 0700 `.engine/` folder (`eagleflow.store.private`).
  Each extract job stays its own Snakemake job (outputs, shard lock, chunk resume,
  finishing, record, verification, log): it connects as a client and asks the server to
  prefill its shard. The server recomputes the shard's missing chunks itself when the
  request starts, runs the same `run_chunks` as a per-shard engine, streams its
  progress lines to the client and ends with the figures or the full traceback, which the
  client prints in the shard's log.
- `generate` (regenerate_shard jobs, `eagleflow.regenerate.generate_server`): started and
  shared the same way, with the regeneration engine (no capture hooks). The job keeps its
  chunks, commits, rejects, summary and progress bar; its generator
  (`eagleflow.regenerate.replies.served_generator`) sends each round's prompt ids
  (`EngineClient.generate`) and gets the replies, which the server computes with the same
  `generate_replies` call a per-job engine makes.

- `states` (a streaming training job, `draft.states: stream | cached`, docs/streaming.md): a
  capture server like the extract jobs', asked for the captured states of one pack's samples
  at a time (`EngineClient.states`, `eagleflow.extract.stream`); each DataLoader worker of
  each rank connects for one request and leaves, so every rank and worker takes its turn.

A server of a spec with `tcp` listens on a TCP port of its host instead of the unix socket,
and writes `<key>.address` (host, port) next to its key file: a job on another node (another
SLURM allocation: the training job of a streaming run) finds it there and connects with the
same authkey (docs/streaming.md#transport). With `tls` (`draft.stream_tls`) the connection
is TLS, with a certificate made for the run and pinned by the clients (`eagleflow.serve.tls`).
A job inside a SLURM allocation that starts a `tcp` server submits it as a SLURM job of its
own (`server_job_command`: the engine's nodes and GPUs, the job's log), so the engine and the
trainer hold separate allocations.

Messages travel on `eagleflow.serve.wire`: a mutual HMAC handshake over the key, then JSON
headers and raw byte frames, never pickle; every wait has a limit (docs/security.md).

The server serves one request at a time and exits when it has been idle (no client connected)
for `idle_seconds`, when the Snakemake process it belongs to is gone (local runs), or after a
failed request (a fresh server starts clean). A client whose server dies gets EOF and fails
with the tail of the server's log (the engine's traceback); the rerun starts a new server and
resumes from the committed chunks.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from eagleflow.capture.plan import CapturePlan, Strategy
from eagleflow.engine.settings import EngineSettings
from eagleflow.serve import wire
from eagleflow.store.private import engine_dir, private_dir, read_private, write_private

LOADED = "eagleflow engine server: model loaded"  # one line per model load in the server log
KINDS = ("capture", "generate")  # what a server's engine is built for, and the request it serves
READY_TIMEOUT_S = 6 * 3600  # a load that never finishes still ends (the job's time limit first)
BACKLOG = 256  # connections a server's listener queues while it serves one
# A `states` request is one pack's prefill (seconds); no answer for this long means the
# server's host is gone without closing the connection (a lost node).
STATES_TIMEOUT_S = 1800
# A `prefill` request sends a progress line per chunk (seconds each): the same silence limit.
# A `generate` round sends nothing until its replies are done (at most max_num_seqs prompts
# decoding max_new_tokens at a time, minutes), so it gets the load's limit: a round that never
# ends still ends.
PREFILL_SILENCE_S = STATES_TIMEOUT_S
GENERATE_TIMEOUT_S = READY_TIMEOUT_S
# A connected job that sends nothing for this long is dropped by the server (a vanished TCP
# peer is noticed sooner, by keepalive): an extract job stays connected while it verifies.
CLIENT_SILENCE_S = 3600.0


def snakemake_ancestor(pid: int | None = None) -> int | None:
    """The outermost ancestor process whose command line names snakemake: the run the server
    belongs to locally. None under SLURM (each job runs in its own step there; the allocation's
    end or the idle timeout ends the server) or when there is none."""
    if os.environ.get("SLURM_JOB_ID"):
        return None
    found, pid = None, os.getppid() if pid is None else pid
    while pid > 1:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        if b"snakemake" in cmd:
            found = pid
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # ppid, after the command name
    return found


def alive(pid: int) -> bool:
    """The process runs (an exited one not yet reaped by its parent does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def registry_dir() -> Path:
    """Where this user's live servers on this host say who they are (`ServerSpec.registry_file`),
    so that a job about to load an engine can ask the idle ones of its run to stop first:
    `$XDG_RUNTIME_DIR/eagleflow-engines`, else `<tmp>/eagleflow-engines-<uid>`, a folder of
    this uid's with mode 0700 (made so, or the run stops: `eagleflow.store.private`)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return private_dir(Path(runtime) / "eagleflow-engines")
    return private_dir(Path(tempfile.gettempdir()) / f"eagleflow-engines-{os.getuid()}")


def read_key(path) -> bytes:
    """A server's authkey: only from a file of this uid's, mode 0600, in a `.engine/` folder
    of this uid's that nobody else can write (UnsafePath otherwise)."""
    return bytes.fromhex(read_private(path, secret=True))


@dataclass(frozen=True)
class ServerSpec:
    """What a server loads and where it lives; its key names the socket, lock and files.

    `kind`: "capture" (extract jobs: the capture hooks for `plan`) or "generate"
    (regenerate_shard jobs: the regeneration engine, no plan)."""

    settings: EngineSettings
    plan: CapturePlan | None
    engine_dir: Path  # <hidden>/.engine or <regenerated>/.engine: lock, spec, key files
    log_dir: Path  # the jobs' log directory: engine-<key>.log
    idle_seconds: float
    watch_pid: int | None = None
    kind: str = "capture"
    # Listen on TCP (reachable from other nodes) instead of a unix socket of this host.
    tcp: bool = False
    # CUDA_VISIBLE_DEVICES of the server's engine (a streaming run shares its node with the
    # trainer's ranks); None: the starting job's.
    devices: str | None = None
    # The server drops a connected job silent for this long (CLIENT_SILENCE_S).
    client_silence_seconds: float = CLIENT_SILENCE_S
    # ... and a client that has not proven the key this long after it was accepted.
    handshake_seconds: float = wire.HANDSHAKE_TIMEOUT_S
    # TLS on the TCP connection, with the run's certificate beside the key (serve.tls).
    tls: bool = False

    def __post_init__(self):
        if self.tls and not self.tcp:
            raise ValueError("TLS is for a TCP server (draft.stream_tcp: true)")
        if self.kind not in KINDS:
            raise ValueError(f"unknown engine server kind {self.kind!r}: one of {KINDS}")
        if (self.plan is None) != (self.kind == "generate"):
            raise ValueError("a capture server needs a capture plan; a generate server has none")

    @property
    def key(self) -> str:
        """Same kind, settings, plan, results directory, host and allocation: same server. A
        TCP server is one per results directory: jobs of other hosts and allocations find it
        by its address file."""
        ident = {
            "kind": self.kind,
            "settings": asdict(self.settings),
            "plan": self.plan.to_json() if self.plan else None,
            "dir": str(Path(self.engine_dir).resolve()),
        }
        if self.tcp:
            ident["tcp"] = True
            if self.tls:
                ident["tls"] = True
        else:
            ident["host"] = socket.gethostname()
            ident["allocation"] = os.environ.get("SLURM_JOB_ID", "")
        if self.devices is not None:
            ident["devices"] = self.devices
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def address(self) -> str:
        """The unix socket (Linux abstract namespace: per host); a TCP server's address is in
        its `.address` file (`tcp_address`)."""
        return f"\0eagleflow-engine-{self.key}"

    def tcp_address(self) -> tuple[str, int] | None:
        """(host, port) a TCP server wrote when it started listening; None before."""
        try:
            d = json.loads(read_private(self.file(".address")))
            return d["host"], int(d["port"])
        except (OSError, ValueError, KeyError):
            return None

    def tls_context(self, server: bool = False):
        """The TLS context of this spec's connections (None without TLS)."""
        if not self.tls:
            return None
        from eagleflow.serve.tls import client_context, server_context

        cert = self.file(".cert.pem")
        return server_context(cert, self.file(".tls.pem")) if server else client_context(cert)

    def listen(self) -> socket.socket:
        """The server's listening socket: the unix socket, or a TCP port (any free one) on the
        address of the host it publishes in the `.address` file, not on every interface."""
        # A deep backlog: clients (a streaming run's workers on several nodes, whose lock
        # file may not serialize them) queue in the kernel, none is refused.
        if not self.tcp:
            return wire.listen(self.address, socket.AF_UNIX, BACKLOG)
        host = os.environ.get("EAGLEFLOW_SERVER_HOST") or socket.gethostname()
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        listener = wire.listen(sockaddr[:2], family, BACKLOG)
        port = listener.getsockname()[1]
        write_private(self.file(".address"), json.dumps({"host": host, "port": port}))
        return listener

    def connect(self, authkey: bytes, ready_timeout: float = READY_TIMEOUT_S) -> wire.Connection:
        """A connection to the server that has proven it holds the key; a server still loading
        accepts once loaded (waited for up to `ready_timeout` s)."""
        if not self.tcp:
            return wire.connect(self.address, socket.AF_UNIX, authkey, ready_timeout)
        address = self.tcp_address()
        if address is None:
            raise ConnectionRefusedError(f"no {self.file('.address')} yet")
        family = socket.getaddrinfo(*address, type=socket.SOCK_STREAM)[0][0]
        return wire.connect(address, family, authkey, ready_timeout, self.tls_context())

    @property
    def log_path(self) -> Path:
        return Path(self.log_dir) / f"engine-{self.key}.log"

    def file(self, suffix: str) -> Path:
        return Path(self.engine_dir) / f"{self.key}{suffix}"

    @property
    def run(self) -> tuple:
        """The run the server belongs to: its Snakemake process (locally) and allocation."""
        return (self.watch_pid, os.environ.get("SLURM_JOB_ID", ""))

    @property
    def registry_file(self) -> Path:
        return registry_dir() / f"{self.key}.json"

    def registry_entry(self, pid: int) -> dict:
        return {
            "key": self.key,
            "kind": self.kind,
            "pid": pid,
            "address": list(self.tcp_address() or ()) if self.tcp else self.address,
            "family": "AF_INET" if self.tcp else "AF_UNIX",
            "keyfile": str(Path(self.file(".key")).resolve()),
            "tls": self.tls,
            "run": list(self.run),
            "log": str(self.log_path),
        }

    def to_json(self) -> dict:
        return {
            "settings": asdict(self.settings),
            "plan": self.plan.to_json() if self.plan else None,
            "engine_dir": str(self.engine_dir),
            "log_dir": str(self.log_dir),
            "idle_seconds": self.idle_seconds,
            "watch_pid": self.watch_pid,
            "kind": self.kind,
            "tcp": self.tcp,
            "devices": self.devices,
            "client_silence_seconds": self.client_silence_seconds,
            "handshake_seconds": self.handshake_seconds,
            "tls": self.tls,
        }

    @classmethod
    def from_json(cls, d: dict) -> ServerSpec:
        return cls(
            EngineSettings(**d["settings"]),
            CapturePlan.from_json(d["plan"]) if d["plan"] is not None else None,
            Path(d["engine_dir"]),
            Path(d["log_dir"]),
            float(d["idle_seconds"]),
            d["watch_pid"],
            d.get("kind", "capture"),
            d.get("tcp", False),
            d.get("devices"),
            float(d.get("client_silence_seconds", CLIENT_SILENCE_S)),
            float(d.get("handshake_seconds", wire.HANDSHAKE_TIMEOUT_S)),
            bool(d.get("tls", False)),
        )


def engine_server(
    config: dict, settings: EngineSettings, plan: CapturePlan | None, output, log
) -> ServerSpec | None:
    """The shared engine server a job uses (docs/engine-reuse.md): a capture server for an
    extract job (its `plan`), a generate server for a regenerate_shard job (no plan). Its lock,
    spec and key files go to `.engine/` next to the job's `output`, its log next to the job's
    `log`. None for an engine of the job's own: `extract.engine_reuse` off, or vLLM's connector
    (its output directory is fixed per engine)."""
    ext = config["extract"]
    if not ext["engine_reuse"]:
        return None
    if plan is not None and plan.strategy is Strategy.EXTRACT_HIDDEN_STATES:
        return None
    return ServerSpec(
        settings,
        plan,
        engine_dir=Path(output).parent / ".engine",
        log_dir=Path(log).parent,
        idle_seconds=ext["engine_idle_seconds"],
        watch_pid=snakemake_ancestor(),
        kind="capture" if plan is not None else "generate",
    )


def log_tail(path: Path, n_chars: int = 6000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n_chars:]
    except OSError:
        return "(no server log)"


class ServerGone(RuntimeError):
    pass


RELEASE_TIMEOUT_S = 300  # how long a job waits for an idle server to free the devices


def this_run() -> tuple:
    """The run a job belongs to, as `ServerSpec.run` (its Snakemake process, its allocation)."""
    return (snakemake_ancestor(), os.environ.get("SLURM_JOB_ID", ""))


def release_idle_servers(run: tuple, keep: str | None = None, log=print) -> None:
    """Ask the engine servers of `run` (same Snakemake process locally, same SLURM allocation;
    but not the one of key `keep`) to stop, and wait until they have: this job is about to load
    an engine, and two engines must not hold the devices at once (the generate server idling
    while the first extract job loads the capture engine). A server only answers when no job
    is connected to it, so a busy one finishes its request first. Without a run to scope it
    (no Snakemake ancestor, no allocation) nothing is asked."""
    if tuple(run) == (None, ""):
        return
    for path in sorted(registry_dir().glob("*.json")):
        try:
            entry = json.loads(path.read_text())
            pid = int(entry["pid"])
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            continue
        if not alive(pid):
            path.unlink(missing_ok=True)  # a server killed before it could remove its entry
            continue
        if entry.get("key") == keep or tuple(entry.get("run") or ()) != tuple(run):
            continue
        try:
            # Only a key of this uid's, in a private `.engine/` (read_key), is ever used.
            authkey = read_key(entry["keyfile"])
            tls = None
            if entry.get("tls"):
                from eagleflow.serve.tls import client_context

                tls = client_context(Path(str(entry["keyfile"])).with_suffix(".cert.pem"))
            if entry.get("family", "AF_UNIX") == "AF_INET":
                address = tuple(entry["address"])
                family = socket.getaddrinfo(*address, type=socket.SOCK_STREAM)[0][0]
            else:
                address, family = str(entry["address"]), socket.AF_UNIX
            conn = wire.connect(address, family, authkey, READY_TIMEOUT_S, tls)
            conn.recv(READY_TIMEOUT_S)  # hello
            conn.send(("release",))
            conn.recv(RELEASE_TIMEOUT_S)
            conn.close()
        except (OSError, EOFError, ValueError, KeyError, TypeError):
            if not alive(pid):
                continue  # it stopped meanwhile
            # Not reachable (its key file replaced): nobody can use it; it idles out.
            log(f"engine: could not ask the {entry.get('kind')} engine server pid {pid} to stop")
            continue
        deadline = time.time() + RELEASE_TIMEOUT_S
        while alive(pid) and time.time() < deadline:
            time.sleep(0.2)
        log(
            f"engine: the idle {entry.get('kind')} engine server pid {pid} of this run "
            + ("stopped" if not alive(pid) else f"did not stop in {RELEASE_TIMEOUT_S} s")
            + " before this job loads its engine"
        )


def stop_server(spec: ServerSpec, log=print) -> bool:
    """Ask the server of `spec`, if one runs, to stop once no job is connected to it (a
    streaming training job that has finished with it frees its devices for the next job).
    Returns whether one was asked."""
    try:
        conn = spec.connect(read_key(spec.file(".key")), ready_timeout=RELEASE_TIMEOUT_S)
        pid = conn.recv(RELEASE_TIMEOUT_S)[1]  # hello
        conn.send(("release",))
        conn.recv(RELEASE_TIMEOUT_S)
        conn.close()
    except (OSError, EOFError, ValueError, IndexError, TypeError):
        return False
    log(f"engine: asked the {spec.kind} engine server pid {pid} to stop")
    return True


def server_job_command(spec: ServerSpec, server_module: str, python: str = sys.executable):
    """`sbatch` of a server in an allocation of its own: the engine's nodes (extract.nodes),
    every GPU of each node its TP x PP workers take, the server's log; it ends when idle or
    asked to stop (`stop_server`), or at the cluster's time limit."""
    s = spec.settings
    cmd = [
        "sbatch",
        "--parsable",
        f"--job-name=eagleflow-engine-{spec.key}",
        f"--output={Path(spec.log_path).resolve()}",
        "--open-mode=append",
        f"--nodes={s.nodes}",
        "--ntasks-per-node=1",
    ]
    if s.device == "cuda":
        per_node = s.tensor_parallel_size * s.pipeline_parallel_size // s.nodes
        cmd += [f"--gres=gpu:{per_node}", "--exclusive"]
    spec_file = Path(spec.file(".spec.json")).resolve()
    # --wrap is a shell command line: every word quoted (a space or `$()` in a path stays text).
    wrap = shlex.join([python, "-m", server_module, str(spec_file)])
    return [*cmd, f"--chdir={os.getcwd()}", "--wrap", wrap]


def slurm_job_alive(job_id: str) -> bool:
    """The SLURM job is pending or running (squeue still lists it)."""
    out = subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=60
    )
    return out.returncode == 0 and out.stdout.strip() not in ("", "COMPLETED", "FAILED")


class EngineClient:
    """A job's connection to the engine server of `spec`, started if needed as
    `python -m <server_module> SPEC`: the module of the spec's kind, named by the caller
    (`eagleflow.extract.capture_server`, `eagleflow.regenerate.generate_server`; tests: a fake
    engine)."""

    def __init__(self, spec: ServerSpec, server_module: str, log=print):
        self.spec, self.server_module, self.log = spec, server_module, log
        self.conn = None
        self.started_here = False
        self.wait_seconds = 0.0
        self.server_pid = None

    def __enter__(self) -> EngineClient:
        t0 = time.perf_counter()
        for attempt in range(3):
            try:
                self._connect_or_start()
                break
            except ServerGone:
                if attempt == 2:
                    raise
        self.wait_seconds = time.perf_counter() - t0
        return self

    def __exit__(self, *exc):
        if self.conn is not None:
            try:
                self.conn.send(("bye",))
            except OSError:
                pass
            self.conn.close()

    def _try_connect(self) -> bool:
        try:
            authkey = read_key(self.spec.file(".key"))
        except FileNotFoundError:
            return False
        try:
            # A server still loading has the connection queued; it accepts when loaded.
            conn = self.spec.connect(authkey)
            hello = conn.recv(READY_TIMEOUT_S)
            pid = int(hello[1])
        except (OSError, EOFError, ValueError, IndexError, TypeError):
            return False
        self.conn, self.server_pid = conn, pid
        return True

    def _connect_or_start(self) -> None:
        spec = self.spec
        engine_dir(spec.engine_dir)  # 0700, this uid's, or the job stops naming it
        fd = os.open(spec.file(".lock"), os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # one starter; others wait for its server
            if self._try_connect():
                self.log(f"engine: reusing server pid {self.server_pid} ({spec.log_path})")
                return
            self._start()
        finally:
            os.close(fd)

    def _start(self) -> None:
        spec = self.spec
        keyfile = spec.file(".key")
        keyfile.unlink(missing_ok=True)
        fd = os.open(keyfile, os.O_CREAT | os.O_WRONLY | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        if spec.tls:
            from eagleflow.serve.tls import make_certificate

            make_certificate(spec.file(".cert.pem"), spec.file(".tls.pem"), f"eagleflow-{spec.key}")
        write_private(spec.file(".spec.json"), json.dumps(spec.to_json()))
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        release_idle_servers(spec.run, keep=spec.key, log=self.log)
        self.log(f"engine: starting a server, log {spec.log_path}")
        spec.file(".address").unlink(missing_ok=True)
        env = dict(os.environ)
        if spec.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = spec.devices
        if spec.tcp and os.environ.get("SLURM_JOB_ID"):
            self._submit()
            return
        with open(spec.log_path, "a") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", self.server_module, str(spec.file(".spec.json"))],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,  # outlives this job; never gets the job's signals
                cwd=os.getcwd(),
                env=env,
            )
        deadline = time.time() + READY_TIMEOUT_S
        while not self._try_connect():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the engine server exited ({proc.returncode}) while starting; "
                    f"its log {spec.log_path} ends:\n{log_tail(spec.log_path)}"
                )
            if time.time() > deadline:
                # Its own session: the engine's workers go with it.
                os.killpg(proc.pid, signal.SIGKILL)
                raise RuntimeError(f"the engine server did not start in {READY_TIMEOUT_S} s")
            time.sleep(0.5)
        self.started_here = True
        self.log(f"engine: server pid {self.server_pid} started")

    def _submit(self) -> None:
        """Start the server as a SLURM job of its own and wait for it (queue wait included)."""
        spec = self.spec
        cmd = server_job_command(spec, self.server_module)
        job = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if job.returncode:
            raise RuntimeError(
                f"could not submit the engine server: {shlex.join(cmd)}: {job.stderr}"
            )
        job_id = job.stdout.strip().split(";")[0]
        self.log(f"engine: server submitted as SLURM job {job_id}, log {spec.log_path}")
        deadline = time.time() + READY_TIMEOUT_S
        try:
            while not self._try_connect():
                if not slurm_job_alive(job_id):
                    raise RuntimeError(
                        f"the engine server's SLURM job {job_id} ended before it served; its log "
                        f"{spec.log_path} ends:\n{log_tail(spec.log_path)}"
                    )
                if time.time() > deadline:
                    raise RuntimeError(f"the engine server did not start in {READY_TIMEOUT_S} s")
                time.sleep(2.0)
        except BaseException:  # the deadline, an interrupt, any error: nobody will use it
            subprocess.run(["scancel", job_id], capture_output=True, timeout=60)
            raise
        self.started_here = True
        self.log(f"engine: server pid {self.server_pid} (SLURM job {job_id}) started")

    @property
    def engine(self) -> dict:
        """What a job records about its engine: served by a server, whether this job loaded
        the model (it started the server), and the server's pid."""
        return {"server": True, "loaded_here": self.started_here, "server_pid": self.server_pid}

    def _request(self, kind: str, request: dict, doing: str, progress=sys.stderr, timeout=None):
        """Send one request; relay the server's progress lines to `progress` until its answer.
        The server's error (its traceback) or death (EOF: the tail of its log) fails the job,
        and so does silence for `timeout` seconds when one is given."""
        try:
            self.conn.send((kind, request))
            while True:
                try:
                    msg = self.conn.recv(timeout)
                except wire.PeerSilent:
                    raise RuntimeError(
                        f"the engine server (pid {self.server_pid}) sent nothing for "
                        f"{timeout} s while {doing}: its host may be gone; its log "
                        f"{self.spec.log_path} ends:\n{log_tail(self.spec.log_path)}"
                    ) from None
                if msg[0] == "log":
                    progress.write(msg[1])
                    progress.flush()
                elif msg[0] == "done":
                    return msg[1]
                elif msg[0] == "error":
                    raise RuntimeError(f"the engine server failed while {doing}:\n{msg[1]}")
        except (EOFError, OSError) as e:
            raise RuntimeError(
                f"the engine server (pid {self.server_pid}) died while {doing} "
                f"({type(e).__name__}); its log {self.spec.log_path} ends:\n"
                f"{log_tail(self.spec.log_path)}"
            ) from None

    def prefill(self, tokens_path, hidden_path, chunk_tokens: int, progress=sys.stderr) -> dict:
        """Ask the server to prefill the shard's missing chunks; its progress lines go to
        `progress`. Returns the server's figures {tokens, chunks, seconds}."""
        request = {
            "tokens": str(Path(tokens_path).resolve()),
            "hidden": str(Path(hidden_path).resolve()),
            "chunk_tokens": chunk_tokens,
        }
        doing = "prefilling this shard"
        return self._request("prefill", request, doing, progress, timeout=PREFILL_SILENCE_S)

    def states(self, request: dict) -> dict:
        """One pack's captured states (`eagleflow.extract.stream.StreamCapture.handle`)."""
        doing = "capturing a training pack's states"
        return self._request("states", request, doing, timeout=STATES_TIMEOUT_S)

    def generate(
        self, prompts, max_new_tokens: int, keep_special_tokens: bool = False
    ) -> list[tuple[str, str, int]]:
        """One round: the server's `generate_replies` over these prompt id lists, (text,
        finish reason, generated tokens) per prompt, in order."""
        request = {
            "prompts": [[int(t) for t in p] for p in prompts],
            "max_new_tokens": max_new_tokens,
        }
        if keep_special_tokens:  # only when asked: the request of before, byte for byte
            request["keep_special_tokens"] = True
        doing = "generating this shard's replies"
        answer = self._request("generate", request, doing, timeout=GENERATE_TIMEOUT_S)
        return [tuple(r) for r in answer]  # the wire carries lists
