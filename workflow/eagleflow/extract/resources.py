"""What each job asks a cluster scheduler for (SLURM through snakemake-executor-plugin-slurm):
GPUs, CPUs, memory and a runtime estimated from the shard's token count and the measured
throughput of shards already extracted (extract.rates). Pure functions of the config and small
files."""

from __future__ import annotations

import math
from pathlib import Path

from eagleflow.extract.rates import Measured
from eagleflow.store.headers import read_header

# Defaults when the config leaves them null (see workflow/schemas/config.schema.yaml).
CPUS_PER_GPU = 8
MEM_MB_PER_GPU = 64000
# Host RAM beyond weights and KV cache for a CPU engine (as validate_env.CPU_OVERHEAD_BYTES).
CPU_OVERHEAD_MB = 2048
# Runtime estimate: margin on load + prefill, plus start-up (Snakemake, imports, finishing).
RUNTIME_MARGIN = 1.5
STARTUP_MINUTES = 2


def _workers(ext: dict) -> int:
    """Engine workers, one device each: TP x PP."""
    return int(ext["tensor_parallel_size"]) * int(ext.get("pipeline_parallel_size", 1))


def extract_nodes(ext: dict) -> int:
    """Nodes per extract job (`extract.nodes`; the engine spans them)."""
    return int(ext.get("nodes", 1))


def extract_gpus(ext: dict) -> int:
    """GPUs per extract job on each of its nodes: `gpus_per_job`, else TP x PP / nodes on cuda
    and none on cpu."""
    if ext.get("gpus_per_job") is not None:
        return int(ext["gpus_per_job"])
    return _workers(ext) // extract_nodes(ext) if ext["device"] == "cuda" else 0


def extract_gpu_resource(ext: dict) -> int:
    """The `gpu` resource (`--gpus`, GPUs of the whole job): one-node jobs only."""
    return extract_gpus(ext) if extract_nodes(ext) == 1 else 0


def extract_gres(ext: dict) -> str:
    """The `gres` resource (`--gres=gpu:N`, N per node) of a multi-node job; SLURM's default of
    one task per node then starts one task on each."""
    gpus = extract_gpus(ext)
    return f"gpu:{gpus}" if extract_nodes(ext) > 1 and gpus else ""


def extract_cpus(ext: dict) -> int:
    """CPUs per node of an extract job."""
    if ext.get("cpus_per_job") is not None:
        return int(ext["cpus_per_job"])
    gpus = extract_gpus(ext)
    return CPUS_PER_GPU * gpus if gpus else _workers(ext) // extract_nodes(ext)


def extract_mem_mb(ext: dict, weight_bytes: int) -> int:
    """Host memory per node of an extract job (SLURM's --mem is per node)."""
    if ext.get("mem_mb_per_job") is not None:
        return int(ext["mem_mb_per_job"])
    if ext["device"] == "cuda":
        return MEM_MB_PER_GPU * max(1, extract_gpus(ext))
    nodes = extract_nodes(ext)
    kv_mb = _workers(ext) // nodes * int(ext["cpu_kvcache_space_gib"]) * 1024
    return math.ceil(weight_bytes / nodes / 2**20) + kv_mb + CPU_OVERHEAD_MB


def shard_tokens(tokens_path: str | Path) -> int:
    """Token count of a tokenized shard, from its safetensors header alone; for an unreadable
    header, an estimate from the file size (int64 ids + uint8 mask: 9 bytes a token), so that a
    damaged shard fails in its job, with its log, rather than while Snakemake plans."""
    try:
        header, _ = read_header(tokens_path)
        return int(header["input_ids"]["shape"][0])
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        try:
            return Path(tokens_path).stat().st_size // 9
        except OSError:
            return 0


def verify_minutes(
    n_tokens: int, n_layers: int, hidden_size: int, read_mb_per_second: float = 200
) -> float:
    """Verification streams the written shard once: its size over a conservative read rate.
    An fp8 shard (`capture.storage_dtype`) is costed as bf16: it has half the bytes, but its
    dequantization works per value, so the bf16 figure is the safe time limit."""
    return n_tokens * n_layers * hidden_size * 2 / 2**20 / read_mb_per_second / 60


def extract_runtime_minutes(
    n_tokens: int,
    tokens_per_second: float,
    load_minutes: float,
    verify_minutes: float = 0.0,
    attempt: int = 1,
) -> int:
    """SLURM time limit of a job that loads the target: 1.5 x (load + tokens + verification) +
    start-up, times attempt."""
    est = (
        RUNTIME_MARGIN * (load_minutes + n_tokens / tokens_per_second / 60 + verify_minutes)
        + STARTUP_MINUTES
    )
    return math.ceil(est) * max(1, attempt)


def jobs_per_engine(ext: dict) -> int:
    """Jobs that share one model load in a SLURM allocation: `extract.shards_per_allocation`
    with engine reuse (docs/engine-reuse.md#on-slurm), else 1."""
    n = int(ext.get("shards_per_allocation", 1))
    return n if ext.get("engine_reuse") and n > 1 else 1


def job_runtime_minutes(
    ext: dict,
    n_tokens: int,
    measured: Measured,
    tokens_per_second: float,
    verify_minutes: float = 0.0,
    attempt: int = 1,
) -> int:
    """SLURM time limit of a job that loads the target (an extract or a regenerate job) and
    processes `n_tokens`: at the measured rate, else `tokens_per_second` (the config's
    assumption), with the measured model load, else `extract.model_load_minutes`. In a group
    of N jobs sharing one engine server (`jobs_per_engine`) each carries 1/N of the load, so
    the allocation's limit, the sum over its jobs, holds one load."""
    load = measured.load_seconds / 60 if measured.load_seconds else ext["model_load_minutes"]
    return extract_runtime_minutes(
        n_tokens,
        measured.tokens_per_second or tokens_per_second,
        load / jobs_per_engine(ext),
        verify_minutes,
        attempt,
    )
