"""Write-once storage (eagleflow.store.shardfile): the shard file is created in its final layout,
chunks are written into it in place and committed by markers, finishing links it into place."""

import os
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open

from eagleflow.capture.plan import Stage
from eagleflow.extract.shard import chunk_targets, finish_shard, prepare_shard_file
from eagleflow.store.chunks import ShardChunks
from eagleflow.store.direct_io import ALIGN
from eagleflow.store.headers import file_sha256
from eagleflow.store.quant import FP8, SCALES_KEY, dequantize, quantize
from eagleflow.store.verify import Expected, verify_shard
from support.synthetic import FP, PLAN, make_token_shards

# Two capturing pipeline stages: ids 2 on stage 0, ids 4, 5, 8 on stage 1.
PP2 = replace(
    PLAN,
    pipeline_parallel_size=2,
    stages=(Stage(0, 0, 4, (2,)), Stage(1, 4, 8, (4, 5, 8))),
)


@pytest.fixture
def shard(tokenizer):
    return make_token_shards(tokenizer, n=8, size=8)[0]


def states_for(chunks, i, seed=0):
    lo, hi = chunks.token_range(i)
    g = torch.Generator().manual_seed(seed + i)
    return torch.randn(hi - lo, len(PLAN.layer_ids), PLAN.hidden_size, generator=g).bfloat16()


def test_the_file_is_created_in_its_final_layout_and_kept_across_runs(shard, tmp_path):
    out = tmp_path / "hidden" / f"{shard.shard_id}.safetensors"
    chunks = ShardChunks.plan(shard, FP, out, 64)
    shard_file = prepare_shard_file(chunks, PLAN, "bfloat16")
    assert chunks.shard_file.stat().st_size == shard_file.size
    # The states start on a page: whole rows go to disk straight from aligned memory.
    assert shard_file.spans["hidden_states"][0] % ALIGN == 0
    with safe_open(str(chunks.shard_file), framework="pt") as f:  # a valid safetensors file
        assert f.get_slice("hidden_states").get_shape() == [len(shard.input_ids), 4, 16]
        assert f.get_tensor("input_ids").tolist() == shard.input_ids.tolist()
        assert f.get_tensor("offsets").tolist() == shard.offsets.tolist()
    assert chunks.todo() == list(range(len(chunks.ranges)))
    (target,) = chunk_targets(chunks, PLAN, shard_file, 0).values()
    target.commit(states_for(chunks, 0), None)
    assert chunks.todo() == list(range(1, len(chunks.ranges)))
    # A rerun keeps the file and what it holds.
    inode = chunks.shard_file.stat().st_ino
    prepare_shard_file(chunks, PLAN, "bfloat16")
    assert chunks.shard_file.stat().st_ino == inode and chunks.todo()[0] == 1
    # Another layout (here fp8 storage) is never written into: markers dropped, file anew.
    prepare_shard_file(chunks, replace(PLAN, storage_dtype=FP8), "bfloat16")
    assert chunks.shard_file.stat().st_ino != inode
    assert chunks.todo() == list(range(len(chunks.ranges)))


def test_rows_without_their_marker_are_not_committed(shard, tmp_path):
    chunks = ShardChunks.plan(shard, FP, tmp_path / "s.safetensors", 64)
    shard_file = prepare_shard_file(chunks, PLAN, "bfloat16")
    (target,) = chunk_targets(chunks, PLAN, shard_file, 0).values()
    # A kill between the rows and the marker: the rows are there, the chunk is not committed.
    lo, _ = chunks.token_range(0)
    shard_file.write_rows(lo, 0, states_for(chunks, 0), None)
    assert 0 in chunks.todo()
    # A marker of another extraction (fingerprint) or another chunk does not count either.
    target.commit(states_for(chunks, 0), None)
    marker = chunks.path(0)
    marker.write_text(marker.read_text().replace(FP, "ffffffffffffffff"))
    assert 0 in chunks.todo()
    os.replace(marker, chunks.path(1))
    assert {0, 1} <= set(chunks.todo())
    # Finishing refuses a shard with uncommitted chunks, naming them.
    with pytest.raises(RuntimeError, match=r"chunks \[0, 1, .*are not committed"):
        finish_shard(chunks, tmp_path / "s.safetensors")
    assert not (tmp_path / "s.safetensors").exists()


@pytest.mark.parametrize("storage", ["bfloat16", FP8])
def test_stage_columns_written_apart_equal_whole_rows(shard, tmp_path, storage):
    """Two pipeline stages writing their columns of every chunk give the file that whole rows
    give; finishing links (no copy) and verification hashes the same bytes."""
    files = {}
    for name, plan in (("pp1", PLAN), ("pp2", PP2)):
        plan = replace(plan, storage_dtype=storage)
        out = tmp_path / name / f"{shard.shard_id}.safetensors"
        stages = tuple(s.rank for s in plan.capturing_stages)
        chunks = ShardChunks.plan(shard, FP, out, 64, stages)
        shard_file = prepare_shard_file(chunks, plan, "bfloat16")
        for i in range(len(chunks.ranges)):
            hs = states_for(chunks, i)
            for target in chunk_targets(chunks, plan, shard_file, i).values():
                cols = slice(target.column, target.column + len(target.metadata["layer_ids"]))
                part = hs[:, cols]
                if storage == FP8:
                    target.commit(*quantize(part))
                else:
                    target.commit(part, None)
        assert len(list(chunks.partial_dir.glob("chunk-*.json"))) == len(chunks.ranges) * len(
            stages or [0]
        )
        size = finish_shard(chunks, out)
        assert os.path.samefile(out, chunks.shard_file) and size == out.stat().st_size
        files[name] = out
    assert file_sha256(files["pp1"]) == file_sha256(files["pp2"])
    with safe_open(str(files["pp2"]), framework="pt") as f:
        got = f.get_tensor("hidden_states")
        if storage == FP8:
            got = dequantize(got, f.get_tensor(SCALES_KEY))
    chunks = ShardChunks.plan(shard, FP, files["pp2"], 64)
    want = torch.cat([states_for(chunks, i) for i in range(len(chunks.ranges))]).float()
    tolerance = 0.07 if storage == FP8 else 0.0  # e4m3: 3 mantissa bits
    assert float(((got.float() - want).norm(dim=-1) / want.norm(dim=-1)).max()) <= tolerance
    # Verification reads the file once and hashes it on the way.
    record = {"bytes": files["pp2"].stat().st_size, "fingerprint": FP, "shard_id": shard.shard_id}
    result = verify_shard(
        files["pp2"], shard, record, Expected.of(replace(PLAN, storage_dtype=storage), "bfloat16")
    )
    assert result["ok"], result["problems"]
    assert result["sha256"] == file_sha256(files["pp2"])
