"""How the workflow launches the draft trainer and sizes its job (eagleflow.plan.launch,
eagleflow.plan.resources, eagleflow.plan.progress): the command for 1 rank, torchrun on one
machine and srun tasks on SLURM; the sbatch options the pinned SLURM plugin makes of the
job's resources; the time limit from the tokens to train and the rate; the progress report.
Pure functions: no rank is started (tests/test_train_distributed.py starts them)."""

import json

import pandas as pd
import pytest

from eagleflow.data.heldout import excluder, is_heldout
from eagleflow.plan import launch
from eagleflow.plan.progress import format_training_progress, training_progress
from eagleflow.plan.resources import (
    TrainingTokens,
    TrainJob,
    evaluate_runtime_minutes,
    host_mem_mb,
    measured_rate_per_rank,
    processes_per_node,
    read_progress,
    train_runtime_minutes,
)
from eagleflow.plan.settings import DraftSettings, TrainConfig
from eagleflow.train.preflight import launch_for_job, preflight
from eagleflow.train.rank import rank_env
from support.workflow_config import draft_settings

CPU = {"device": "cpu", "tensor_parallel_size": 1}
GPU_NODE = {"device": "cuda", "tensor_parallel_size": 8, "pipeline_parallel_size": 1, "nodes": 1}
ARGS = ["--shards", "a.safetensors", "--out", "work"]


def settings(extract: dict, **draft):
    """The typed `draft:` section with `draft` set, where the ranks run as `extract` says."""
    return draft_settings(draft, extract=extract)


def ranks(extract: dict, **draft):
    return settings(extract, **draft).ranks


# ---------------------------------------------------------------- ranks and the command


def test_processes_per_node_defaults_to_the_gpus_on_cuda_and_one_on_cpu():
    assert processes_per_node(ranks(CPU, processes_per_node=None), CPU) == 1
    assert processes_per_node(ranks(CPU, processes_per_node=3), CPU) == 3
    # CUDA: the GPUs the job sees when it runs here, else those an extract job asks for
    on_gpus = ranks(GPU_NODE, processes_per_node=None)
    assert processes_per_node(on_gpus, GPU_NODE, visible_gpus=4) == 4
    assert processes_per_node(on_gpus, GPU_NODE) == 8
    two_nodes = {**GPU_NODE, "pipeline_parallel_size": 2, "nodes": 2}
    assert processes_per_node(on_gpus, two_nodes) == 8
    assert processes_per_node(on_gpus, {**GPU_NODE, "gpus_per_job": 4}) == 4
    # draft.device overrides extract.device
    assert processes_per_node(ranks(GPU_NODE, processes_per_node=None, device="cpu"), GPU_NODE) == 1


def test_one_rank_runs_the_trainer_as_a_plain_process():
    cmd = launch.command(launch.Launch(1, 1, "cpu", cpus_per_rank=2), ARGS, python="py")
    assert cmd.argv == ["py", "-m", "eagleflow.train.cli", *ARGS]
    assert cmd.env == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}


def test_ranks_on_this_machine_start_under_torchrun_standalone():
    draft = settings(CPU, processes_per_node=2, nodes=1, num_workers=1)
    run = launch_for_job(draft, CPU, srun=False, threads=4)
    assert (run.world_size, run.srun, run.cpus_per_rank) == (2, False, 2)
    cmd = launch.command(run, ARGS, python="py")
    assert cmd.argv == [
        "py",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc_per_node",
        "2",
        "-m",
        "eagleflow.train.cli",
        *ARGS,
    ]
    assert cmd.env == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}


def test_slurm_ranks_are_srun_tasks_with_a_rendezvous_on_the_first_node():
    draft = settings(GPU_NODE, processes_per_node=8, nodes=2, num_workers=4, cpus_per_rank=None)
    run = launch_for_job(draft, GPU_NODE, srun=True, threads=64)
    assert (run.world_size, run.cpus_per_rank, run.device) == (16, 8, "cuda")
    cmd = launch.command(run, ARGS, python="py", port=29511)
    assert cmd.argv == [
        "srun",
        "--kill-on-bad-exit=1",
        "--nodes=2",
        "--ntasks=16",
        "--ntasks-per-node=8",
        "--cpus-per-task=8",
        "--mem=0",
        "--gres=gpu:8",
        "py",
        "-m",
        "eagleflow.train.rank",
        *ARGS,
    ]
    assert cmd.env["MASTER_PORT"] == "29511" and cmd.env["MASTER_ADDR"] not in ("", "127.0.0.1")
    # one node, CPU: loopback rendezvous, no GPUs
    cpu = launch.Launch(1, 2, "cpu", srun=True, cpus_per_rank=1)
    cmd = launch.command(cpu, ARGS, python="py")
    assert cmd.env["MASTER_ADDR"] == "127.0.0.1" and int(cmd.env["MASTER_PORT"]) > 0
    assert not any(a.startswith("--gres") for a in cmd.argv) and "--ntasks=2" in cmd.argv


def test_an_srun_task_gets_torch_rank_variables_from_slurms():
    env = {
        "SLURM_PROCID": "9",
        "SLURM_NTASKS": "16",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "MASTER_ADDR": "node0",
    }
    assert rank_env(env) == {
        "RANK": "9",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "1",
        "GROUP_RANK": "1",
    }
    with pytest.raises(launch.LaunchError, match="SLURM_PROCID"):
        rank_env({"MASTER_ADDR": "x"})


def test_a_streaming_run_s_trainer_takes_the_gpus_its_engine_server_does_not():
    """draft.stream_engine_devices on one node: the ranks see the node's other GPUs (torchrun
    gets them as CUDA_VISIBLE_DEVICES, and one rank per GPU by default)."""
    stream = {"states": "stream", "stream_engine_devices": "0,1,2,3"}

    def states(**draft):
        return settings(GPU_NODE, **{**stream, **draft}).states

    assert launch.trainer_devices(states(), 8) == "4,5,6,7"
    assert launch.trainer_devices(states(states="stored"), 8) is None
    assert launch.trainer_devices(states(stream_engine_devices=None), 8) is None
    with pytest.raises(launch.LaunchError, match="leaves the trainer none"):
        launch.trainer_devices(states(stream_engine_devices="0,1"), 2)
    with pytest.raises(launch.LaunchError, match="CUDA device indices"):
        launch.trainer_devices(states(stream_engine_devices="a,b"), 8)
    run = launch.Launch(1, 4, "cuda", devices="4,5,6,7")
    assert launch.command(run, ARGS, python="py").env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert "CUDA_VISIBLE_DEVICES" not in launch.command(launch.Launch(1, 4, "cuda"), ARGS).env


def test_streamed_states_refuse_sequence_splitting(tmp_path):
    from eagleflow.train.data import StateSource

    class Served(StateSource):  # refused before anything is read
        served, paths = True, []

    cfg = TrainConfig(sequence_parallel=2, batch_packs=2)
    with pytest.raises(launch.LaunchError, match=r"sequence_parallel = 2 with streamed states"):
        preflight(Served(), "t", None, cfg, {}, launch.Launch(1, 2, "cpu"), print)


def test_a_launch_that_cannot_work_is_refused_in_one_sentence_naming_the_key():
    with pytest.raises(launch.LaunchError, match=r"draft\.nodes is 2.*--profile slurm"):
        launch.Launch(2, 1, "cpu").check(8)
    with pytest.raises(launch.LaunchError, match=r"draft\.batch_packs = 8 .* multiple of 3"):
        launch.Launch(1, 3, "cpu").check(8)
    launch.Launch(2, 4, "cuda", srun=True).check(8)
    # sequence splitting: groups of ranks share a pack, so the packs go over the groups
    with pytest.raises(launch.LaunchError, match=r"draft\.sequence_parallel = 3 .* the 8 ranks"):
        launch.Launch(1, 8, "cuda").check(8, 3)
    with pytest.raises(launch.LaunchError, match=r"batch_packs = 2 .* over 4 groups .* of 4"):
        launch.Launch(1, 8, "cuda").check(2, 2)
    launch.Launch(1, 8, "cuda").check(2, 4)
    import torch

    if not torch.cuda.is_available():  # CUDA asked for on a machine without a GPU
        with pytest.raises(launch.LaunchError, match="set draft.device to cpu"):
            launch_for_job(settings(CPU, device="cuda"), CPU, srun=False, threads=2)


# ---------------------------------------------------------------- the SLURM job


def sbatch(job: TrainJob) -> str:
    """What snakemake-executor-plugin-slurm (pinned 2.8) submits for the job's resources."""
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    class Resources(dict):
        __getattr__ = dict.__getitem__

    class Job:
        resources = Resources(job.slurm(), mem_mb=1000, runtime=10)
        threads = 2

    params = dict(
        run_uuid="u", slurm_logfile="l", comment_str="c", account="", partition="", workdir=""
    )
    return get_submit_command(Job, params) + set_gres_string(Job)


@pytest.mark.parametrize(
    "draft, extract, options",
    [
        (  # the SLURM test: 2 CPU ranks, one CPU each
            {"processes_per_node": 2, "num_workers": 0},
            CPU,
            ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"],
        ),
        (  # an 8-GPU node: every GPU (processes_per_node null)
            {"processes_per_node": None, "num_workers": 4},
            GPU_NODE,
            ["--nodes=1", "--ntasks-per-node=8", "--cpus-per-task=8", "--gpus=8"],
        ),
        (  # two 8-GPU nodes: GPUs per node as gres
            {"processes_per_node": 8, "nodes": 2, "num_workers": 4, "cpus_per_rank": 12},
            GPU_NODE,
            ["--nodes=2", "--ntasks-per-node=8", "--cpus-per-task=12", "--gres=gpu:8"],
        ),
        (  # one GPU on each of two nodes
            {"processes_per_node": 1, "nodes": 2, "num_workers": 4},
            GPU_NODE,
            ["--nodes=2", "--ntasks-per-gpu=1", "--ntasks=2", "--gres=gpu:1"],
        ),
        (  # one rank: a plain job
            {"processes_per_node": 1, "num_workers": 4},
            GPU_NODE,
            ["--nodes=1", "--cpus-per-task=8", "--gpus=1"],
        ),
    ],
)
def test_the_job_asks_slurm_for_its_ranks_gpus_and_cpus(draft, extract, options):
    job = TrainJob.from_settings(settings(extract, **draft), extract)
    call = sbatch(job)
    assert all(f" {o}" in call for o in options), call
    assert (job.slurm()["mpi"] == "srun") == (job.ranks > 1)
    if "--ntasks-per-node" in call:  # SLURM refuses --ntasks-per-gpu next to it
        assert "--ntasks-per-gpu" not in call


def test_runtime_grows_with_tokens_and_attempt_and_shrinks_with_ranks():
    one = train_runtime_minutes(3_600_000, 1000, 1)
    assert one == 90 + 5 + 2  # 1.5 x 60 min, start-up and end, Snakemake's start
    assert train_runtime_minutes(3_600_000, 1000, 8) == 12 + 7  # 1.5 x 7.5 min -> 11.25
    assert train_runtime_minutes(3_600_000, 1000, 1, attempt=3) == 3 * one
    ev = {"paths": ["vllm_eagle3", "vllm_ngram", "reference"], "num_prompts": 32, "max_tokens": 32}
    # 3 loads of 2 min, 3 x 32 x 32 tokens at 50 tok/s: 1.5 x (6 + 1.024) + 2
    assert evaluate_runtime_minutes(ev, 2, 50) == 13
    assert evaluate_runtime_minutes(ev, 2, 50, attempt=2) == 26


def manifest(n=200):
    ids = [f"sample-{i}" for i in range(n)]
    return pd.DataFrame(
        {
            "sample_id": ids,
            "n_tokens": [10 + i % 50 for i in range(n)],
            "n_loss_tokens": [5 + i % 20 for i in range(n)],
        }
    )


def test_tokens_to_train_are_the_training_samples_loss_tokens_times_epochs():
    frame = manifest()
    held = frame["sample_id"].map(lambda s: is_heldout(s, 20))
    assert 0 < held.sum() < len(frame)
    tokens = TrainingTokens.from_manifest(frame, excluder(20))
    assert tokens.samples == (~held).sum()
    assert tokens.loss_tokens == frame.loc[~held, "n_loss_tokens"].sum()
    assert tokens.to_train(TrainConfig(epochs=3)) == 3 * tokens.loss_tokens
    short = TrainingTokens.from_manifest(frame, excluder(20), max_sample_tokens=30)
    assert short.samples == ((~held) & (frame["n_tokens"] <= 30)).sum()
    # max_steps: the share of the run's steps, counted as if packs were full (never less)
    run = TrainConfig(epochs=2, max_steps=1, max_tokens=64, batch_packs=2)
    steps = 2 * -(-tokens.tokens // 64 // 2)
    assert tokens.to_train(run) >= 2 * tokens.loss_tokens // steps
    longer = TrainConfig(epochs=2, max_steps=10**6, max_tokens=64, batch_packs=2)
    assert tokens.to_train(longer) == 2 * tokens.loss_tokens


def test_the_rate_is_the_checkpoints_measured_rate_per_rank(tmp_path):
    assert read_progress(tmp_path) is None and measured_rate_per_rank(None) is None
    (tmp_path / "progress.json").write_text(
        json.dumps({"step": 40, "total_steps": 100, "tokens_per_second": 900.0, "world_size": 3})
    )
    assert measured_rate_per_rank(read_progress(tmp_path)) == 300.0


def test_host_memory_counts_every_rank_and_on_cpu_the_whole_plan():
    from eagleflow.draft.model import DraftConfig
    from eagleflow.train.memory_plan import Workload, plan_memory

    cfg = DraftConfig(256, 1024, 4, 4, 64, 1024, 512, 3)
    gpu = plan_memory(cfg, Workload(8192, 3, 8, "cuda"))
    cpu = plan_memory(cfg, Workload(8192, 3, 1, "cpu"))
    one, eight = host_mem_mb(gpu, 4, 4, 1), host_mem_mb(gpu, 4, 4, 8)
    assert eight == pytest.approx(8 * one, abs=8) and one > 4096
    assert host_mem_mb(cpu, 4, 4, 1) > host_mem_mb(gpu, 4, 4, 1) + cpu.total / 2**20


# ---------------------------------------------------------------- progress


def test_progress_reports_tokens_steps_and_time_left(tmp_path):
    draft = draft_settings(
        {"epochs": 2, "max_steps": 0, "max_sample_tokens": 0, "tokens_per_second_per_rank": 100},
        data={"heldout_modulus": 20},
    )
    frame = manifest()
    before = training_progress(frame, tmp_path, draft, 2)
    per_epoch = TrainingTokens.from_manifest(frame, excluder(20)).loss_tokens
    assert before["tokens_total"] == 2 * per_epoch and before["step"] is None
    assert before["estimated_seconds"] == pytest.approx(2 * per_epoch / 200, abs=0.1)
    assert not before["rate_measured"]
    text = format_training_progress(before)
    assert "checkpoint: none yet" in text and "assumed: draft.tokens_per_second_per_rank" in text
    (tmp_path / "progress.json").write_text(
        json.dumps(
            {
                "step": 30,
                "total_steps": 60,
                "tokens_trained": per_epoch,
                "tokens_per_second": 1000.0,
                "world_size": 2,
            }
        )
    )
    after = training_progress(frame, tmp_path, draft, 4)
    assert after["tokens_to_do"] == per_epoch and after["rate_measured"]
    assert after["estimated_seconds"] == pytest.approx(per_epoch / (500 * 4), abs=0.1)
    text = format_training_progress(after)
    print(text)
    assert "step 30 of 60" in text and "measured by this run's checkpoints" in text


@pytest.mark.parametrize(
    "example, gpus",
    [
        ("deepseek-v3-tp8.yaml", 8),
        ("kimi-k2.5-tp8.yaml", 8),
        ("kimi-k2.5-tp8-pp2-2nodes.yaml", 8),
        ("qwen3-32b-tp4-extract-hidden-states.yaml", 4),
    ],
)
def test_the_gpu_examples_train_on_every_gpu_of_one_node(example, gpus):
    """Merged over the embedded default (as `--configfile` merges it), each GPU example trains
    one rank per GPU of a node, its global batch shared evenly, its recipe the anchors'."""
    from support.workflow_config import workflow_config

    config = workflow_config(example=example)
    draft = DraftSettings.from_config(config)
    job = TrainJob.from_settings(draft, config["extract"])
    assert (job.nodes, job.processes_per_node, job.device) == (1, gpus, "cuda")
    assert draft.train.batch_packs % job.ranks == 0 and draft.vocab_size == 32000
    assert job.slurm()["gpu"] == gpus and job.slurm()["tasks_per_node"] == gpus
    assert draft.train.lr <= 1e-4 and draft.train.max_tokens >= config["data"]["max_length"]


def test_preflight_refuses_a_draft_that_cannot_fit_before_any_rank_starts(tmp_path):
    """The memory plan at the target's shape and the longest pack, at the launch's world size:
    one sentence naming the key, as the trainer's own check gives it."""
    from eagleflow.draft.vocab import build_draft_vocab
    from eagleflow.train.memory_plan import MemoryPlanError
    from eagleflow.train.states import state_source
    from support.draft_fixtures import TINY_DRAFT, V, write_shard, write_target

    target = write_target(tmp_path / "target")
    shards = [write_shard(tmp_path / f"shard{i}.safetensors", 12, seed=i) for i in range(2)]
    vocab = build_draft_vocab(shards, V, 48)
    run = launch.Launch(1, 2, "cpu")
    shards = state_source(shards, None)  # stored states
    fits = TrainConfig(batch_packs=2, max_tokens=64, device="cpu")
    plan = preflight(shards, target, vocab, fits, TINY_DRAFT, run, print)
    assert plan.workload.world_size == 2 and plan.workload.max_tokens == 64
    tiny_device = TrainConfig(batch_packs=2, max_tokens=64, device="cpu", device_memory_gb=1e-6)
    with pytest.raises(MemoryPlanError, match=r"^Draft training needs .*draft\.") as e:
        preflight(shards, target, vocab, tiny_device, TINY_DRAFT, run, print)
    assert str(e.value).count(". ") == 0 and str(e.value).endswith(".")
    with pytest.raises(launch.LaunchError, match="draft.batch_packs = 3"):
        preflight(shards, target, vocab, TrainConfig(batch_packs=3), TINY_DRAFT, run, print)
