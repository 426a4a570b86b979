"""vLLM `worker_extension_cls` for engines that need no other extension (regeneration,
evaluation): vLLM imports this module in every worker process before it builds the model, so
eagleflow's vLLM fixes (`apply_vllm_fixes`) also reach the processes vLLM spawns itself (TP > 1
on the CPU, a spawned engine core), which do not inherit a patch made in the caller.
Extraction gets the same from its capture extension
(`eagleflow.capture.worker.CaptureExtension`)."""

from eagleflow.engine.vllm_fixes import apply_vllm_fixes

apply_vllm_fixes()


class FixedWorker:
    """Adds nothing to the worker; importing this module is the point."""
