"""The extract jobs' engine server (`python -m eagleflow.extract.capture_server SPEC`, started
by the first extract job's `EngineClient`; docs/engine-reuse.md): the target with the capture
hooks for the spec's plan, serving `prefill` requests with the same `run_chunks` loop as a
per-shard engine, and `states` requests (a training job's samples, streamed back without
touching disk: `eagleflow.extract.stream`). The loop around it is
`eagleflow.serve.server.serve`."""

from __future__ import annotations

from pathlib import Path

from eagleflow.data.shards import read_token_shard
from eagleflow.extract.shard import (
    Timings,
    run_chunks,
    shard_chunks,
    shard_file_of,
    start_capture_engine,
    stop_capture_engine,
)
from eagleflow.extract.stream import StreamCapture
from eagleflow.serve.client import ServerSpec
from eagleflow.serve.server import ToClient, serve, spec_from_command_line


class CaptureEngine:
    """An extract jobs' server: the target with the capture hooks for the spec's plan; serves
    `prefill` requests with the same `run_chunks` loop as a per-shard engine, and `states`
    requests of streaming training jobs."""

    requests = ("prefill", "states")

    def __init__(self, spec: ServerSpec):
        self.spec = spec
        # The stage layout the workers reported, repeated in every job's log.
        self.layout = []
        self.llm = start_capture_engine(
            spec.settings, spec.plan, Path(spec.engine_dir), log=self.layout.append
        )
        for line in self.layout:
            print(line, flush=True)
        self.stream = None

    def handle(self, kind: str, req: dict, conn) -> dict:
        spec = self.spec
        if kind == "states":
            if self.stream is None:
                self.stream = StreamCapture(
                    self.llm, spec.plan, spec.settings.dtype, req["scratch"], spec.key
                )
            return self.stream.handle(req)
        shard = read_token_shard(req["tokens"])
        # The job's own chunks: same ranges, same markers (one per capturing pipeline stage).
        chunks = shard_chunks(shard, spec.plan, Path(req["hidden"]), req["chunk_tokens"])
        # The job created the file before asking; its layout is a pure function.
        shard_file, _ = shard_file_of(chunks, spec.plan, spec.settings.dtype)
        todo = chunks.todo()  # what is committed now, not when the client asked
        print(f"shard {shard.shard_id}: {len(todo)} chunks to prefill", flush=True)
        progress = ToClient(conn)
        for line in self.layout:
            progress.write(line + "\n")
        timings = Timings()
        done = run_chunks(self.llm, chunks, todo, spec.plan, shard_file, timings, progress)
        print(f"shard {shard.shard_id}: {done} tokens prefilled", flush=True)
        return {"tokens": done, "chunks": len(todo), **timings.seconds}

    def stop(self) -> None:
        stop_capture_engine(self.llm)


# vLLM may spawn worker processes: the guard keeps them from re-running this module.
if __name__ == "__main__":
    serve(spec_from_command_line(), CaptureEngine)
