"""The engine builder on spawned workers: vLLM's CPU fixes reach them (a Llama target's
attention uses AMX where the CPU has it), and a call to the workers pending when the engine
dies fails at once instead of waiting forever (vllm-project/vllm#56416)."""

import os
import threading
import time
from pathlib import Path

import pytest

from eagleflow.embedded.bundled_data import generate_conversations
from eagleflow.engine.builder import build_engine, stop_engine
from eagleflow.engine.settings import EngineSettings
from support.dense_targets import build_tiny_llama_target

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[1]


def test_spawned_workers_run_a_llama_target_and_a_dead_engine_fails_the_pending_call(
    tmp_path, monkeypatch
):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.exceptions import EngineDeadError

    # The workers import the tests' extension by module path.
    paths = [str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    rows = generate_conversations(300, seed=5)
    target = build_tiny_llama_target(
        [m["content"] for r in rows for m in r["messages"]], tmp_path / "llama"
    )
    # TP=2: two spawned workers, as on any multi-worker engine; neither has run a model before.
    settings = EngineSettings(target=str(target), tensor_parallel_size=2, max_model_len=256)
    llm = build_engine(settings, worker_extension="support.dying_worker.DyingWorker")
    try:
        # A Llama target's first forward in a fresh worker (SIGILL there on an AMX CPU
        # without eagleflow's fix).
        out = llm.generate(
            [TokensPrompt(prompt_token_ids=list(range(5, 200)))],
            SamplingParams(max_tokens=4, temperature=0.0),
            use_tqdm=False,
        )
        assert len(out[0].outputs[0].token_ids) == 4

        # The hang of vllm-project/vllm#56416: a worker dies in a forward while a call to the
        # workers waits behind that step in the engine core's queue.
        llm.collective_rpc("slow_down", args=(4.0,))
        llm.collective_rpc("die_in", args=(2.0,))
        llm.llm_engine.add_request(
            "dies-mid-forward",
            TokensPrompt(prompt_token_ids=list(range(5, 50))),
            SamplingParams(max_tokens=1),
        )
        time.sleep(0.5)  # the engine core is in the step now
        outcome = {}

        def pending_call():
            try:
                outcome["result"] = llm.collective_rpc("ping")
            except BaseException as e:  # noqa: BLE001 - the outcome is the test
                outcome["result"] = e

        caller = threading.Thread(target=pending_call, daemon=True)
        caller.start()
        caller.join(timeout=120)
        assert not caller.is_alive(), "the call to dead workers still waits after 120 s"
        assert isinstance(outcome["result"], EngineDeadError), outcome["result"]
    finally:
        try:
            stop_engine(llm)
        except Exception:  # noqa: BLE001 - the engine is dead already
            pass
