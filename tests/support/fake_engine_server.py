"""A generate engine server without vLLM, for tests of the client/server plumbing
(tests/test_engine_client.py): eagleflow.extract.server's own `serve` around a fake
engine whose replies are a function of the prompt. Started the way a job starts the real one
(`python -m support.fake_engine_server SPEC`, by `EngineClient` with this `server_module`)."""

import json
import os
import sys
from pathlib import Path

from eagleflow.extract.client import ServerSpec
from eagleflow.extract.server import serve

FAIL = 100_001  # a prompt holding this id makes the engine raise
DIE = 100_002  # ... makes the server process die in the middle of the request


def reply(prompt, max_new_tokens: int) -> tuple[str, str, int]:
    """(text, finish reason, generated tokens), as eagleflow.data.regenerate.generate_replies."""
    n = min(max_new_tokens, len(prompt) % 7 + 1)
    return (f"reply to {len(prompt)} tokens", "length" if n == max_new_tokens else "stop", n)


class FakeEngine:
    request = "generate"

    def handle(self, req: dict, conn) -> list:
        for p in req["prompts"]:
            if FAIL in p:
                raise RuntimeError("the fake engine failed")
            if DIE in p:
                os._exit(3)
        print(f"generate: {len(req['prompts'])} prompts answered", flush=True)
        return [reply(p, req["max_new_tokens"]) for p in req["prompts"]]

    def stop(self) -> None:
        print("fake engine stopped", flush=True)


if __name__ == "__main__":
    spec = ServerSpec.from_json(json.loads(Path(sys.argv[1]).read_text()))
    serve(spec, build=lambda spec: FakeEngine())
