"""The GPU examples (TP=8) checked as far as a CPU allows: the config validates, the data shards
with the target's tokenizer, the fingerprint and the DAG build, and validate_env stops before
any model load with a one-sentence reason (no CUDA devices here)."""

import json

import pytest
import yaml

from support.workflow_runner import REPO, snakemake


@pytest.mark.parametrize(
    "example, devices",
    [
        ("deepseek-v3-tp8.yaml", "tensor_parallel_size=8 needs 8 CUDA devices on this node"),
        ("kimi-k2.5-tp8.yaml", "tensor_parallel_size=8 needs 8 CUDA devices on this node"),
        (
            "kimi-k2.5-tp8-pp2-2nodes.yaml",
            "tensor_parallel_size=8 x pipeline_parallel_size=2 on 2 nodes needs 8 CUDA devices "
            "on this node",
        ),
    ],
)
def test_gpu_example_plans_and_fails_fast_on_a_cpu_machine(
    example, devices, fake_deepseek_v3, tmp_path
):
    cfg = yaml.safe_load((REPO / "config" / "examples" / example).read_text())
    data = tmp_path / "train.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} plus 1?"},
                {"role": "assistant", "content": f"{i} plus 1 is {i + 1}."},
            ]
        }
        for i in range(50)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    override = {"target": {"path": str(fake_deepseek_v3)}, "data": {"path": str(data)}}
    for key in ("target", "data"):
        cfg[key].update(override[key])
    proc = snakemake(tmp_path, "prepare", config=cfg, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # The DAG built and sharding ran first, with the target's tokenizer.
    assert (tmp_path / "results" / "shards" / "manifest.parquet").is_file(), out[-3000:]
    log = next((tmp_path / "results" / "logs" / "validate_env").glob("*.log")).read_text()
    assert f"{devices}, 0 are visible" in log
    assert "[ok] layer_ids: [2, 30, 58, 61]" in log
    assert "capture_plan" not in " ".join(
        p.name for p in (tmp_path / "results" / "hidden").glob("*/*")
    )
    assert "validate_env" in out


@pytest.mark.parametrize("problem", ["does not exist", "has no config.json"])
def test_a_missing_target_is_one_sentence_before_the_dag(problem, tmp_path):
    target = tmp_path / "models" / "DeepSeek-V3"
    if problem == "has no config.json":
        target.mkdir(parents=True)
    work = tmp_path / "work"
    work.mkdir()
    proc = snakemake(work, "-n", "extract", config={"target": {"path": str(target)}}, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"target.path: {target} {problem}; set `target.path` in the config file" in out, out
    assert "Traceback" not in out and "InputFunctionException" not in out, out
    assert "Building DAG" not in out, out
