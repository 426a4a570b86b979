"""Extraction of one shard: prefill through vLLM, capture, chunked commits, one atomic file.

The shard file is created in its final layout before the engine runs and every chunk's rows
are written into it in place (`eagleflow.store.shardfile`), then committed by a marker
(`eagleflow.store.chunks`): a killed job resumes after its last committed chunk, and a job
whose chunks are all committed never starts the engine. Finishing writes no states again: the
file is linked into its final name, verified by one read that also hashes it, and its sidecar
JSON records sha256, size and throughput. In fp8 storage (`capture.storage_dtype`) the file
also holds `hidden_scales` (`eagleflow.store.quant`).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from eagleflow.capture.connector import run_connector_chunks, strategy_engine_kwargs
from eagleflow.capture.plan import CapturePlan, Strategy, plan_for_pipeline
from eagleflow.data.shards import read_token_shard
from eagleflow.engine.builder import build_engine, stop_engine
from eagleflow.engine.settings import EngineSettings
from eagleflow.serve.client import EngineClient, ServerSpec, release_idle_servers, this_run
from eagleflow.store.chunks import ShardChunks
from eagleflow.store.shardfile import (
    ChunkTarget,
    ShardFile,
    link_into_place,
    plan_shard_file,
    prepare,
)
from eagleflow.store.verify import Expected, verify_extracted_shard
from eagleflow.target.info import read_target
from eagleflow.target.layers import CONVENTION

CAPTURE_WORKER = "eagleflow.capture.worker.CaptureExtension"
# The capture engine server's entry point, started by the first job that needs it.
CAPTURE_SERVER = "eagleflow.extract.capture_server"


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
            "prepare": 0.0,
            "engine_start": 0.0,
            "prefill_and_capture": 0.0,
            "commit_wait": 0.0,
            "finish": 0.0,
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


def shard_file_of(chunks: ShardChunks, plan: CapturePlan, dtype: str) -> tuple[ShardFile, bytes]:
    """The shard's file (in `.partial/<shard>/` until finished) and its header bytes."""
    return plan_shard_file(chunks.shard_file, chunks.shard, plan, dtype, chunks.fingerprint)


def prepare_shard_file(chunks: ShardChunks, plan: CapturePlan, dtype: str) -> ShardFile:
    """Create the shard's file in its final layout, or keep the one a killed job left (with
    its committed chunks) if its header is the one expected."""
    shard_file, header = shard_file_of(chunks, plan, dtype)
    prepare(shard_file, header, chunks.shard, chunks.drop_markers)
    return shard_file


def chunk_targets(chunks: ShardChunks, plan: CapturePlan, shard_file: ShardFile, i: int) -> dict:
    """Chunk `i`'s ChunkTarget per capturing pipeline rank ("0", "1", ...): each stage writes
    the columns of its layer ids, which follow the earlier stages' ids."""
    targets, column = {}, 0
    for stage in plan.capturing_stages or [None]:
        ids = list(stage.layer_ids) if stage else list(plan.layer_ids)
        rank = stage.rank if stage else 0
        meta = chunks.metadata(i) | {"layer_ids": ids, "storage_dtype": plan.storage_dtype}
        targets[str(rank)] = ChunkTarget(shard_file, column, chunks.path(i, rank), meta)
        column += len(ids)
    return targets


def finish_shard(chunks: ShardChunks, out_path: Path) -> int:
    """Give the shard file, every chunk committed, its final name (no copy: a hard link, so
    the partial name keeps it until the job is done); returns its size."""
    missing = chunks.todo()
    if missing:
        raise RuntimeError(
            f"shard {chunks.shard.shard_id}: chunks {missing[:10]} are not committed "
            f"({len(missing)} of {len(chunks.ranges)}); run again to extract them"
        )
    link_into_place(chunks.shard_file, Path(out_path))
    return Path(out_path).stat().st_size


def start_capture_engine(settings: EngineSettings, plan: CapturePlan, partial_dir: Path, log=print):
    """An engine with the capture hooks installed for `plan`; under pipeline parallelism,
    `log` gets each stage's layers and ids as its workers report them."""
    # Every prompt token must run through the model: cached prefixes would skip rows.
    kwargs = {"enable_prefix_caching": False} | strategy_engine_kwargs(
        plan, partial_dir / "connector"
    )
    llm = build_engine(settings, worker_extension=CAPTURE_WORKER, **kwargs)
    installed = llm.collective_rpc("eagleflow_install", args=(plan.to_json(),))
    if plan.pipeline_parallel_size > 1:
        for w in installed:
            if w["rank0"]:
                log(
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
    """Extract one shard: create its file, prefill the chunks not yet committed into it, link
    it into place, verify it (one read, which also hashes it), write its record, then its
    report, and only then drop the partial directory, so a kill at any point loses at most the
    chunk in flight (a kill after the last commit verifies again without loading the model). A
    shard that fails verification goes to quarantine with its partial directory (ShardInvalid).

    `server`: prefill through the shared engine server of that spec (started if none runs:
    `CAPTURE_SERVER`) instead of loading an engine for this shard alone. The client
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
        with timings.phase("prepare"):
            shard_file = prepare_shard_file(chunks, plan, settings.dtype)
        todo = chunks.todo()
        log(
            f"shard {shard.shard_id}: {len(shard.sample_ids)} samples, "
            f"{len(shard.input_ids)} tokens, {len(chunks.ranges)} chunks, "
            f"{len(chunks.ranges) - len(todo)} already committed"
        )
        tokens_done = 0
        if todo and server is not None:
            client = stack.enter_context(EngineClient(server, CAPTURE_SERVER, log))
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
                release_idle_servers(this_run(), log=log)  # e.g. the run's generate server
                llm = start_capture_engine(settings, plan, chunks.partial_dir, log=log)
            engine["loaded_here"] = True
            try:
                tokens_done = run_chunks(llm, chunks, todo, plan, shard_file, timings)
            finally:
                stop_capture_engine(llm)
        with timings.phase("finish"):
            size = finish_shard(chunks, outputs.hidden)
        record = shard_record(
            chunks, plan, outputs.hidden, size, engine["loaded_here"], tokens_done
        )
        record["engine"] = engine
        record["seconds"] = timings.rounded(time.perf_counter() - t_start)
        prefill = timings.seconds["prefill_and_capture"] + timings.seconds["commit_wait"]
        record["tokens_per_second"] = round(tokens_done / prefill, 1) if prefill > 0 else None
        # The record (with the sha256 of the verification read), then the report, last.
        report = verify_extracted_shard(
            outputs.hidden,
            shard,
            record,
            Expected.of(plan, settings.dtype),
            outputs.report,
            partial_dir=chunks.partial_dir,
            record_path=outputs.record,
        )
    log(f"shard {shard.shard_id}: verified in {report['verify_seconds']} s")
    shutil.rmtree(chunks.partial_dir, ignore_errors=True)
    return record


def shard_record(chunks: ShardChunks, plan, path: Path, size: int, model_loaded, tokens_done):
    """The shard's record; its sha256 is set by verification, which reads the whole file."""
    shard = chunks.shard
    return {
        "shard_id": shard.shard_id,
        "fingerprint": chunks.fingerprint,
        "path": path.name,
        "sha256": None,
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
    llm,
    chunks: ShardChunks,
    todo: list[int],
    plan: CapturePlan,
    shard_file: ShardFile,
    timings,
    progress=None,
) -> int:
    """Prefill the chunks in `todo` into `shard_file` through one continuously fed engine loop;
    the progress bar goes to `progress` (a file; stderr by default, the client's log under an
    engine server).

    Requests go in chunk by chunk while fewer than two engine batches of tokens are queued
    (`max_num_batched_tokens` each), so every forward is as full as in one plain `generate`
    over the whole shard: no drain at chunk ends, no partial first batch per chunk, and the
    driver never waits for a commit. Each chunk is registered with the workers right after
    its requests are added; they write it when its rows are complete (`CaptureExtension`,
    eagleflow.capture.worker).
    """
    if plan.strategy is Strategy.EXTRACT_HIDDEN_STATES:  # rows come from vLLM's files
        return run_connector_chunks(
            llm,
            chunks,
            todo,
            plan,
            timings,
            lambda i: chunk_targets(chunks, plan, shard_file, i)["0"],
        )
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
                            {
                                r: t.to_json()
                                for r, t in chunk_targets(chunks, plan, shard_file, i).items()
                            },
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
