"""The engine server's loop: one loaded engine serves many jobs (docs/engine-reuse.md).

Started by a job's `EngineClient` (eagleflow.serve.client), which also documents the protocol,
as `python -m <module> SPEC`, where the module is its engine kind's entry point:
`eagleflow.extract.capture_server` loads the target with the capture hooks and prefills the
shards its extract jobs send; `eagleflow.regenerate.generate_server` loads the regeneration
engine and answers the rounds its regenerate_shard jobs send. Each calls
`serve(spec_from_command_line(), TheEngine)`. Either serves one request at a time and exits
when idle, when its Snakemake run is gone, or after a failed request.
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

from eagleflow.serve.client import LOADED, ServerSpec, alive


class ToClient:
    """A file-like progress sink (tqdm) that sends its text to the client."""

    def __init__(self, conn):
        self.conn = conn

    def write(self, text):
        if text:
            self.conn.send(("log", text))

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
    authkey = bytes.fromhex(spec.file(".key").read_text())
    listener = spec.listen(authkey)
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
    spec.registry_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = spec.registry_file.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(spec.registry_entry(os.getpid())))
    os.replace(tmp, spec.registry_file)
    with lock:
        state.update(engine=engine, busy=False, last=time.monotonic())
    while True:
        try:
            conn = listener.accept()
        except OSError:  # a failed handshake (a wrong key, a client gone): keep serving
            continue
        with lock:
            state["busy"] = True
        try:
            conn.send(("hello", os.getpid(), load_s))
            while True:
                msg = conn.recv()
                if msg[0] == "bye":
                    break
                if msg[0] == "release":  # only ever the first message: no job is connected
                    conn.send(("released",))
                    shut_down("asked to free the devices for another engine of this run")
                if msg[0] not in engine.requests:
                    conn.send(("error", f"a {spec.kind} engine server serves no {msg[0]!r}"))
                    continue
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
        except (EOFError, OSError):
            # The client went away (its job was killed): whatever was committed stays.
            print("eagleflow engine server: a client went away", flush=True)
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
    return ServerSpec.from_json(json.loads(Path(args.spec).read_text()))
