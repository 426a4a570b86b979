"""Extraction of one shard: prefill through vLLM, capture, chunked commits, one atomic file.

The shard's chunks (`eagleflow.store.chunks`) are committed as the engine produces them, so a
killed job resumes after its last committed chunk, and a job whose chunks are all committed
never starts the engine. The shard file is assembled from the chunks by streaming, hashed
while written, and renamed into place last; its sidecar JSON records sha256, size and
throughput. In fp8 storage (`capture.storage_dtype`) the file also holds `hidden_scales`
(`eagleflow.store.quant`).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from eagleflow.capture.connector import run_connector_chunks, strategy_engine_kwargs
from eagleflow.capture.plan import CapturePlan, Strategy, plan_for_pipeline
from eagleflow.data.shards import read_token_shard
from eagleflow.engine.builder import build_engine, stop_engine
from eagleflow.engine.settings import EngineSettings
from eagleflow.extract.client import EngineClient, ServerSpec
from eagleflow.store.chunks import ShardChunks
from eagleflow.store.dtypes import torch_dtype
from eagleflow.store.headers import read_header
from eagleflow.store.quant import SCALES_KEY, is_fp8, stored_storage_dtype
from eagleflow.store.stream import StreamingWriter
from eagleflow.store.verify import Expected, verify_extracted_shard
from eagleflow.target.info import read_target
from eagleflow.target.layers import CONVENTION

CAPTURE_WORKER = "eagleflow.capture.worker.CaptureExtension"


@dataclass(frozen=True)
class ShardOutputs:
    """The three files an extract job writes, each atomically, in this order."""

    hidden: Path  # <shard>.safetensors
    record: Path  # <shard>.json: sha256, size, throughput
    report: Path  # <shard>.verify.json: written last


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

    def rounded(self, total: float) -> dict:
        return {k: round(v, 3) for k, v in self.seconds.items()} | {"total": round(total, 3)}


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
                f"shard {shard_id} is being extracted by another process (lock "
                f"{partial_dir}/lock); "
                "wait for it, or stop the other run"
            ) from None
        yield
    finally:
        os.close(fd)


def shard_chunks(shard, plan: CapturePlan, out_path: Path, chunk_tokens: int) -> ShardChunks:
    """The chunks of `shard` for `plan`: one file per chunk, or one per capturing pipeline
    stage (eagleflow.store.chunks)."""
    stages = tuple(s.rank for s in plan.capturing_stages)
    return ShardChunks.plan(shard, plan.fingerprint, out_path, chunk_tokens, stages)


def chunk_paths(chunks: ShardChunks, plan: CapturePlan, i: int) -> dict:
    """Chunk `i`'s file per capturing pipeline rank (as strings, for the workers)."""
    ranks = [s.rank for s in plan.capturing_stages] or [0]
    return {str(r): str(chunks.path(i, r)) for r in ranks}


def start_capture_engine(settings: EngineSettings, plan: CapturePlan, partial_dir: Path):
    """An engine with the capture hooks installed for `plan`."""
    # Every prompt token must run through the model: cached prefixes would skip rows.
    kwargs = {"enable_prefix_caching": False} | strategy_engine_kwargs(
        plan, partial_dir / "connector"
    )
    llm = build_engine(settings, worker_extension=CAPTURE_WORKER, **kwargs)
    installed = llm.collective_rpc("eagleflow_install", args=(plan.to_json(),))
    if plan.pipeline_parallel_size > 1:
        for w in installed:
            if w["rank0"]:
                print(
                    f"pipeline stage {w['pp_rank']}: layers {w['layers'][0]}.."
                    f"{w['layers'][1] - 1}, captures ids {w['layer_ids']}"
                )
    return llm


def stop_capture_engine(llm) -> None:
    try:
        llm.collective_rpc("eagleflow_uninstall")
    finally:
        stop_engine(llm)


def extract_shard(
    tokens_path: str,
    plan: CapturePlan,
    outputs: ShardOutputs,
    settings: EngineSettings,
    chunk_tokens: int,
    log=print,
    server: ServerSpec | None = None,
) -> dict:
    """Extract one shard; write the shard file, then its record (both atomically), verify it and
    write the report, and only then drop the committed chunks, so a kill at any point loses at
    most the chunk in flight (a kill during verification re-assembles without loading the
    model). A shard that fails verification goes to quarantine with its chunks (ShardInvalid).

    `server`: prefill through the shared engine server of that spec (started if none runs;
    eagleflow.extract.server) instead of loading an engine for this shard alone. The client
    stays connected until the shard is verified, so the server's idle clock starts when the
    job ends."""
    shard = read_token_shard(tokens_path)
    plan = plan_for_pipeline(plan, read_target(settings.target), settings.pipeline_parallel_size)
    if server is not None:  # the server captures as this job would
        server = replace(server, plan=plan)
    chunks = shard_chunks(shard, plan, outputs.hidden, chunk_tokens)
    timings = Timings()
    t_start = time.perf_counter()
    engine = {"server": server is not None, "loaded_here": False, "server_pid": None}
    with shard_lock(chunks.partial_dir, shard.shard_id), ExitStack() as stack:
        todo = chunks.todo()
        log(
            f"shard {shard.shard_id}: {len(shard.sample_ids)} samples, "
            f"{len(shard.input_ids)} tokens, {len(chunks.ranges)} chunks, "
            f"{len(chunks.ranges) - len(todo)} already committed"
        )
        tokens_done = 0
        if todo and server is not None:
            client = stack.enter_context(EngineClient(server, log))
            timings.seconds["engine_start"] = client.wait_seconds
            engine.update(loaded_here=client.started_here, server_pid=client.server_pid)
            figures = client.prefill(tokens_path, outputs.hidden, chunk_tokens)
            tokens_done = figures.pop("tokens")
            figures.pop("chunks")
            for k, v in figures.items():
                if k != "engine_start":
                    timings.seconds[k] = timings.seconds.get(k, 0.0) + v
        elif todo:
            with timings.phase("engine_start"):
                llm = start_capture_engine(settings, plan, chunks.partial_dir)
            engine["loaded_here"] = True
            try:
                tokens_done = run_chunks(llm, chunks, todo, plan, timings)
            finally:
                stop_capture_engine(llm)
        with timings.phase("assemble"):
            sha, size = assemble_shard(chunks, plan, outputs.hidden)
        record = shard_record(
            chunks, plan, outputs.hidden, (sha, size), engine["loaded_here"], tokens_done
        )
        record["engine"] = engine
        record["seconds"] = timings.rounded(time.perf_counter() - t_start)
        prefill = timings.seconds["prefill_and_capture"] + timings.seconds["commit_wait"]
        record["tokens_per_second"] = round(tokens_done / prefill, 1) if prefill > 0 else None
        tmp = Path(str(outputs.record) + ".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, outputs.record)
        report = verify_extracted_shard(
            outputs.hidden,
            shard,
            record,
            Expected.of(plan, settings.dtype),
            outputs.report,
            partial_dir=chunks.partial_dir,
        )
    log(f"shard {shard.shard_id}: verified in {report['verify_seconds']} s")
    shutil.rmtree(chunks.partial_dir, ignore_errors=True)
    return record


def shard_record(chunks: ShardChunks, plan, path: Path, hashed, model_loaded, tokens_done):
    sha, size = hashed
    shard = chunks.shard
    return {
        "shard_id": shard.shard_id,
        "fingerprint": chunks.fingerprint,
        "path": path.name,
        "sha256": sha,
        "bytes": size,
        "n_samples": len(shard.sample_ids),
        "n_tokens": int(len(shard.input_ids)),
        "layer_ids": plan.layer_ids,
        "layer_id_convention": CONVENTION,
        "strategy": plan.strategy.value,
        "storage_dtype": plan.storage_dtype,
        "model_loaded": model_loaded,
        "tokens_extracted_now": tokens_done,
    }


def run_chunks(
    llm, chunks: ShardChunks, todo: list[int], plan: CapturePlan, timings, progress=None
) -> int:
    """Prefill the chunks in `todo` through one continuously fed engine loop; the progress bar
    goes to `progress` (a file; stderr by default, the client's log under an engine server).

    Requests go in chunk by chunk while fewer than two engine batches of tokens are queued
    (`max_num_batched_tokens` each), so every forward is as full as in one plain `generate`
    over the whole shard: no drain at chunk ends, no partial first batch per chunk, and the
    driver never waits for a commit. Each chunk is registered with the workers right after
    its requests are added; they write it when its rows are complete (capture_worker).
    """
    if plan.strategy is Strategy.EXTRACT_HIDDEN_STATES:  # rows come from vLLM's files
        return run_connector_chunks(llm, chunks, todo, plan, timings)
    from tqdm import tqdm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    queue_tokens = 2 * engine.vllm_config.scheduler_config.max_num_batched_tokens
    params = SamplingParams(max_tokens=1, temperature=0.0)
    shard = chunks.shard
    waiting = list(todo)
    total = sum(chunks.n_tokens(i) for i in todo)
    queued = done = 0
    with tqdm(
        total=total,
        unit="tok",
        unit_scale=True,
        desc=f"extract {shard.shard_id}",
        file=progress or sys.stderr,
        mininterval=2.0,
    ) as bar:
        with timings.phase("prefill_and_capture"):
            while waiting or engine.has_unfinished_requests():
                while waiting and queued < queue_tokens:
                    i = waiting.pop(0)
                    a, b = chunks.ranges[i]
                    request_ids = [
                        engine.add_request(
                            f"c{i}s{j}",
                            TokensPrompt(prompt_token_ids=shard.sample(j)[0].tolist()),
                            params,
                        )
                        for j in range(a, b)
                    ]
                    lo, hi = chunks.token_range(i)
                    llm.collective_rpc(
                        "eagleflow_expect",
                        args=(
                            i,
                            request_ids,
                            np.diff(shard.offsets[a : b + 1]).tolist(),
                            shard.input_ids[lo:hi].astype(np.int64).tobytes(),
                            chunk_paths(chunks, plan, i),
                            chunks.metadata(i),
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


def read_chunk(
    chunks: ShardChunks, plan: CapturePlan, i: int, key: str = "hidden_states"
) -> torch.Tensor:
    """Chunk `i`'s tensor `key` (states [tokens, n_ids, hidden] or, in fp8, scales
    [tokens, n_ids]) in the plan's layer-id order: its stage files concatenated in stage order,
    each file's ids, input ids and storage dtype checked."""
    shard = chunks.shard
    lo, hi = chunks.token_range(i)
    want = torch.from_numpy(shard.input_ids[lo:hi])
    fp8 = is_fp8(plan.storage_dtype)
    parts, ids = [], []
    for path in chunks.paths(i):
        h, _ = read_header(path)
        if stored_storage_dtype(h) != plan.storage_dtype or fp8 != (SCALES_KEY in h):
            raise RuntimeError(
                f"chunk {i} of shard {shard.shard_id} ({path}): hidden_states "
                f"{h['hidden_states']['dtype']}{' with' if SCALES_KEY in h else ' without'} "
                f"{SCALES_KEY}, the plan stores {plan.storage_dtype}"
            )
        with safe_open(str(path), framework="pt") as f:
            if not torch.equal(f.get_tensor("input_ids"), want):
                raise RuntimeError(
                    f"chunk {i} of shard {shard.shard_id} ({path.name}): "
                    "input_ids differ from the shard's tokens"
                )
            meta = f.metadata() or {}
            parts.append(f.get_tensor(key))
            ids += json.loads(meta.get("layer_ids", "null")) or plan.layer_ids
    if ids != list(plan.layer_ids):
        raise RuntimeError(
            f"chunk {i} of shard {shard.shard_id}: its files hold layer ids {ids}, the plan "
            f"captures {plan.layer_ids}"
        )
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def assemble_shard(chunks: ShardChunks, plan: CapturePlan, out_path: Path):
    """Stream the committed chunks into one safetensors file (hashed while written); the
    layout is the same whatever the pipeline layout that wrote the chunks."""
    shard = chunks.shard
    n_tok = len(shard.input_ids)
    fp8 = is_fp8(plan.storage_dtype)
    header, _ = read_header(chunks.paths(0)[0])
    hs = header["hidden_states"]
    dtype = torch_dtype(hs["dtype"])
    n_layers, hidden = len(plan.layer_ids), hs["shape"][2]
    metadata = {
        "layer_ids": json.dumps(plan.layer_ids),
        "layer_id_convention": CONVENTION,
        "sample_ids": json.dumps(shard.sample_ids),
        "shard_id": shard.shard_id,
        "capture_strategy": plan.strategy.value,
        "fingerprint": chunks.fingerprint,
        "format": "eagleflow-hidden-v1",
        "storage_dtype": plan.storage_dtype,
    }
    layout = [("hidden_states", dtype, (n_tok, n_layers, hidden))]
    if fp8:
        layout.append((SCALES_KEY, torch.float32, (n_tok, n_layers)))
    layout += [
        ("input_ids", torch.int64, (n_tok,)),
        ("loss_mask", torch.uint8, (n_tok,)),
        ("offsets", torch.int64, (len(shard.offsets),)),
    ]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    writer = StreamingWriter(out_path, layout, metadata)
    try:
        for i in range(len(chunks.ranges)):
            writer.write("hidden_states", read_chunk(chunks, plan, i))
        if fp8:  # the scales follow all the states in the file: a second, small pass
            for i in range(len(chunks.ranges)):
                writer.write(SCALES_KEY, read_chunk(chunks, plan, i, SCALES_KEY))
        writer.write("input_ids", torch.from_numpy(shard.input_ids))
        writer.write("loss_mask", torch.from_numpy(shard.loss_mask))
        writer.write("offsets", torch.from_numpy(shard.offsets))
        return writer.close()
    except BaseException:
        writer.abort()
        raise
