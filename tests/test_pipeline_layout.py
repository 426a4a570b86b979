"""Pipeline-parallel layout without an engine: which stage owns which layer ids (read from the
installed vLLM), the sentences that stop a run before any load, the chunk files per stage,
and the settings and fingerprint."""

import json

import numpy as np
import pytest
import yaml

from eagleflow.capture.plan import (
    ARCHITECTURES,
    CaptureCheckError,
    CapturePlan,
    Stage,
    check_plan,
    introspect,
    make_plan,
    pipeline_stages,
    plan_for_pipeline,
)
from eagleflow.data.conversations import Conversation
from eagleflow.data.shards import build_shards
from eagleflow.data.templating import Tokenized
from eagleflow.engine.settings import EngineSettings, cpu_threads_bind
from eagleflow.extract.fingerprint import config_fingerprint
from eagleflow.extract.preflight import check_devices, check_nodes, check_stages
from eagleflow.store.chunks import ShardChunks
from eagleflow.target.info import read_target

DEEPSEEK = ARCHITECTURES["DeepseekV3ForCausalLM"]


@pytest.fixture
def deepseek_info(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 8, '
        '"hidden_size": 256, "vocab_size": 1024, "kv_lora_rank": 512}'
    )
    return read_target(tmp_path)


def test_stages_own_the_ids_of_their_layers_and_the_last_owns_L():
    # id k = residual stream entering layer k: the first layer of stage 1 (4) is stage 1's.
    assert pipeline_stages(8, [2, 4, 5, 8], 2) == (
        Stage(0, 0, 4, (2,)),
        Stage(1, 4, 8, (4, 5, 8)),
    )
    # Kimi-K2.5 / DeepSeek-V3: 61 layers; vLLM gives the odd layer to the stage before the last.
    assert pipeline_stages(61, [2, 30, 58, 61], 2) == (
        Stage(0, 0, 31, (2, 30)),
        Stage(1, 31, 61, (58, 61)),
    )
    assert [s.layer_ids for s in pipeline_stages(8, [2, 4, 5, 8], 4)] == [(), (2,), (4, 5), (8,)]
    assert pipeline_stages(8, [0, 8], 1) == (Stage(0, 0, 8, (0, 8)),)


def test_stages_follow_vllms_partition_override(monkeypatch):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "3,5")
    assert pipeline_stages(8, [2, 3, 8], 2) == (Stage(0, 0, 3, (2,)), Stage(1, 3, 8, (3, 8)))
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "3,4")
    with pytest.raises(CaptureCheckError, match="VLLM_PP_LAYER_PARTITION"):
        pipeline_stages(8, [2], 2)


def test_more_stages_than_layers_stop_the_plan_with_one_sentence():
    with pytest.raises(CaptureCheckError, match=r"is 9 but the target has 8 .* at most 8 stages"):
        pipeline_stages(8, [2], 9)
    check = check_stages(9, 8)
    assert not check.ok and "use at most 8 stages" in check.detail
    assert check_stages(2, 8).ok


def test_auto_picks_the_patched_forward_for_pp_and_aux_layers_is_refused(deepseek_info):
    found = introspect(DEEPSEEK)
    # vLLM 0.32: stages before the last return IntermediateTensors without their aux states.
    assert found["aux_kept_on_inner_stages"] is False
    assert make_plan(deepseek_info, [2, 4, 5, 8], "auto").strategy == "aux_layers"
    plan = make_plan(deepseek_info, [2, 4, 5, 8], "auto", pipeline_parallel_size=2)
    assert plan.strategy == "patched_forward" and plan.pipeline_parallel_size == 2
    assert [s.rank for s in plan.capturing_stages] == [0, 1]
    assert "pipeline stage 1: layers 4..7, captures ids [4, 5, 8]" in plan.checks_passed
    with pytest.raises(CaptureCheckError, match="without their aux states"):
        check_plan("aux_layers", found, [2, 4], 8, DEEPSEEK, pipeline_parallel_size=2)
    with pytest.raises(CaptureCheckError, match="one pipeline stage only"):
        check_plan(
            "extract_hidden_states", found, [2, 4], 8, DEEPSEEK, "cuda", pipeline_parallel_size=2
        )


def test_plan_round_trips_its_stages_and_is_re_planned_for_another_layout(deepseek_info, tmp_path):
    plan = make_plan(deepseek_info, [2, 4, 5, 8], "auto", pipeline_parallel_size=2)
    plan.save(tmp_path / "plan.json")
    again = CapturePlan.load(tmp_path / "plan.json")
    assert again == plan and isinstance(again.stages[1], Stage)
    assert json.loads((tmp_path / "plan.json").read_text())["stages"][1]["layer_ids"] == [4, 5, 8]
    one = plan_for_pipeline(plan.__class__(**{**vars(plan), "fingerprint": "fp"}), deepseek_info, 1)
    assert one.pipeline_parallel_size == 1 and one.strategy == "aux_layers"
    assert one.fingerprint == "fp" and len(one.stages) == 1
    assert plan_for_pipeline(plan, deepseek_info, 2) is plan


def _shard(lengths):
    toks = [Tokenized(np.arange(n, dtype=np.int64), np.ones(n, dtype=np.uint8)) for n in lengths]
    convs = [Conversation(f"c{i}", (), "t", i) for i in range(len(lengths))]
    return build_shards(convs, toks, len(convs), "t")[0]


def test_chunk_markers_per_capturing_stage(tmp_path):
    shard = _shard([5, 7, 9])
    single = ShardChunks.plan(shard, "fp", tmp_path / "s.safetensors", 10)
    assert [p.name for p in single.paths(0)] == ["chunk-00000.json"]
    # One capturing stage: the same marker name as without a pipeline.
    assert ShardChunks.plan(shard, "fp", tmp_path / "s.safetensors", 10, (1,)).stages == ()
    staged = ShardChunks.plan(shard, "fp", tmp_path / "s.safetensors", 10, (0, 1))
    assert [p.name for p in staged.paths(2)] == [
        "chunk-00002.stage-0.json",
        "chunk-00002.stage-1.json",
    ]
    assert staged.todo() == [0, 1, 2]


def test_devices_count_tp_times_pp():
    checks = check_devices("cuda", 8, 600 << 30, 1, 0.9, pp=2)
    assert not checks[0].ok
    assert checks[0].detail == (
        "tensor_parallel_size=8 x pipeline_parallel_size=2 needs 16 CUDA devices on this node, "
        "0 are visible; run on nodes with 16 GPUs or lower extract.tensor_parallel_size or "
        "extract.pipeline_parallel_size"
    )
    # Two nodes: this node needs its half.
    two = check_devices("cuda", 8, 600 << 30, 1, 0.9, pp=2, nodes=2)
    assert "needs 8 CUDA devices on this node" in two[0].detail and "on 2 nodes" in two[0].detail
    assert check_nodes(8, 2, 2).ok
    bad = check_nodes(8, 1, 3)
    assert not bad.ok and bad.detail == (
        "extract.nodes is 3 but tensor_parallel_size=8 makes 8 workers, which do not share out "
        "evenly over 3 nodes; use a number of nodes that divides 8"
    )
    cpu = check_devices("cpu", 1, 1 << 20, 1, 0.9, pp=64)
    assert not cpu[0].ok and "needs at least 64 CPU cores (one per worker)" in cpu[0].detail


def full_config() -> dict:
    """config/config.yaml with the schema's defaults filled in, as the workflow reads it."""
    from snakemake.utils import validate

    config = yaml.safe_load(open("config/config.yaml"))
    validate(config, "workflow/schemas/config.schema.yaml", set_default=True)
    return config


def test_settings_count_every_worker(tmp_path):
    config = full_config()
    config["extract"]["pipeline_parallel_size"] = 2
    s = EngineSettings.from_config(config, "extract")
    assert s.pipeline_parallel_size == 2 and s.world_size == 2 and not s.single_process
    regen = EngineSettings.from_config(config, "regenerate")
    assert regen.pipeline_parallel_size == 2
    assert cpu_threads_bind(2, "0|1") == "0|1"
    assert len(cpu_threads_bind(2, None).split("|")) == 2


def test_fingerprint_does_not_depend_on_the_parallelism(fake_deepseek_v3):
    config = full_config()
    config["target"]["path"] = str(fake_deepseek_v3)
    config["capture"]["layer_ids"] = None
    prints = set()
    for tp, pp in ((1, 1), (8, 1), (8, 2)):
        config["extract"] |= {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}
        prints.add(config_fingerprint(config)[0])
    assert len(prints) == 1
