"""Test-only: vLLM 0.32's ExampleHiddenStatesConnector with its two CUDA-only calls made
CPU-safe, so the extract_hidden_states strategy can run end to end on a CPU machine.

On CPU, vLLM's own connector fails in `_submit_async_write` (`pin_memory=True requires a CUDA
or other accelerator backend`) and, past that, in `get_finished` (the copy event is vLLM's CPU
placeholder for torch.cuda.Event, which has no `query`). Here the host buffer is unpinned and the
(synchronous) copy's event always reports done. Everything else is vLLM's: the proposer, the
cache-only KV layer, the slots read back from the request's blocks, the file and its lock.
eagleflow's capture plan still refuses the strategy on CPU: this class is not shipped.
"""

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
)


class _CopyDone:
    def synchronize(self):
        pass

    def query(self):
        return True


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending):
        real = torch.empty_like

        def unpinned(t, *args, pin_memory=False, **kwargs):
            return real(t, *args, **kwargs)

        torch.empty_like = unpinned
        try:
            super()._submit_async_write(pending)
        finally:
            torch.empty_like = real
        if pending.req_id in self._req_copy_events:
            self._req_copy_events[pending.req_id] = _CopyDone()
