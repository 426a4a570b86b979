"""The extract_hidden_states strategy's file conversion, on files made the way vLLM 0.32's
ExampleHiddenStatesConnector makes them: states scattered into the cache-only layer's KV cache
by vLLM's own `basic_cache`, read back by its `extract_from_kv_cache` from the request's block
ids (as `_submit_async_write` computes the slots), written by its own `_write_tensors` under the
exclusive lock `wait_for_save` takes. Only the CUDA copy stream and pinned buffer are left out."""

import fcntl
import os
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors import safe_open
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)
from vllm.model_executor.models.extract_hidden_states import basic_cache

from eagleflow.capture.connector import ConnectorFileError, commit_from_connector, read_request_file
from eagleflow.capture.plan import Strategy
from eagleflow.data.conversations import Conversation
from eagleflow.data.shards import build_shards
from eagleflow.data.templating import Tokenized
from eagleflow.extract.shard import chunk_targets, finish_shard, prepare_shard_file
from eagleflow.store.chunks import ShardChunks
from eagleflow.store.headers import read_header
from support.synthetic import PLAN as SYNTHETIC_PLAN

BLOCK = 16
N_IDS, HIDDEN = 4, 32
PLAN = replace(
    SYNTHETIC_PLAN,
    strategy=Strategy.EXTRACT_HIDDEN_STATES,
    layer_ids=[2, 4, 5, 8],
    hidden_size=HIDDEN,
    fingerprint="fp",
)


class _Done:  # the CUDA event the connector waits on before writing; the copy here is synchronous
    def __init__(self, delay=0.0):
        self.delay = delay

    def synchronize(self):
        time.sleep(self.delay)


def connector_write(kv_cache, storage, req_id, prompt, block_ids, delay=0.0, background=False):
    """What the connector does for one finished request, with vLLM's own functions."""
    filename = os.path.join(storage, f"{req_id}.safetensors")
    # wait_for_save: the lock file exists, exclusively locked, before the client sees the path.
    os.makedirs(storage, exist_ok=True)
    lock_fd = os.open(filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    # _submit_async_write: slots of the request's blocks, rows read back, token ids from the prompt.
    block_ids_t = torch.tensor(block_ids, dtype=torch.long)
    slots = (torch.arange(BLOCK).reshape(1, BLOCK) + block_ids_t.reshape(-1, 1) * BLOCK).flatten()
    hs = extract_from_kv_cache(kv_cache, slots, len(prompt)).clone()
    tensors = {"hidden_states": hs, "token_ids": torch.tensor(prompt)}

    def write():
        ExampleHiddenStatesConnector._write_tensors(tensors, _Done(delay), filename, lock_fd)

    if background:
        t = threading.Thread(target=write)
        t.start()
        return filename, t
    write()
    return filename, None


def engine_run(tmp_path, prompts, block_table, seed=0):
    """The cache-only layer's KV cache after one forward over `prompts`:
    [blocks, n_ids, block, H]."""
    g = torch.Generator().manual_seed(seed)
    kv_cache = torch.zeros(16, N_IDS, BLOCK, HIDDEN, dtype=torch.bfloat16)
    truth = []
    for prompt, blocks in zip(prompts, block_table):
        states = torch.randn(len(prompt), N_IDS, HIDDEN, generator=g).to(torch.bfloat16)
        pos = torch.arange(len(prompt))
        slots = torch.tensor(blocks)[pos // BLOCK] * BLOCK + pos % BLOCK
        basic_cache(states, kv_cache, slots)
        truth.append(states)
    return kv_cache, truth


PROMPTS = [list(range(100, 121)), [7, 8, 9, 10, 11], list(range(300, 333))]
BLOCKS = [[3, 5], [1], [9, 2, 12]]  # not in order, as the allocator hands them out


def outputs_for(tmp_path, kv_cache, prompts=PROMPTS, blocks=BLOCKS, names=None):
    storage = str(tmp_path / "connector")
    outs = []
    for i, (p, b) in enumerate(zip(prompts, blocks)):
        engine_id = (names or {}).get(i, f"{i}-a1b2c3d4")
        path, _ = connector_write(kv_cache, storage, engine_id, p, b)
        outs.append(
            SimpleNamespace(request_id=str(i), kv_transfer_params={"hidden_states_path": path})
        )
    return outs


def shard_of(prompts):
    toks = [
        Tokenized(np.array(p, dtype=np.int64), np.ones(len(p), dtype=np.uint8)) for p in prompts
    ]
    convs = [Conversation(f"s{i}", (), "t", i) for i in range(len(prompts))]
    return build_shards(convs, toks, len(prompts), "t")[0]


def one_chunk(tmp_path, plan=PLAN, prompts=PROMPTS):
    """The shard of `prompts` as one chunk: its chunks, shard file and the chunk's target."""
    shard = shard_of(prompts)
    chunks = ShardChunks.plan(shard, "fp", tmp_path / "shard.safetensors", 10_000)
    shard_file = prepare_shard_file(chunks, plan, "bfloat16")
    return chunks, chunk_targets(chunks, plan, shard_file, 0)["0"]


def test_connector_files_become_rows_of_the_eagleflow_shard(tmp_path):
    kv_cache, truth = engine_run(tmp_path, PROMPTS, BLOCKS)
    outs = outputs_for(tmp_path, kv_cache)
    chunks, target = one_chunk(tmp_path)
    n = commit_from_connector(outs, PROMPTS, PLAN, torch.bfloat16, target)
    assert n == sum(map(len, PROMPTS)) and chunks.todo() == []  # committed by its marker
    # The connector's files and locks are gone once the chunk is committed.
    assert os.listdir(tmp_path / "connector") == []

    # Finished like any other strategy's shard: same keys, dtypes and layout, states bit for
    # bit in prompt order.
    out = tmp_path / "shard.safetensors"
    finish_shard(chunks, out)
    with safe_open(str(out), framework="pt") as f:
        assert torch.equal(f.get_tensor("hidden_states"), torch.cat(truth))
        assert f.get_tensor("input_ids").tolist() == sum(PROMPTS, [])
    header, _ = read_header(out)
    layout = {k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"}
    assert layout == {
        "hidden_states": ("BF16", [59, N_IDS, HIDDEN]),
        "input_ids": ("I64", [59]),
        "loss_mask": ("U8", [59]),
        "offsets": ("I64", [4]),
    }
    assert header["__metadata__"]["capture_strategy"] == "extract_hidden_states"
    assert header["__metadata__"]["layer_id_convention"] == "vllm"


def test_a_write_in_flight_is_waited_for(tmp_path):
    kv_cache, truth = engine_run(tmp_path, PROMPTS[:1], BLOCKS[:1])
    path, writer = connector_write(
        kv_cache, str(tmp_path / "c"), "0-x", PROMPTS[0], BLOCKS[0], delay=0.5, background=True
    )
    t0 = time.perf_counter()
    data = read_request_file(path)  # sleeps on the lock until the writer releases it
    assert time.perf_counter() - t0 > 0.3
    assert torch.equal(data["hidden_states"], truth[0])
    writer.join(timeout=60)
    assert not writer.is_alive()


def test_mismatches_are_refused_naming_the_request(tmp_path):
    kv_cache, _ = engine_run(tmp_path, PROMPTS, BLOCKS)
    chunks, target = one_chunk(tmp_path)
    # Tokens that are not the sample's.
    outs = outputs_for(tmp_path / "a", kv_cache)
    wrong = [PROMPTS[0], [7, 8, 9, 10, 12], PROMPTS[2]]
    with pytest.raises(ConnectorFileError, match="token ids differ from the sample's tokens"):
        commit_from_connector(outs, wrong, PLAN, torch.bfloat16, target)
    # A file named after another request (rows of one request in another's sample).
    outs = outputs_for(tmp_path / "b", kv_cache, names={1: "2-ffff0000"})
    with pytest.raises(ConnectorFileError, match="request 1: its hidden states file .*2-ffff0000"):
        commit_from_connector(outs, PROMPTS, PLAN, torch.bfloat16, target)
    # Another layer count than planned.
    outs = outputs_for(tmp_path / "c", kv_cache)
    with pytest.raises(
        ConnectorFileError, match=r"shape \[21, 4, 32\], expected \[tokens, 3, 32\]"
    ):
        commit_from_connector(
            outs, PROMPTS, replace(PLAN, layer_ids=[2, 4, 8]), torch.bfloat16, target
        )
    # Another dtype than the engine's.
    with pytest.raises(ConnectorFileError, match="bfloat16, the engine's dtype is torch.float16"):
        commit_from_connector(outs, PROMPTS, PLAN, torch.float16, target)
    # No connector at all.
    bare = [SimpleNamespace(request_id="0", kv_transfer_params=None)]
    with pytest.raises(
        ConnectorFileError,
        match="no hidden_states_path .*not started with ExampleHiddenStatesConnector",
    ):
        commit_from_connector(bare, PROMPTS[:1], PLAN, torch.bfloat16, target)
    # A file that never came.
    gone = [
        SimpleNamespace(
            request_id="0",
            kv_transfer_params={"hidden_states_path": str(tmp_path / "0-z.safetensors")},
        )
    ]
    with pytest.raises(ConnectorFileError, match="wrote no file"):
        commit_from_connector(gone, PROMPTS[:1], PLAN, torch.bfloat16, target)
    assert chunks.todo() == [0]  # nothing committed
