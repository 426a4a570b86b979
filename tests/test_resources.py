"""What jobs ask a cluster for (eagleflow.extract.resources): GPUs, CPUs, memory, runtime."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from eagleflow.extract import resources as jr
from eagleflow.extract.rates import Measured, extraction_timings, measure, regeneration_timings

CPU = {"device": "cpu", "tensor_parallel_size": 1, "cpu_kvcache_space_gib": 1}
CUDA = {"device": "cuda", "tensor_parallel_size": 8, "cpu_kvcache_space_gib": 1}


def test_gpus_follow_the_device_unless_set():
    assert jr.extract_gpus(CUDA) == 8
    assert jr.extract_gpus(CPU) == 0
    assert jr.extract_gpus({**CPU, "gpus_per_job": 4}) == 4
    assert jr.extract_gpus({**CUDA, "gpus_per_job": None}) == 8


def test_cpus_and_memory_match_the_gpus():
    assert jr.extract_cpus(CUDA) == 64
    assert jr.extract_cpus({**CPU, "tensor_parallel_size": 2}) == 2
    assert jr.extract_cpus({**CUDA, "cpus_per_job": 16}) == 16
    assert jr.extract_mem_mb(CUDA, 10**12) == 8 * 64000
    # CPU engine: weights + KV cache + overhead, as validate_env estimates.
    assert jr.extract_mem_mb(CPU, 2**30) == 1024 + 1024 + 2048
    assert jr.extract_mem_mb({**CPU, "mem_mb_per_job": 500}, 2**30) == 500


def test_runtime_covers_load_prefill_and_verification_and_grows_with_attempts():
    # Kimi-K2.5 at TP=8: ~18 min load, 2,280 tok/s; a 1M-token shard prefills in ~7.3 min.
    first = jr.extract_runtime_minutes(1_000_000, 2280, 18, attempt=1)
    assert first == 40  # ceil(1.5 * (18 + 7.31) + 2)
    assert jr.extract_runtime_minutes(1_000_000, 2280, 18, attempt=2) == 2 * first
    # Its shard (4 layers x 7168, bf16: 53.4 GiB) is read back once by the verification.
    verify = jr.verify_minutes(1_000_000, 4, 7168)
    assert 4.5 < verify < 4.6  # 54,688 MiB at 200 MiB/s
    assert (
        jr.extract_runtime_minutes(1_000_000, 2280, 18, verify, attempt=1) == 47
    )  # ceil(1.5 * 30.87 + 2)


def test_shard_tokens_from_the_header(tmp_path):
    p = tmp_path / "s.safetensors"
    save_file({"input_ids": np.arange(123, dtype=np.int64), "loss_mask": np.ones(123, np.uint8)}, p)
    assert jr.shard_tokens(p) == 123
    p.write_bytes(b"\xff" * 900)  # damaged: estimated from the size, fails later in its job
    assert jr.shard_tokens(p) == 100


def extraction_record(tokens, tokens_per_second, engine_start, loaded):
    return {
        "tokens_extracted_now": tokens,
        "tokens_per_second": tokens_per_second,
        "model_loaded": loaded,
        "seconds": {"engine_start": engine_start},
    }


def test_measured_rates_from_finished_shards(tmp_path):
    assert measure(extraction_timings(tmp_path / "missing")) == Measured(None, None, None)
    records = [
        extraction_record(1000, 100.0, 30.0, True),  # 10 s
        extraction_record(100, 400.0, 45.0, False),  # a tail shard, 0.25 s; connected only
        extraction_record(2000, 200.0, 20.0, True),  # 10 s
        extraction_record(0, None, 0.0, False),  # resumed with every chunk committed
    ]
    for i, rec in enumerate(records):
        (tmp_path / f"{i:020x}.json").write_text(json.dumps(rec))
    (tmp_path / "fingerprint.json").write_text(json.dumps(extraction_record(9, 1.0, 99, True)))
    (tmp_path / f"{0:020x}.verify.json").write_text("{}")
    measured = measure(extraction_timings(tmp_path))
    # tokens over seconds (3100 / 20.25), not the median (200) or mean (233) of the rates
    assert measured.tokens_per_second == pytest.approx(3100 / 20.25)
    # the longest load of the jobs that loaded; two of the three jobs that worked loaded
    assert measured.load_seconds == 30.0 and measured.loads_per_job == pytest.approx(2 / 3)
    # 3100 more tokens in 3 more jobs: 20.25 s, plus two loads of 30 s
    assert measured.seconds(3100, 3) == pytest.approx(20.25 + 60.0)
    assert Measured(None, 30.0, 1.0).seconds(3100, 3) is None


def test_pipeline_and_multi_node_jobs_ask_for_every_worker_s_gpu():
    # One node of 8 GPUs running TP=4 x PP=2.
    one = {**CUDA, "tensor_parallel_size": 4, "pipeline_parallel_size": 2}
    assert jr.extract_gpus(one) == jr.extract_gpu_resource(one) == 8
    assert jr.extract_gres(one) == "" and jr.extract_nodes(one) == 1
    # Kimi-K2.5 on two nodes of 8 x H100: TP=8 x PP=2, `--nodes=2 --gres=gpu:8`.
    two = {**CUDA, "pipeline_parallel_size": 2, "nodes": 2}
    assert jr.extract_nodes(two) == 2 and jr.extract_gpus(two) == 8
    assert jr.extract_gpu_resource(two) == 0 and jr.extract_gres(two) == "gpu:8"
    assert jr.extract_cpus(two) == 64 and jr.extract_mem_mb(two, 10**12) == 8 * 64000
    # A CPU engine of PP=2 workers: a core and a KV cache each.
    cpu = {**CPU, "pipeline_parallel_size": 2}
    assert jr.extract_cpus(cpu) == 2
    assert jr.extract_mem_mb(cpu, 2**30) == 1024 + 2 * 1024 + 2048


def test_regeneration_rates_come_from_finished_shards_and_the_load_from_those_that_loaded(
    tmp_path,
):
    assert measure(regeneration_timings(tmp_path)) == Measured(None, None, None)
    for name, rec in {
        "a": {"model_loaded": True, "generated_tokens_now": 1000, "tokens_per_second": 100.0},
        "b": {"model_loaded": True, "generated_tokens_now": 3000, "tokens_per_second": 300.0},
        "c": {"model_loaded": False, "engine_start_s": 0.0},  # resumed: all chunks committed
    }.items():
        rec.setdefault("engine_start_s", {"a": 30.0, "b": 50.0}.get(name))
        (tmp_path / f"{name}.summary.json").write_text(json.dumps(rec))
    assert measure(regeneration_timings(tmp_path)) == Measured(200.0, 50.0, 1.0)
    # A job served by another job's engine server (engine reuse): its decode rate counts, its
    # engine start (a connection, not a load) does not.
    reused = {
        "model_loaded": False,
        "generated_tokens_now": 4000,
        "tokens_per_second": 400.0,
        "engine_start_s": 60.0,
    }
    (tmp_path / "d.summary.json").write_text(json.dumps(reused))
    assert measure(regeneration_timings(tmp_path)) == Measured(8000 / 30, 50.0, 2 / 3)


EXT = {"model_load_minutes": 20, "shards_per_allocation": 4, "engine_reuse": True}


def test_job_runtimes_use_the_measured_rates_else_the_config():
    unmeasured = Measured(None, None, None)
    assert jr.job_runtime_minutes(
        {**EXT, "shards_per_allocation": 1}, 1_000_000, unmeasured, 2280, 4.5
    ) == jr.extract_runtime_minutes(1_000_000, 2280, 20, 4.5)
    measured = Measured(1000.0, 600.0, 1.0)
    assert jr.job_runtime_minutes(
        {**EXT, "shards_per_allocation": 1}, 1_000_000, measured, 2280, attempt=2
    ) == jr.extract_runtime_minutes(1_000_000, 1000.0, 10, attempt=2)


def test_jobs_sharing_one_engine_carry_a_share_of_the_load():
    assert jr.jobs_per_engine(EXT) == 4
    assert jr.jobs_per_engine({**EXT, "engine_reuse": False}) == 1
    assert jr.jobs_per_engine({**EXT, "shards_per_allocation": 1}) == 1
    measured = Measured(1000.0, 1200.0, 0.25)  # a 20-minute load
    shared = jr.job_runtime_minutes(EXT, 60_000, measured, 2280)
    assert shared == jr.extract_runtime_minutes(60_000, 1000.0, 5)
    alone = jr.job_runtime_minutes({**EXT, "engine_reuse": False}, 60_000, measured, 2280)
    assert alone == jr.extract_runtime_minutes(60_000, 1000.0, 20) > shared
    # the time limit grows with the tokens and the attempt
    assert jr.job_runtime_minutes(EXT, 60_000, measured, 2280, attempt=2) == 2 * shared
    assert jr.job_runtime_minutes(EXT, 240_000, measured, 2280) > shared
