"""The capture worker's chunk writer (eagleflow.capture.worker): it runs at SCHED_IDLE, so it
takes only CPU the engine's forward leaves idle, and still writes every chunk it is handed."""

import os
import queue
import threading

import pytest

pytestmark = pytest.mark.vllm  # importing the worker extension applies vLLM's fixes


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no SCHED_IDLE on this platform")
def test_the_chunk_writer_runs_at_idle_priority_and_writes_what_it_is_handed():
    from eagleflow.capture.worker import CaptureExtension

    written, started = [], threading.Event()
    writer = CaptureExtension.__new__(CaptureExtension)  # the writer's state alone, no engine
    writer._ef_queue = queue.Queue(maxsize=2)
    writer._ef_write_error = None
    writer._ef_stats = {"chunk_write": 0.0}

    def write_chunk(spec, pieces):
        written.append(spec)
        started.set()

    writer._ef_write_chunk = write_chunk
    thread = threading.Thread(target=writer._ef_writer_loop)
    thread.start()
    writer._ef_queue.put(({"chunk": 0}, []))
    assert started.wait(10)
    assert os.sched_getscheduler(thread.native_id) == os.SCHED_IDLE
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # the engine's thread keeps its own
    for i in range(1, 5):
        writer._ef_queue.put(({"chunk": i}, []))
    writer._ef_queue.put(None)
    thread.join(10)
    assert not thread.is_alive() and written == [{"chunk": i} for i in range(5)]
    assert writer._ef_write_error is None
