"""Engine settings: one record for every vLLM engine eagleflow starts, built from the config
in one place (`EngineSettings.from_config`), and the process environment vLLM reads."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class EngineSettings:
    target: str
    device: str = "cpu"
    tensor_parallel_size: int = 1
    # Stages of vLLM's pipeline; each runs tensor_parallel_size workers.
    pipeline_parallel_size: int = 1
    # Nodes the engine spans (vLLM's own multi-node launch, eagleflow.engine.multinode).
    nodes: int = 1
    dtype: str = "bfloat16"
    max_model_len: int = 513
    # None: vLLM's default. Never below max_model_len (a prompt must fit one forward).
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kvcache_space_gib: int = 1
    cpu_threads_bind: str | None = None
    # False: VLLM_MLA_DISABLE=1, the DeepSeek attention as plain attention over the same
    # weights (regeneration and evaluation on CPU; see the config schema). None: the
    # evaluation's "follow the draft", resolved per engine before one starts
    # (`eagleflow.evaluate.acceptance.engine_for_draft`).
    mla: bool | None = True
    # `target.trust_remote_code`: run code shipped in the target directory (Kimi's tokenizer).
    trust_remote_code: bool = False

    @classmethod
    def from_config(cls, config: dict, job: str = "extract") -> EngineSettings:
        """The settings of a job (`extract`, `regenerate` or `evaluate`) from the workflow's
        config: the device, parallelism and memory keys of `extract` are shared by all jobs."""
        ext = config["extract"]
        base = cls(
            target=config["target"]["path"],
            device=ext["device"],
            tensor_parallel_size=ext["tensor_parallel_size"],
            pipeline_parallel_size=ext["pipeline_parallel_size"],
            nodes=ext["nodes"],
            dtype=ext["dtype"],
            max_model_len=config["data"]["max_length"] + 1,
            gpu_memory_utilization=ext["gpu_memory_utilization"],
            cpu_kvcache_space_gib=ext["cpu_kvcache_space_gib"],
            cpu_threads_bind=ext["cpu_threads_bind"],
            trust_remote_code=config["target"].get("trust_remote_code", False),
        )
        if job == "extract":
            return replace(
                base,
                max_num_batched_tokens=ext["max_num_batched_tokens"],
                max_num_seqs=ext["max_num_seqs"],
            )
        if job == "regenerate":
            regen = config["data"]["regenerate"]
            return replace(
                base,
                max_model_len=config["data"]["max_length"] + regen["max_new_tokens"],
                max_num_seqs=regen["max_num_seqs"],
                mla=regen["mla"],
            )
        if job == "evaluate":
            # One engine with target and draft; a whole prompt in one forward.
            ev = config["evaluate"]
            length = config["data"]["max_length"] + ev["max_tokens"]
            return replace(base, max_model_len=length, max_num_batched_tokens=length, mla=ev["mla"])
        raise ValueError(f"unknown job {job!r}: extract, regenerate or evaluate")

    @property
    def world_size(self) -> int:
        """Worker processes (and devices) the engine runs: TP x PP."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def single_process(self) -> bool:
        """Run the engine core and its one worker in this process (TP=1): no spawn, no second
        and third import of vLLM and torch (tens of seconds per engine start on a busy CPU),
        and no start-up handshake that can time out under load.

        Not when llvmlite (numba) is loaded here: vLLM 0.32's CPU worker start scans every
        loaded module for Triton kernels and fails on llvmlite's `_lib_fn_wrapper` objects
        ("AttributeError: '_lib_fn_wrapper' object has no attribute 'get'"); a spawned engine
        core starts from a clean interpreter."""
        return (
            self.world_size == 1 and "llvmlite" not in sys.modules and not self.multimodal_wrapper
        )

    @property
    def multimodal_wrapper(self) -> bool:
        """The target is a multimodal wrapper (Kimi-K2.5): eagleflow serves its text model
        alone (`language_model_only`). vLLM still builds the wrapper's image processor, which
        loads numba (llvmlite) into the engine's process: see `single_process`."""
        from eagleflow.target.info import WRAPPERS, TargetError, read_target

        try:
            return read_target(self.target).wrapper in WRAPPERS
        except TargetError:
            return False


def cpu_threads_bind(workers: int, configured: str | None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND: the configured value, else the cores of this process split
    evenly between the engine's workers, TP x PP of them ("0-3|4-7")."""
    if configured:
        return configured
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // workers)
    groups = [cores[i * per : (i + 1) * per] or cores[-1:] for i in range(workers)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def configure_process_env(settings: EngineSettings) -> None:
    """Environment vLLM reads at import and start; set before vLLM is imported."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if settings.single_process else "1"
    if settings.mla is None:
        raise ValueError("EngineSettings.mla is None: resolve it for the engine's draft first")
    os.environ["VLLM_MLA_DISABLE"] = "0" if settings.mla else "1"
    if settings.device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.cpu_kvcache_space_gib))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(
            settings.world_size, settings.cpu_threads_bind
        )
