"""The engine server: one loaded engine serves many extract jobs (docs/engine-reuse.md).

Started by an extract job's `EngineClient` (eagleflow.extract.client), which also documents the
protocol: it loads the target with the capture hooks, then prefills the shards its clients send,
one request at a time, and exits when idle, when its Snakemake run is gone, or after a failed
request.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import traceback
from multiprocessing.connection import Listener
from pathlib import Path

from eagleflow.extract.client import LOADED, ServerSpec, alive


class _ToClient:
    """A file-like progress sink (tqdm) that sends its text to the client."""

    def __init__(self, conn):
        self.conn = conn

    def write(self, text):
        if text:
            self.conn.send(("log", text))

    def flush(self):
        pass


def serve(spec: ServerSpec) -> None:
    from eagleflow.data.shards import read_token_shard
    from eagleflow.extract.shard import (
        Timings,
        run_chunks,
        shard_file_of,
        start_capture_engine,
        stop_capture_engine,
    )
    from eagleflow.store.chunks import ShardChunks

    print(f"eagleflow engine server {spec.key}: pid {os.getpid()}, loading", flush=True)
    t0 = time.perf_counter()
    llm = start_capture_engine(spec.settings, spec.plan, Path(spec.engine_dir))
    load_s = time.perf_counter() - t0
    print(f"{LOADED} in {load_s:.1f} s", flush=True)
    authkey = bytes.fromhex(spec.file(".key").read_text())
    listener = Listener(spec.address, family="AF_UNIX", authkey=authkey)
    state = {"busy": False, "last": time.monotonic()}
    lock = threading.Lock()

    def shut_down(why: str, code: int = 0):
        print(f"eagleflow engine server: {why}; stopping", flush=True)
        try:
            stop_capture_engine(llm)
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
                req = msg[1]
                shard = read_token_shard(req["tokens"])
                chunks = ShardChunks.plan(
                    shard, spec.plan.fingerprint, Path(req["hidden"]), req["chunk_tokens"]
                )
                # The job created the file before asking; its layout is a pure function.
                shard_file, _ = shard_file_of(chunks, spec.plan, spec.settings.dtype)
                todo = chunks.todo()  # what is committed now, not when the client asked
                print(f"shard {shard.shard_id}: {len(todo)} chunks to prefill", flush=True)
                timings = Timings()
                try:
                    done = run_chunks(
                        llm, chunks, todo, spec.plan, shard_file, timings, _ToClient(conn)
                    )
                except Exception:
                    tb = traceback.format_exc()
                    print(tb, flush=True)
                    try:
                        conn.send(("error", tb))
                    finally:
                        # The engine's queue and the workers' chunk state are unknown now.
                        shut_down("a request failed", 1)
                conn.send(("done", {"tokens": done, "chunks": len(todo), **timings.seconds}))
                print(f"shard {shard.shard_id}: {done} tokens prefilled", flush=True)
        except (EOFError, OSError):
            # The client went away (its job was killed): whatever was committed stays.
            print("eagleflow engine server: a client went away", flush=True)
        finally:
            conn.close()
            with lock:
                state["busy"] = False
                state["last"] = time.monotonic()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="the server's spec file (written by the first client)")
    args = parser.parse_args()
    spec = ServerSpec.from_json(json.loads(Path(args.spec).read_text()))
    serve(spec)


# vLLM may spawn worker processes: the guard keeps them from re-running this module.
if __name__ == "__main__":
    main()
