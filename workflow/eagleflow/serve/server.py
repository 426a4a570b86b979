"""The engine server's loop: one loaded engine serves many jobs (docs/engine-reuse.md).

Started by a job's `EngineClient` (eagleflow.serve.client), which also documents the protocol,
as `python -m <module> SPEC`, where the module is its engine kind's entry point:
`eagleflow.extract.capture_server` loads the target with the capture hooks and prefills the
shards its extract jobs send; `eagleflow.regenerate.generate_server` loads the regeneration
engine and answers the rounds its regenerate_shard jobs send. Each calls
`serve(spec_from_command_line(), TheEngine)`. Either serves one request at a time and exits
when idle, when its Snakemake run is gone, or after a failed request.

A client is served only once it has proven the key (`eagleflow.serve.wire.accept`); one that
fails or stalls in the handshake, sends something that is not a message, goes silent for
`client_silence_seconds` or vanishes is dropped, and the next one is served. Only an
authenticated client counts as activity for the idle watchdog.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
import traceback
from pathlib import Path

from eagleflow.serve import wire
from eagleflow.serve.client import LOADED, ServerSpec, alive, read_key, registry_dir
from eagleflow.store.private import read_private, write_private


class ToClient:
    """A file-like progress sink (tqdm) that sends its text to the client. A client gone in
    the middle of a request does not fail it: the request runs to its end (its chunks are
    committed, the engine stays in a known state), and its answer finds nobody."""

    def __init__(self, conn):
        self.conn, self.gone = conn, False

    def write(self, text):
        if text and not self.gone:
            try:
                self.conn.send(("log", text))
            except OSError:
                self.gone = True

    def flush(self):
        pass


def serve(spec: ServerSpec, build) -> None:
    """Load the engine and serve it to one client at a time until idle, the Snakemake run is
    gone, or a request fails; never returns. The engine comes from `build(spec)`: its
    `requests` (the request kinds it serves), `handle(kind, request, conn) -> answer`
    (progress lines may go to `ToClient(conn)`) and `stop()`.

    The address is bound and the watchdog runs before the load: a second server for the same
    key cannot start while this one loads (a client that connects meanwhile waits for the
    hello), and a server whose Snakemake run dies during the load stops at once instead of
    finishing a load nobody will use."""
    print(
        f"eagleflow engine server {spec.key}: pid {os.getpid()}, {spec.kind} engine, loading",
        flush=True,
    )
    authkey = read_key(spec.file(".key"))
    tls = spec.tls_context(server=True)
    listener = spec.listen()
    state = {"busy": True, "last": time.monotonic(), "engine": None}  # busy: loading
    lock = threading.Lock()

    def shut_down(why: str, code: int = 0):
        print(f"eagleflow engine server: {why}; stopping", flush=True)
        try:
            spec.registry_file.unlink(missing_ok=True)
            if spec.tcp:
                spec.file(".address").unlink(missing_ok=True)
            if state["engine"] is not None:
                state["engine"].stop()
            else:  # mid-load: the engine's processes are this server's session; end them all
                os.killpg(os.getpgrp(), signal.SIGKILL)
        finally:
            os._exit(code)

    def watchdog():
        while True:
            time.sleep(1.0)
            with lock:
                if spec.watch_pid and not alive(spec.watch_pid):
                    shut_down(f"the Snakemake run (pid {spec.watch_pid}) is gone")
                idle = time.monotonic() - state["last"]
                if not state["busy"] and idle > spec.idle_seconds:
                    shut_down(f"idle for {idle:.0f} s")

    threading.Thread(target=watchdog, daemon=True).start()
    t0 = time.perf_counter()
    engine = build(spec)
    load_s = time.perf_counter() - t0
    print(f"{LOADED} in {load_s:.1f} s", flush=True)
    # Who this server is, for a job of the same run about to load another engine
    # (eagleflow.serve.client.release_idle_servers).
    registry_dir()  # a private folder, or the server stops naming it
    write_private(spec.registry_file, json.dumps(spec.registry_entry(os.getpid())))
    with lock:
        state.update(engine=engine, busy=False, last=time.monotonic())
    while True:
        try:
            conn = wire.accept(listener, authkey, spec.handshake_seconds, tls)
        except Exception as e:  # a wrong key, a silent or vanished client: serve the next
            print(f"eagleflow engine server: a client was refused ({type(e).__name__})", flush=True)
            continue
        with lock:
            state["busy"] = True
        try:
            conn.send(("hello", os.getpid(), load_s))
            while True:
                msg = conn.recv(spec.client_silence_seconds)
                if not (isinstance(msg, list) and msg and isinstance(msg[0], str)):
                    raise wire.WireError("a message that is not [kind, ...]")
                if msg[0] == "bye":
                    break
                if msg[0] == "release":  # only ever the first message: no job is connected
                    conn.send(("released",))
                    shut_down("asked to free the devices for another engine of this run")
                if msg[0] not in engine.requests:
                    conn.send(("error", f"a {spec.kind} engine server serves no {msg[0]!r}"))
                    continue
                if len(msg) != 2 or not isinstance(msg[1], dict):
                    raise wire.WireError(f"a {msg[0]!r} request that is not [kind, dict]")
                try:
                    answer = engine.handle(msg[0], msg[1], conn)
                except Exception:
                    tb = traceback.format_exc()
                    print(tb, flush=True)
                    try:
                        conn.send(("error", tb))
                    finally:
                        # The engine's queue (and the capture workers' chunk state) are unknown.
                        shut_down("a request failed", 1)
                conn.send(("done", answer))
        except (EOFError, OSError) as e:
            # The client went away (its job was killed), stalled, or broke the protocol (a
            # WireError): whatever was committed stays.
            print(f"eagleflow engine server: a client went away ({e})", flush=True)
        finally:
            conn.close()
            with lock:
                state["busy"] = False
                state["last"] = time.monotonic()


def spec_from_command_line() -> ServerSpec:
    """The spec of `python -m <an engine kind's server module> SPEC`, a file the first client
    wrote."""
    parser = argparse.ArgumentParser(description="an eagleflow engine server")
    parser.add_argument("spec", help="the server's spec file (written by the first client)")
    args = parser.parse_args()
    return ServerSpec.from_json(json.loads(read_private(Path(args.spec))))
