"""A capture engine server without vLLM, for tests of streamed states (tests/test_stream.py):
eagleflow.serve.server's own `serve` around eagleflow.extract.stream's own `StreamCapture`,
whose `capture` (the engine's part) is replaced by `fake_states`, a function of each token and
its position in its sample. Everything else is the real server's: the pack shard, the answer
on the wire, the state cache and its budget. Started the way a training job starts the real
one (`python -m support.fake_capture_server SPEC`, by an `EngineClient` given this module).

`EAGLEFLOW_FAKE_DIE_FILE=PATH` in the starting process's environment: while PATH exists and
holds N, the server dies (os._exit) on its N+1-th request, as a killed engine would."""

import os

import numpy as np
import torch

from eagleflow.extract.stream import StreamCapture
from eagleflow.serve.server import serve, spec_from_command_line
from eagleflow.store.quant import is_fp8, quantize


def fake_states(input_ids, offsets, n_layers: int, hidden: int, dtype, storage_dtype: str):
    """[tokens, n_layers, hidden] states of each token and its position in its sample (as
    stored: fp8 codes and scales, or `dtype`), never zero."""
    ids = torch.as_tensor(np.asarray(input_ids)).long()
    positions = torch.cat([torch.arange(b - a) for a, b in zip(offsets[:-1], offsets[1:])])
    grid = torch.arange(n_layers * hidden, dtype=torch.float32).reshape(n_layers, hidden)
    x = torch.sin(ids[:, None, None] * 0.37 + positions[:, None, None] * 0.11 + grid * 0.05)
    x = (x + 1.5).to(getattr(torch, dtype))
    if is_fp8(storage_dtype):
        return quantize(x)
    return x, None


class FakeStreamCapture(StreamCapture):
    def capture(self, pack):
        plan = self.plan
        states, scales = fake_states(
            pack.input_ids,
            pack.offsets,
            len(plan.layer_ids),
            plan.hidden_size,
            self.dtype,
            plan.storage_dtype,
        )
        return states, scales, torch.from_numpy(pack.input_ids.astype(np.int64))


class FakeCaptureEngine:
    requests = ("states",)

    def __init__(self, spec):
        self.spec, self.stream = spec, None
        self.die_file = os.environ.get("EAGLEFLOW_FAKE_DIE_FILE")
        self.served = 0

    def handle(self, kind: str, req: dict, conn) -> dict:
        if self.die_file and os.path.exists(self.die_file):
            with open(self.die_file) as f:
                if self.served == int(f.read()):
                    os._exit(3)
        self.served += 1
        if self.stream is None:
            spec = self.spec
            self.stream = FakeStreamCapture(
                None, spec.plan, spec.settings.dtype, req["scratch"], spec.key
            )
        return self.stream.handle(req)

    def stop(self) -> None:
        print("fake capture engine stopped", flush=True)


if __name__ == "__main__":
    serve(spec_from_command_line(), FakeCaptureEngine)
