"""Pipeline-parallel capture (PP=2) against one stage (PP=1) on real vLLM (CPU), and against the
float32 transformers reference: every layer id, including the first layer of the second stage
and the final pre-norm state L, and the tokens.

The embedded default target has 8 layers and captures ids [2, 4, 5, 8]; vLLM 0.32 splits it
into layers 0..3 and 4..7, so stage 0 captures id 2 and stage 1 ids 4 (its first layer), 5, 8.
"""

import json
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open

from eagleflow.capture.plan import CapturePlan, make_plan
from eagleflow.capture.reference import load_reference_model
from eagleflow.engine.settings import EngineSettings
from eagleflow.target.layers import default_layer_ids
from support.references import (
    Engines,
    assert_matches_reference,
    assert_same_states,
    capture,
    rel_err,
)
from support.workflow_runner import (
    SMALL,
    copy_workdir,
    hidden_dir,
    job_counts,
    merged,
    snakemake,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def deepseek(reference_deepseek):
    return reference_deepseek


def test_pp2_gives_the_same_states_and_tokens_as_pp1_and_matches_the_reference(deepseek, tmp_path):
    info, shard = deepseek.info, deepseek.shard
    ids = default_layer_ids(info.num_layers)
    plans = {
        pp: replace(make_plan(info, ids, "auto", pipeline_parallel_size=pp), fingerprint="test")
        for pp in (1, 2)
    }
    stages = plans[2].stages
    assert [(s.start_layer, s.end_layer, s.layer_ids) for s in stages] == [
        (0, 4, (2,)),
        (4, 8, (4, 5, 8)),
    ]
    # vLLM 0.32's stages before the last drop the model's own aux states.
    assert plans[1].strategy == "aux_layers" and plans[2].strategy == "patched_forward"
    engines = Engines()
    got = {}
    try:
        for pp in (1, 2):
            settings = EngineSettings(
                target=str(deepseek.path),
                pipeline_parallel_size=pp,
                max_model_len=600,
                max_num_batched_tokens=2048,
            )
            llm = engines.get(f"pp{pp}", settings)
            got[pp] = capture(llm, shard, plans[pp], tmp_path / f"pp{pp}")
    finally:
        engines.close()
    s1, t1, f1 = got[1].states, got[1].input_ids, got[1].chunk_files
    s2, t2, f2 = got[2].states, got[2].input_ids, got[2].chunk_files
    # One marker per chunk and capturing stage, each stage writing its own columns.
    assert f1 == [f"chunk-{i:05d}.json" for i in range(len(f1))]
    assert f2 == sorted(f"chunk-{i:05d}.stage-{s}.json" for i in range(len(f1)) for s in (0, 1))
    assert torch.equal(t1, t2) and torch.equal(t2, torch.from_numpy(shard.input_ids))
    assert s1.shape == s2.shape == (len(shard.input_ids), len(ids), info.hidden_size)
    for j, k in enumerate(ids):
        rel = rel_err(s2[:, j : j + 1], s1[:, j : j + 1])
        print(
            f"PP=2 vs PP=1, id {k}: max abs diff {float((s2[:, j] - s1[:, j]).abs().max()):.4f}, "
            f"median rel {float(rel.median()):.5f}, p99 rel {float(rel.quantile(0.99)):.4f}"
        )
        assert_same_states(s2[:, j : j + 1], s1[:, j : j + 1], f"PP=2 vs PP=1, id {k}")
    assert_matches_reference(load_reference_model(deepseek.path), s2, shard, ids)


def test_snakemake_extract_at_pp2_gives_the_shards_of_pp1(
    prepared_workdir, extracted_workdir, tmp_path
):
    """`snakemake extract` with extract.pipeline_parallel_size: 2 on a copy of the prepared
    small default (planned and validated at PP=1): validation re-runs for the new layout and
    every shard is extracted in the same run (Snakemake used to drop them across the ancient()
    edges: common.smk, extraction_summary); the same fingerprint, shard files, layer ids and
    tokens as the shared PP=1 run, states within the engine's bf16 run-to-run noise."""
    work = copy_workdir(prepared_workdir, tmp_path / "pp2")
    config = merged(SMALL, {"extract": {"pipeline_parallel_size": 2}})
    proc = snakemake(work, "extract", config=config)
    counts = job_counts(proc.stdout + proc.stderr)
    assert counts.get("validate_env") == 1 and counts.get("extract_shard") == 4, counts
    one, two = hidden_dir(extracted_workdir), hidden_dir(work)
    assert one.name == two.name  # the fingerprint does not depend on the layout
    names = sorted(p.name for p in one.glob("*.safetensors"))
    assert names and names == sorted(p.name for p in two.glob("*.safetensors"))
    # The stored plan is the fingerprint's (PP=1); each job plans its stages for PP=2.
    assert CapturePlan.load(two / "capture_plan.json").pipeline_parallel_size == 1
    records = [json.loads((two / n).with_suffix(".json").read_text()) for n in names]
    assert all(r["strategy"] == "patched_forward" for r in records), records
    for name in names:
        with (
            safe_open(str(one / name), framework="pt") as a,
            safe_open(str(two / name), framework="pt") as b,
        ):
            ma, mb = a.metadata(), b.metadata()
            for key in ("layer_ids", "layer_id_convention", "sample_ids", "fingerprint"):
                assert ma[key] == mb[key], key
            for key in ("input_ids", "loss_mask", "offsets"):
                assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key
            s1, s2 = a.get_tensor("hidden_states"), b.get_tensor("hidden_states")
        for j, k in enumerate(json.loads(ma["layer_ids"])):
            assert_same_states(s2[:, j : j + 1], s1[:, j : j + 1], f"{name} id {k}")
    log = next((work / "results" / "logs" / "extract" / two.name).glob("*.log")).read_text()
    assert "pipeline stage 1: layers 4..7, captures ids [4, 5, 8]" in log
