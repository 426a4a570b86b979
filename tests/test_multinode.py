"""Engines over several nodes (eagleflow.engine.multinode): the headless nodes' command lines,
parsed by vLLM's own `serve` parser; where the nodes come from; and, on real vLLM, a PP=2 engine
whose second stage runs in a headless vLLM process of a second "node" on loopback."""

import os
import sys

import pytest

from eagleflow.engine.multinode import (
    LOOPBACK_ENV,
    MultiNodeError,
    NodeGroup,
    headless_args,
)

KWARGS = {
    "model": "/models/Kimi-K2.5",
    "tokenizer": "/models/Kimi-K2.5",
    "tensor_parallel_size": 8,
    "pipeline_parallel_size": 2,
    "dtype": "bfloat16",
    "max_model_len": 4097,
    "enforce_eager": True,
    "worker_extension_cls": "eagleflow.capture.worker.CaptureExtension",
    "seed": 0,
    "max_num_batched_tokens": 8192,
    "gpu_memory_utilization": 0.9,
    "enable_prefix_caching": False,
    "trust_remote_code": True,
}


def test_headless_nodes_get_the_engine_arguments_of_node_zero(monkeypatch):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    group = NodeGroup(["gpu-a", "gpu-b"], "srun", master_port=29555)
    kwargs = KWARGS | group.head_kwargs()
    cmd = group.node_command(1, kwargs)
    assert cmd[:5] == ["srun", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=gpu-b"]
    assert cmd[5:8] == [sys.executable, "-m", "eagleflow.engine.headless_node"]
    parser = FlexibleArgumentParser()
    sub = parser.add_subparsers()
    ServeSubcommand().subparser_init(sub)
    args = parser.parse_args(["serve", *cmd[8:]])
    assert args.headless and args.model_tag == "/models/Kimi-K2.5"
    engine = AsyncEngineArgs.from_cli_args(args)
    for key, value in KWARGS.items():
        if key != "model":
            assert getattr(engine, key) == value, key
    assert (engine.nnodes, engine.node_rank, engine.master_addr, engine.master_port) == (
        2,
        1,
        "gpu-a",
        29555,
    )
    assert engine.distributed_executor_backend == "mp"
    assert headless_args({"model": "m", "x": None, "cfg": {"a": 1}}) == ["m", "--cfg", '{"a": 1}']


def test_nodes_come_from_the_slurm_allocation(monkeypatch, tmp_path):
    monkeypatch.delenv(LOOPBACK_ENV, raising=False)
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    with pytest.raises(MultiNodeError, match="is 2 but it runs outside a SLURM allocation"):
        NodeGroup.for_engine(2)
    # A stand-in scontrol, as SLURM's expands a node list.
    (tmp_path / "scontrol").write_text("#!/bin/sh\necho gpu-a; echo gpu-b\n")
    (tmp_path / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu-[a-b]")
    group = NodeGroup.for_engine(2)
    assert group.hosts == ["gpu-a", "gpu-b"] and group.launcher == "srun"
    with pytest.raises(MultiNodeError, match="its SLURM allocation has 2 node"):
        NodeGroup.for_engine(3)
    monkeypatch.setenv(LOOPBACK_ENV, "1")
    assert NodeGroup.for_engine(2).hosts == ["127.0.0.1", "127.0.0.1"]


def test_loopback_nodes_share_the_cores_out(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    group = NodeGroup(["127.0.0.1"] * 2, "local", master_port=1)
    assert group.node_env(1, 2)["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert NodeGroup(["a", "b"], "srun", 1).node_env(1, 2)["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"


def test_a_node_that_fails_interrupts_the_job_with_its_traceback_in_the_log(tmp_path):
    """The watcher: a node whose process ends while the engine runs interrupts the job (SIGINT
    to it), after a line naming the node; the node's own traceback is in the same log, since
    its output goes to the job's stdout and stderr (the shard's log under redirect_to_log)."""
    import subprocess

    script = tmp_path / "job.py"
    script.write_text(
        "import signal, sys, time\n"
        # A job started in the background by a non-interactive shell inherits SIGINT ignored
        # (the watcher then ends it after its grace period); this job takes SIGINT.
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from eagleflow.engine.multinode import NodeGroup\n"
        "g = NodeGroup(['127.0.0.1', '127.0.0.1'], 'local', master_port=1)\n"
        "g.node_command = lambda rank, kw: [sys.executable, '-c', "
        "'raise RuntimeError(\"CUDA error on this node\")']\n"
        "g.start({}, 2)\n"
        "try:\n"
        "    time.sleep(600)\n"
        "except KeyboardInterrupt:\n"
        "    print('job interrupted', flush=True)\n"
        "    g.stop()\n"
        "    sys.exit(1)\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        # Generous: under a full test suite plus two training jobs on 2 cores, the job once
        # ran its whole 60 s sleep before the node's failure was seen. Unloaded, the watcher
        # ends the job within a second or two of the node's exit.
        timeout=600,
        env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)},
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1, log
    assert "RuntimeError: CUDA error on this node" in log
    assert "node rank 1 (127.0.0.1) ended with exit code 1 while the engine was running" in log
    assert log.index("CUDA error on this node") < log.index("ended with exit code 1")
    assert "job interrupted" in log


@pytest.mark.vllm
def test_pp2_over_two_loopback_nodes_captures_every_stage(
    reference_deepseek, monkeypatch, tmp_path
):
    """vLLM's multi-node launch on one machine: node rank 0 (this process's engine) runs
    stage 0, a headless `vllm serve` process as node rank 1 runs stage 1; eagleflow's capture
    hooks reach both, and the states match the float32 reference, tokens exact."""
    from dataclasses import replace

    import torch

    from eagleflow.capture.plan import make_plan
    from eagleflow.capture.reference import load_reference_model
    from eagleflow.engine.builder import build_engine, stop_engine
    from eagleflow.engine.settings import EngineSettings
    from eagleflow.extract.shard import (
        CAPTURE_WORKER,
        chunk_targets,
        prepare_shard_file,
        shard_chunks,
    )
    from eagleflow.target.layers import default_layer_ids
    from support.references import assert_matches_reference, capture

    monkeypatch.setenv(LOOPBACK_ENV, "1")
    monkeypatch.setenv("VLLM_ENGINE_READY_TIMEOUT_S", "300")
    target = reference_deepseek
    ids = default_layer_ids(target.info.num_layers)
    plan = replace(make_plan(target.info, ids, "auto", pipeline_parallel_size=2), fingerprint="t")
    settings = EngineSettings(
        target=str(target.path),
        pipeline_parallel_size=2,
        nodes=2,
        max_model_len=600,
        max_num_batched_tokens=2048,
    )
    llm = build_engine(settings, worker_extension=CAPTURE_WORKER, enable_prefix_caching=False)
    try:
        (node,) = llm.eagleflow_nodes.procs
        assert node.poll() is None
        captured = capture(llm, target.shard, plan, tmp_path / "out")
        # An error in the other node's worker alone (no file for stage 1) reaches this process
        # with its traceback (vLLM 0.32 then stops the engine: a failed collective_rpc is
        # fatal to its engine core).
        chunks = shard_chunks(target.shard, plan, tmp_path / "x" / "s.safetensors", 400)
        shard_file = prepare_shard_file(chunks, plan, "bfloat16")
        stage0_only = {"0": chunk_targets(chunks, plan, shard_file, 0)["0"].to_json()}
        llm.collective_rpc("eagleflow_install", args=(plan.to_json(),))
        with pytest.raises(Exception, match="(?s)eagleflow_expect.*worker traceback.*KeyError"):
            llm.collective_rpc("eagleflow_expect", args=(0, ["r"], [1], bytes(8), stage0_only))
    finally:
        stop_engine(llm)
    assert node.poll() is not None  # the other node's workers stop with the engine
    assert {f.split(".")[1] for f in captured.chunk_files} == {"stage-0", "stage-1"}
    assert torch.equal(captured.input_ids, torch.from_numpy(target.shard.input_ids))
    assert_matches_reference(load_reference_model(target.path), captured.states, target.shard, ids)
