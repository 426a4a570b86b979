"""Extraction of one shard: prefill through vLLM, capture, chunked commits, one atomic file.

Work inside a shard is committed in chunks (`.partial/<shard>/chunk-NNNNN.safetensors`,
each written to a temporary name and renamed), so a killed job resumes after its last
committed chunk, and a job whose chunks are all committed never starts the engine. The
shard file is assembled from the chunks by streaming, hashed while written, and renamed
into place last; its sidecar JSON records sha256, size and throughput.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from eagleflow.capture.connector import run_connector_chunks, strategy_engine_kwargs
from eagleflow.data.shards import read_token_shard
from eagleflow.engine.vllm_fixes import fix_cpu_rope
from eagleflow.store.headers import read_header
from eagleflow.store.stream import StreamingWriter
from eagleflow.store.verify import verify_extracted_shard
from eagleflow.target.layers import CONVENTION

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
WORKER_EXTENSION = "eagleflow.capture.worker.CaptureExtension"


@dataclass
class EngineSettings:
    target: str
    device: str = "cpu"
    tensor_parallel_size: int = 1
    dtype: str = "bfloat16"
    max_model_len: int = 513
    max_num_batched_tokens: int = 8192
    max_num_seqs: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kvcache_space_gib: int = 1
    cpu_threads_bind: str | None = None


@dataclass
class Timings:
    seconds: dict = field(
        default_factory=lambda: {
            "engine_start": 0.0,
            "prefill_and_capture": 0.0,
            "commit_wait": 0.0,
            "assemble": 0.0,
        }
    )

    @contextmanager
    def phase(self, name):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0


def chunk_ranges(offsets: np.ndarray, chunk_tokens: int) -> list[tuple[int, int]]:
    """Consecutive sample ranges of about `chunk_tokens` tokens (at least one sample each);
    a pure function of the shard, so a resumed job finds the same chunks."""
    ranges, start = [], 0
    n = len(offsets) - 1
    while start < n:
        end = start + 1
        while end < n and offsets[end + 1] - offsets[start] <= chunk_tokens:
            end += 1
        ranges.append((start, end))
        start = end
    return ranges


def cpu_threads_bind(tp: int, configured: str | None) -> str:
    if configured:
        return configured
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // tp)
    groups = [cores[i * per : (i + 1) * per] or cores[-1:] for i in range(tp)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def single_process(settings: EngineSettings) -> bool:
    """Run the engine core and its one worker in this process (TP=1): no spawn, no second and
    third import of vLLM and torch (tens of seconds per engine start on a busy CPU), and no
    start-up handshake that can time out under load.

    Not when llvmlite (numba) is loaded here: vLLM 0.32's CPU worker start scans every loaded
    module for Triton kernels and fails on llvmlite's `_lib_fn_wrapper` objects
    ("AttributeError: '_lib_fn_wrapper' object has no attribute 'get'"); a spawned engine core
    starts from a clean interpreter."""
    return settings.tensor_parallel_size == 1 and "llvmlite" not in sys.modules


def configure_process_env(settings: EngineSettings) -> None:
    """Environment vLLM reads at import/start; set before vLLM is imported."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if single_process(settings) else "1"
    if settings.device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.cpu_kvcache_space_gib))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(
            settings.tensor_parallel_size, settings.cpu_threads_bind
        )


def check_platform(device: str) -> None:
    from vllm.platforms import current_platform

    found = current_platform.device_type
    if found != device:
        raise RuntimeError(
            f"extract.device is {device!r} but the installed vLLM runs on {found!r}; install the "
            f"vLLM build for {device} (envs/) or set extract.device: {found}"
        )


def start_engine(settings: EngineSettings, strategy_kwargs: dict | None = None):
    configure_process_env(settings)
    from vllm import LLM

    check_platform(settings.device)
    fix_cpu_rope()  # before the model is built (TP=1 builds it in this process)
    kwargs = dict(
        model=settings.target,
        tokenizer=settings.target,
        tensor_parallel_size=settings.tensor_parallel_size,
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        max_num_batched_tokens=max(settings.max_num_batched_tokens, settings.max_model_len),
        # Every prompt token must run through the model: cached prefixes would skip rows.
        enable_prefix_caching=False,
        # Eager mode keeps the capture wrapper on the path (no CUDA graph replay around it).
        enforce_eager=True,
        worker_extension_cls=WORKER_EXTENSION,
        seed=0,
    )
    if single_process(settings):
        kwargs["distributed_executor_backend"] = "uni"
    if settings.max_num_seqs:
        kwargs["max_num_seqs"] = settings.max_num_seqs
    if settings.device == "cuda":
        kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
    # The extract_hidden_states strategy's speculative and connector settings.
    kwargs.update(strategy_kwargs or {})
    return LLM(**kwargs)


def stop_engine(llm) -> None:
    """Shut the engine down now, so its processes' last words land before the job's summary
    line (and their memory is free for assembling the shard)."""
    try:
        llm.collective_rpc("eagleflow_uninstall")
    finally:
        # LLM has no public shutdown in vLLM 0.32; the engine-core client's is what __del__ uses.
        llm.llm_engine.engine_core.shutdown()


def chunk_path(partial_dir: Path, i: int) -> Path:
    return partial_dir / f"chunk-{i:05d}.safetensors"


def committed_chunk_ok(
    path: Path, fingerprint: str, shard_id: str, rng: tuple[int, int], n_tokens: int
) -> bool:
    """Cheap check of a committed chunk: header readable, size complete, identity matches."""
    try:
        header, data_start = read_header(path)
        meta = header.get("__metadata__", {})
        end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
        return (
            path.stat().st_size == data_start + end
            and json.loads(meta.get("fingerprint", "null")) == fingerprint
            and json.loads(meta.get("shard_id", "null")) == shard_id
            and json.loads(meta.get("samples", "null")) == list(rng)
            and header["input_ids"]["shape"] == [n_tokens]
        )
    except (OSError, ValueError, KeyError):
        return False


@contextmanager
def shard_lock(partial_dir: Path, shard_id: str):
    """One writer per shard across processes, even from separate Snakemake invocations that
    share the results directory (Snakemake's own lock covers one working directory)."""
    partial_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(partial_dir / "lock", os.O_CREAT | os.O_RDWR)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(
                f"shard {shard_id} is being extracted by another process (lock {partial_dir}/lock); "
                "wait for it, or stop the other run"
            ) from None
        yield
    finally:
        os.close(fd)


def extract_shard(
    tokens_path: str,
    plan: dict,
    fingerprint: str,
    out_path: str,
    record_path: str,
    report_path: str,
    settings: EngineSettings,
    chunk_tokens: int,
    log=print,
) -> dict:
    """Extract one shard; write the shard file, then its record (both atomically), verify it and
    write the report, and only then drop the committed chunks, so a kill at any point loses at
    most the chunk in flight (a kill during verification re-assembles without loading the
    model). A shard that fails verification goes to quarantine with its chunks (ShardInvalid)."""
    shard = read_token_shard(tokens_path)
    out_path = Path(out_path)
    partial_dir = out_path.parent / ".partial" / shard.shard_id
    ranges = chunk_ranges(shard.offsets, chunk_tokens)
    timings = Timings()
    t_start = time.perf_counter()
    with shard_lock(partial_dir, shard.shard_id):
        todo = []
        for i, (a, b) in enumerate(ranges):
            n_tok = int(shard.offsets[b] - shard.offsets[a])
            if not committed_chunk_ok(
                chunk_path(partial_dir, i), fingerprint, shard.shard_id, (a, b), n_tok
            ):
                todo.append(i)
        log(
            f"shard {shard.shard_id}: {len(shard.sample_ids)} samples, {len(shard.input_ids)} tokens, "
            f"{len(ranges)} chunks, {len(ranges) - len(todo)} already committed"
        )
        tokens_done = 0
        model_loaded = bool(todo)
        if todo:
            with timings.phase("engine_start"):
                llm = start_engine(
                    settings, strategy_engine_kwargs(plan, partial_dir / "connector")
                )
                llm.collective_rpc("eagleflow_install", args=(plan,))
            try:
                tokens_done = _run_chunks(
                    llm, shard, ranges, todo, partial_dir, plan, fingerprint, timings, log
                )
            finally:
                stop_engine(llm)
        with timings.phase("assemble"):
            sha, size = assemble_shard(shard, ranges, partial_dir, plan, fingerprint, out_path)
    elapsed = time.perf_counter() - t_start
    prefill = timings.seconds["prefill_and_capture"] + timings.seconds["commit_wait"]
    record = {
        "shard_id": shard.shard_id,
        "fingerprint": fingerprint,
        "path": out_path.name,
        "sha256": sha,
        "bytes": size,
        "n_samples": len(shard.sample_ids),
        "n_tokens": int(len(shard.input_ids)),
        "layer_ids": plan["layer_ids"],
        "layer_id_convention": CONVENTION,
        "strategy": plan["strategy"],
        "model_loaded": model_loaded,
        "tokens_extracted_now": tokens_done,
        "tokens_per_second": round(tokens_done / prefill, 1) if prefill > 0 else None,
        "seconds": {k: round(v, 3) for k, v in timings.seconds.items()}
        | {"total": round(elapsed, 3)},
    }
    tmp = Path(str(record_path) + ".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, record_path)
    report = verify_extracted_shard(
        out_path,
        shard,
        record,
        fingerprint,
        plan["layer_ids"],
        plan["hidden_size"],
        settings.dtype,
        report_path,
        partial_dir=partial_dir,
    )
    log(f"shard {shard.shard_id}: verified in {report['verify_seconds']} s")
    shutil.rmtree(partial_dir, ignore_errors=True)
    return record


def _run_chunks(llm, shard, ranges, todo, partial_dir, plan, fingerprint, timings, log) -> int:
    """Prefill the chunks in `todo` through one continuously fed engine loop.

    Requests go in chunk by chunk while fewer than two engine batches of tokens are queued
    (`max_num_batched_tokens` each), so every forward is as full as in one plain `generate`
    over the whole shard: no drain at chunk ends, no partial first batch per chunk, and the
    driver never waits for a commit. Each chunk is registered with the workers right after
    its requests are added; they write it when its rows are complete (capture_worker).
    """
    if plan["strategy"] == "extract_hidden_states":  # rows come from vLLM's connector files
        return run_connector_chunks(
            llm, shard, ranges, todo, partial_dir, plan, fingerprint, timings
        )
    from tqdm import tqdm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    queue_tokens = 2 * engine.vllm_config.scheduler_config.max_num_batched_tokens
    params = SamplingParams(max_tokens=1, temperature=0.0)
    offsets = shard.offsets
    waiting = list(todo)
    total = sum(int(offsets[ranges[i][1]] - offsets[ranges[i][0]]) for i in todo)
    queued = done = 0
    with tqdm(
        total=total,
        unit="tok",
        unit_scale=True,
        desc=f"extract {shard.shard_id}",
        file=sys.stderr,
        mininterval=2.0,
    ) as bar:
        with timings.phase("prefill_and_capture"):
            while waiting or engine.has_unfinished_requests():
                while waiting and queued < queue_tokens:
                    i = waiting.pop(0)
                    a, b = ranges[i]
                    request_ids = [
                        engine.add_request(
                            f"c{i}s{j}",
                            TokensPrompt(prompt_token_ids=shard.sample(j)[0].tolist()),
                            params,
                        )
                        for j in range(a, b)
                    ]
                    lo, hi = int(offsets[a]), int(offsets[b])
                    meta = {
                        "fingerprint": fingerprint,
                        "shard_id": shard.shard_id,
                        "chunk": i,
                        "samples": [a, b],
                    }
                    llm.collective_rpc(
                        "eagleflow_expect",
                        args=(
                            i,
                            request_ids,
                            np.diff(offsets[a : b + 1]).tolist(),
                            shard.input_ids[lo:hi].astype(np.int64).tobytes(),
                            str(chunk_path(partial_dir, i)),
                            meta,
                        ),
                    )
                    queued += hi - lo
                for out in engine.step():
                    if out.finished:
                        n = len(out.prompt_token_ids)
                        queued -= n
                        done += n
                        bar.update(n)
        with timings.phase("commit_wait"):
            worker_stats = llm.collective_rpc("eagleflow_finish")[0]
    for k, v in worker_stats.items():
        timings.seconds[f"worker_{k}"] = timings.seconds.get(f"worker_{k}", 0.0) + v
    return done


def assemble_shard(shard, ranges, partial_dir: Path, plan: dict, fingerprint: str, out_path: Path):
    n_tok = len(shard.input_ids)
    first = chunk_path(partial_dir, 0)
    header, _ = read_header(first)
    hs = header["hidden_states"]
    dtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[hs["dtype"]]
    n_layers, hidden = hs["shape"][1], hs["shape"][2]
    metadata = {
        "layer_ids": json.dumps(plan["layer_ids"]),
        "layer_id_convention": CONVENTION,
        "sample_ids": json.dumps(shard.sample_ids),
        "shard_id": shard.shard_id,
        "capture_strategy": plan["strategy"],
        "fingerprint": fingerprint,
        "format": "eagleflow-hidden-v1",
    }
    layout = [
        ("hidden_states", dtype, (n_tok, n_layers, hidden)),
        ("input_ids", torch.int64, (n_tok,)),
        ("loss_mask", torch.uint8, (n_tok,)),
        ("offsets", torch.int64, (len(shard.offsets),)),
    ]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    writer = StreamingWriter(out_path, layout, metadata)
    try:
        for i, (a, b) in enumerate(ranges):
            with safe_open(str(chunk_path(partial_dir, i)), framework="pt") as f:
                ids = f.get_tensor("input_ids")
                want = torch.from_numpy(shard.input_ids[shard.offsets[a] : shard.offsets[b]])
                if not torch.equal(ids, want):
                    raise RuntimeError(
                        f"chunk {i} of shard {shard.shard_id}: input_ids differ from the shard's tokens"
                    )
                writer.write("hidden_states", f.get_tensor("hidden_states"))
        writer.write("input_ids", torch.from_numpy(shard.input_ids))
        writer.write("loss_mask", torch.from_numpy(shard.loss_mask))
        writer.write("offsets", torch.from_numpy(shard.offsets))
        return writer.close()
    except BaseException:
        writer.abort()
        raise
