"""The one way eagleflow starts and stops a vLLM engine (extraction, regeneration, evaluation).

Every engine gets the CPU rope fix (`vllm_fixes`) in this process and, through its worker
extension, in every process vLLM spawns; the caller chooses the extension (the capture hooks
for extraction, `fixed_worker` otherwise) and any strategy-specific `LLM(...)` arguments.
"""

from __future__ import annotations

import threading
import weakref

from eagleflow.engine.settings import EngineSettings, configure_process_env
from eagleflow.engine.vllm_fixes import apply_vllm_fixes

FIXED_WORKER = "eagleflow.engine.fixed_worker.FixedWorker"


def check_platform(device: str) -> None:
    from vllm.platforms import current_platform

    found = current_platform.device_type
    if found != device:
        raise RuntimeError(
            f"extract.device is {device!r} but the installed vLLM runs on {found!r}; install "
            f"the vLLM build for {device} (envs/) or set extract.device: {found}"
        )


def build_engine(
    settings: EngineSettings,
    worker_extension: str = FIXED_WORKER,
    eager: bool = True,
    **llm_kwargs,
):
    """A started `vllm.LLM` for `settings`. `eager`: no CUDA graphs (the capture wrapper must
    stay on the path; on CPU vLLM runs eager anyway). `llm_kwargs` go to `LLM(...)` last
    (speculative or connector settings, `disable_log_stats`, ...)."""
    configure_process_env(settings)
    from vllm import LLM

    check_platform(settings.device)
    apply_vllm_fixes()  # before the model is built (a single-process engine builds it here)
    kwargs = dict(
        model=settings.target,
        tokenizer=settings.target,
        tensor_parallel_size=settings.tensor_parallel_size,
        pipeline_parallel_size=settings.pipeline_parallel_size,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        enforce_eager=eager,
        worker_extension_cls=worker_extension,
        seed=0,
        trust_remote_code=settings.trust_remote_code,
    )
    if settings.multimodal_wrapper:
        # Text only: vLLM builds neither the vision tower nor the projector, and expects
        # none of their weights (field notes, section 15).
        kwargs["language_model_only"] = True
    if settings.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = max(
            settings.max_num_batched_tokens, settings.max_model_len
        )
    if settings.single_process:
        kwargs["distributed_executor_backend"] = "uni"
    elif settings.pipeline_parallel_size > 1:
        # vLLM's own multiprocessing executor runs the stages (supports_pp).
        kwargs["distributed_executor_backend"] = "mp"
    if settings.max_num_seqs:
        kwargs["max_num_seqs"] = settings.max_num_seqs
    if settings.device == "cuda":
        kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
    kwargs.update(llm_kwargs)
    if settings.nodes == 1:
        return fail_pending_calls_when_engine_dies(LLM(**kwargs))
    # Several nodes: the others run headless vLLM workers, started first (node 0 waits for
    # them) and stopped with the engine (eagleflow.engine.multinode).
    from eagleflow.engine.multinode import NodeGroup

    nodes = NodeGroup.for_engine(settings.nodes)
    kwargs.update(nodes.head_kwargs())
    nodes.start(kwargs, settings.world_size)
    try:
        llm = LLM(**kwargs)
    except BaseException:
        nodes.stop()
        raise
    llm.eagleflow_nodes = nodes
    return fail_pending_calls_when_engine_dies(llm)


def fail_pending_calls_when_engine_dies(llm, poll_seconds: float = 1.0):
    """Fail every call to the workers (`collective_rpc`) still pending when the engine core
    dies, with vLLM's EngineDeadError; returns `llm`.

    vLLM 0.32's multiprocess client never answers such a call (vllm-project/vllm#56416): its
    monitor marks the engine dead, but the call's future is never completed, so a job whose
    engine crashed would wait until its time limit. An engine core in this process has no such
    client (a crash there raises here)."""
    client = llm.llm_engine.engine_core
    if not hasattr(client, "utility_results") or not hasattr(client, "resources"):
        return llm
    from vllm.v1.engine.exceptions import EngineDeadError

    stopped = threading.Event()
    # A weak reference: the watcher must not keep a stopped engine's client alive.
    ref = weakref.ref(client)

    def watch():
        while not stopped.wait(poll_seconds):
            c = ref()
            if c is None:
                return
            if c.resources.engine_dead:  # set by vLLM's monitor (and by a normal shutdown)
                for future in list(c.utility_results.values()):
                    if not future.done():
                        future.set_exception(EngineDeadError())
                return
            del c

    threading.Thread(target=watch, name="eagleflow-engine-watch", daemon=True).start()
    weakref.finalize(client, stopped.set)
    return llm


def stop_engine(llm) -> None:
    """Shut the engine down now, so its processes' last words land before the job's summary
    line and their memory is free, then the other nodes' workers, if any. LLM has no public
    shutdown in vLLM 0.32; the engine-core client's is what its __del__ uses."""
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        nodes = getattr(llm, "eagleflow_nodes", None)
        if nodes is not None:
            nodes.stop()
