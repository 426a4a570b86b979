"""A generate engine server without vLLM, for tests of the client/server plumbing
(tests/test_engine_client.py): eagleflow.serve.server's own `serve` around a fake engine
whose replies are a function of the prompt. Started the way a job starts the real one
(`python -m support.fake_engine_server SPEC`, by an `EngineClient` given this `server_module`)."""

import os
import time

from eagleflow.serve.server import serve, spec_from_command_line

FAIL = 100_001  # a prompt holding this id makes the engine raise
DIE = 100_002  # ... makes the server process die in the middle of the request
HANG = 100_003  # ... makes the engine hang, alive and silent (a lost host looks the same)


def reply(prompt, max_new_tokens: int) -> tuple[str, str, int]:
    """(text, finish reason, generated tokens), as eagleflow.regenerate.replies.generate_replies."""
    n = min(max_new_tokens, len(prompt) % 7 + 1)
    return (f"reply to {len(prompt)} tokens", "length" if n == max_new_tokens else "stop", n)


class FakeEngine:
    requests = ("generate",)

    def handle(self, kind: str, req: dict, conn) -> list:
        for p in req["prompts"]:
            if FAIL in p:
                raise RuntimeError("the fake engine failed")
            if DIE in p:
                os._exit(3)
            if HANG in p:
                time.sleep(10**6)
        print(f"generate: {len(req['prompts'])} prompts answered", flush=True)
        return [reply(p, req["max_new_tokens"]) for p in req["prompts"]]

    def stop(self) -> None:
        print("fake engine stopped", flush=True)


if __name__ == "__main__":
    serve(spec_from_command_line(), lambda spec: FakeEngine())
