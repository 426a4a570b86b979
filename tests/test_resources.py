"""What jobs ask a cluster for (eagleflow.extract.resources): GPUs, CPUs, memory, runtime."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from eagleflow.extract import resources as jr

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


def test_measured_rates_from_finished_shards(tmp_path):
    assert jr.measured_rates(tmp_path / "missing") == (None, None)
    recs = [(100.0, 30.0, True), (300.0, 20.0, True), (200.0, 25.0, True), (None, None, False)]
    for i, (tps, start, loaded) in enumerate(recs):
        rec = {
            "tokens_extracted_now": 10 if tps else 0,
            "tokens_per_second": tps,
            "model_loaded": loaded,
            "seconds": {"engine_start": start} if start else {},
        }
        (tmp_path / f"{i:020x}.json").write_text(json.dumps(rec))
    (tmp_path / "fingerprint.json").write_text("{}")
    (tmp_path / f"{0:020x}.verify.json").write_text("{}")
    assert jr.measured_rates(tmp_path) == (pytest.approx(200.0), pytest.approx(30.0))


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
    assert jr.measured_regeneration(tmp_path) == (None, None)
    for name, rec in {
        "a": {"model_loaded": True, "tokens_per_second": 100.0, "engine_start_s": 30.0},
        "b": {"model_loaded": True, "tokens_per_second": 300.0, "engine_start_s": 50.0},
        "c": {"model_loaded": False, "engine_start_s": 0.0},  # resumed: all chunks committed
    }.items():
        (tmp_path / f"{name}.summary.json").write_text(json.dumps(rec))
    assert jr.measured_regeneration(tmp_path) == (200.0, 50.0)
    # A job served by another job's engine server (engine reuse): its decode rate counts, its
    # engine start (a connection, not a load) does not.
    reused = {"model_loaded": False, "tokens_per_second": 400.0, "engine_start_s": 1.0}
    (tmp_path / "d.summary.json").write_text(json.dumps(reused))
    assert jr.measured_regeneration(tmp_path) == (300.0, 50.0)
    # the time limit grows with the prompts and the attempt
    one = jr.extract_runtime_minutes(1000 * 64, 200.0, 50 / 60, attempt=1)
    assert jr.extract_runtime_minutes(1000 * 64, 200.0, 50 / 60, attempt=2) == 2 * one
    assert jr.extract_runtime_minutes(4000 * 64, 200.0, 50 / 60) > one
