"""The regenerate_shard jobs' engine server (`python -m eagleflow.regenerate.generate_server
SPEC`, started by the first job's `EngineClient`; docs/engine-reuse.md#regeneration): the
regeneration engine (no capture hooks), serving `generate` requests, one round of a job's
chunk each. The loop around it is `eagleflow.serve.server.serve`."""

from __future__ import annotations

import time

from eagleflow.engine.builder import stop_engine
from eagleflow.regenerate.replies import generate_replies, start_generate_engine
from eagleflow.serve.client import ServerSpec
from eagleflow.serve.server import serve, spec_from_command_line


class GenerateEngine:
    """The regenerate_shard jobs' server: answers each round with the same `generate_replies`
    call as a job's own engine (eagleflow.regenerate.replies)."""

    requests = ("generate",)

    def __init__(self, spec: ServerSpec):
        self.llm = start_generate_engine(spec.settings)

    def handle(self, kind: str, req: dict, conn) -> list:
        t0 = time.perf_counter()
        replies = generate_replies(
            self.llm, req["prompts"], req["max_new_tokens"], req.get("keep_special_tokens", False)
        )
        print(
            f"generate: {len(replies)} prompts answered, {sum(r[2] for r in replies)} tokens "
            f"in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        return replies

    def stop(self) -> None:
        stop_engine(self.llm)


# vLLM may spawn worker processes: the guard keeps them from re-running this module.
if __name__ == "__main__":
    serve(spec_from_command_line(), GenerateEngine)
