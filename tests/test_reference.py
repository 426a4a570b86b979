"""Capture correctness against an independent reference (transformers, float32, same weights),
across strategies, tensor-parallel degrees, a llama_4_scaling config and dense targets (Llama,
Qwen3), and vLLM's own extract_hidden_states strategy.

Engine starts dominate this module's time, so targets, shards and engines are module-scoped
and shared: `engines` keeps one engine alive at a time and hands the same one to every test
that asks for the same target and settings; the DeepSeek target's aux_layers capture of the
mixed shard is computed once and reused as the baseline.
"""

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from eagleflow.capture.connector import engine_kwargs
from eagleflow.capture.plan import make_plan
from eagleflow.capture.reference import (
    load_reference_model,
    reference_states,
)
from eagleflow.data.conversations import Conversation
from eagleflow.data.shards import build_shards
from eagleflow.data.templating import Tokenized
from eagleflow.embedded.tiny_target import build_tiny_target
from eagleflow.engine.settings import EngineSettings
from eagleflow.target.info import read_target
from eagleflow.target.layers import default_layer_ids
from support.dense_targets import build_tiny_llama_target, build_tiny_qwen3_target
from support.references import (
    Engines,
    assert_matches_reference,
    assert_same_states,
    build,
    capture,
    reference_corpus,
    rel_err,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def corpus():
    return reference_corpus()


def settings(target, tp=1):
    return EngineSettings(
        target=str(target), tensor_parallel_size=tp, max_model_len=600, max_num_batched_tokens=2048
    )


def weights_sha256(path) -> str:
    return hashlib.sha256((Path(path) / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def engines():
    e = Engines()
    yield e
    e.close()


@pytest.fixture(scope="module")
def deepseek(reference_deepseek):
    return reference_deepseek


@pytest.fixture(scope="module")
def deepseek_aux(deepseek, engines, tmp_path_factory):
    """The DeepSeek target's aux_layers capture of the mixed shard, default ids (the baseline)."""
    plan = make_plan(deepseek.info, default_layer_ids(deepseek.info.num_layers), "aux_layers")
    return capture(
        engines.get("deepseek", settings(deepseek.path)),
        deepseek.shard,
        plan,
        tmp_path_factory.mktemp("aux"),
    ).states


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, corpus):
    return build(build_tiny_qwen3_target, corpus, tmp_path_factory.mktemp("qwen3"))


def test_deepseek_both_strategies_match_the_reference_and_each_other(
    deepseek, deepseek_aux, engines, tmp_path
):
    info, shard, aux = deepseek.info, deepseek.shard, deepseek_aux
    ids = default_layer_ids(info.num_layers)
    llm = engines.get("deepseek", settings(deepseek.path))
    patched = capture(
        llm, shard, make_plan(info, ids, "patched_forward"), tmp_path / "patched"
    ).states
    # Repeated calls on the same engine give the same rows.
    again = capture(llm, shard, make_plan(info, ids, "aux_layers"), tmp_path / "again").states
    # id 0 (the embeddings) only the patched forward can capture.
    zero_plan = make_plan(info, [0, *ids], "auto")
    assert zero_plan.strategy == "patched_forward"
    with_zero = capture(llm, shard, zero_plan, tmp_path / "zero").states
    assert_same_states(patched, aux, "patched_forward vs aux_layers")
    assert_same_states(again, aux, "a repeated call on the same engine")
    model = load_reference_model(deepseek.path)
    assert_matches_reference(model, aux, shard, ids)
    assert_matches_reference(model, with_zero, shard, [0, *ids])
    # The final id is the pre-norm state: transformers' last output_hidden_states entry
    # (post-norm) is far from it.
    a, b = int(shard.offsets[1]), int(shard.offsets[2])
    with torch.no_grad():
        post = model(
            input_ids=torch.as_tensor(shard.input_ids[a:b])[None], output_hidden_states=True
        ).hidden_states[-1][0]
    pre = reference_states(model, shard.input_ids[a:b], [info.num_layers])[:, 0]
    final = aux[a:b, -1].float()
    rel = lambda x, y: float(((x - y).norm(dim=-1) / y.norm(dim=-1)).median())  # noqa: E731
    assert rel(final, pre) < 0.05 and rel(final, post) > 0.5


def test_deepseek_with_sharp_attention_matches_the_reference(deepseek, engines, tmp_path):
    """The random target's attention is near uniform, which hides how keys and positions are used.
    Scaling every query projection by 24 makes attention sharp without training; transformers
    in bf16 stays within 0.01 of float32 on the layers checked, so the reference check tells a
    wrong attention from rounding: a wrong rotary embedding, such as vLLM 0.32's CPU kernel
    without eagleflow's fix (eagleflow.engine.vllm_fixes), fails it."""
    from safetensors.torch import load_file, save_file

    sharp = shutil.copytree(deepseek.path, tmp_path / "sharp")
    weights = load_file(str(sharp / "model.safetensors"))
    for name in [n for n in weights if n.endswith("q_b_proj.weight")]:
        weights[name] = (weights[name].float() * 24).to(torch.bfloat16)
    save_file(weights, str(sharp / "model.safetensors"), metadata={"format": "pt"})
    ids = [2, 4]
    plan = make_plan(deepseek.info, ids, "aux_layers")
    states = capture(
        engines.get("deepseek-sharp", settings(sharp)), deepseek.shard, plan, tmp_path / "out"
    ).states
    assert_matches_reference(load_reference_model(sharp), states, deepseek.shard, ids)


def test_tp2_gives_the_same_states_as_tp1(deepseek, engines, tmp_path):
    info, shard = deepseek.info, deepseek.shard
    shard = build_shards(
        [Conversation(s, (), "t", i) for i, s in enumerate(shard.sample_ids[:4])],
        [Tokenized(*shard.sample(i)) for i in range(4)],
        4,
        "t",
    )[0]  # 501 tokens: TP=2 is slow here
    plan = make_plan(info, default_layer_ids(info.num_layers), "auto")
    states = {}
    for tp in (1, 2):
        llm = engines.get("deepseek" if tp == 1 else "deepseek-tp2", settings(deepseek.path, tp))
        states[tp] = capture(llm, shard, plan, tmp_path / f"tp{tp}", chunk_tokens=100).states
    rel = rel_err(states[2], states[1])
    print(
        f"TP=2 vs TP=1: max abs diff "
        f"{float((states[2].float() - states[1].float()).abs().max()):.4f}, "
        f"median rel {float(rel.median()):.5f}, p99 rel {float(rel.quantile(0.99)):.4f}"
    )
    # Same tolerance as against the float32 reference: TP changes only reduction order.
    assert float(rel.median()) < 0.05
    assert_matches_reference(load_reference_model(deepseek.path), states[2], shard, plan.layer_ids)


def test_llama_4_scaling_is_applied_by_both_strategies(
    deepseek, deepseek_aux, engines, corpus, tmp_path
):
    """A DeepseekV3 config with Mistral-Large-3's llama_4_scaling: the model's own aux capture and
    eagleflow's patched forward agree; the same weights without the scaling give other states."""
    scaled = build(build_tiny_target, corpus, tmp_path / "scaled")
    cfg = json.loads((scaled.path / "config.json").read_text())
    cfg["llama_4_scaling"] = {"original_max_position_embeddings": 32, "beta": 0.8}
    (scaled.path / "config.json").write_text(json.dumps(cfg))
    info = read_target(scaled.path)
    # The unscaled run is the shared DeepSeek baseline: the same weights and tokens, only the
    # config differs.
    assert weights_sha256(scaled.path) == weights_sha256(deepseek.path)
    assert np.array_equal(scaled.shard.input_ids, deepseek.shard.input_ids)
    shard, unscaled = scaled.shard, deepseek_aux
    ids = default_layer_ids(info.num_layers)
    llm = engines.get("scaled", settings(scaled.path))
    aux = capture(llm, shard, make_plan(info, ids, "aux_layers"), tmp_path / "s-aux").states
    patched = capture(
        llm, shard, make_plan(info, ids, "patched_forward"), tmp_path / "s-patched"
    ).states
    assert_same_states(patched, aux, "patched_forward vs aux_layers with llama_4_scaling")
    # Positions below 32 are unscaled either way; beyond, the scaling changes the states.
    a, b = int(shard.offsets[1]), int(shard.offsets[2])  # the 480-token sample
    early = rel_err(aux[a : a + 32], unscaled[a : a + 32]).median()
    late = rel_err(aux[a + 64 : b], unscaled[a + 64 : b]).median()
    print(
        f"with vs without llama_4_scaling: positions < 32 median rel {float(early):.5f}, "
        f"positions >= 64 median rel {float(late):.4f}"
    )
    # The scaling's effect must stand well clear of the engine's own run-to-run noise, measured
    # above on the same config (patched vs aux).
    noise = float(rel_err(patched, aux).median())
    assert float(early) < 0.02 and float(late) > max(0.03, 4 * noise)


def test_dense_llama_target_through_the_same_path(engines, corpus, tmp_path):
    llama = build(build_tiny_llama_target, corpus, tmp_path / "llama")
    ids = [0, *default_layer_ids(llama.info.num_layers)]
    plan = make_plan(llama.info, ids, "auto")
    assert plan.strategy == "aux_layers"
    states = capture(
        engines.get("llama", settings(llama.path)), llama.shard, plan, tmp_path / "out"
    ).states
    assert_matches_reference(load_reference_model(llama.path), states, llama.shard, ids)


@pytest.fixture(scope="module")
def qwen3_aux(qwen3, engines, tmp_path_factory):
    ids = [0, *default_layer_ids(qwen3.info.num_layers)]
    plan = make_plan(qwen3.info, ids, "auto")
    assert plan.strategy == "aux_layers" and plan.introspection["model_class"].endswith(
        "qwen3.Qwen3ForCausalLM"
    )
    return capture(
        engines.get("qwen3", settings(qwen3.path)),
        qwen3.shard,
        plan,
        tmp_path_factory.mktemp("qwen3-aux"),
    ).states


def test_dense_qwen3_target_through_the_same_path(qwen3, qwen3_aux, tmp_path_factory):
    ids = [0, *default_layer_ids(qwen3.info.num_layers)]
    stats = assert_matches_reference(load_reference_model(qwen3.path), qwen3_aux, qwen3.shard, ids)
    out = tmp_path_factory.getbasetemp() / "qwen3_reference.json"
    out.write_text(json.dumps([s.__dict__ for s in stats], indent=1))


def test_extract_hidden_states_end_to_end_on_cpu(qwen3, qwen3_aux, engines, tmp_path, monkeypatch):
    """vLLM's own extract_hidden_states through eagleflow's extraction code, on the CPU: vLLM's
    proposer, cache-only KV layer and connector, with only the connector's two CUDA-only calls
    replaced (tests/support/cpu_hidden_states_connector.py). The capture plan itself refuses
    CPU, so the plan is the one a GPU node makes."""
    from eagleflow.capture.plan import CaptureCheckError

    ids = [0, *default_layer_ids(qwen3.info.num_layers)]
    with pytest.raises(CaptureCheckError, match="extract.device is 'cpu'"):
        make_plan(qwen3.info, ids, "extract_hidden_states", device="cpu")
    plan = make_plan(qwen3.info, ids, "extract_hidden_states", device="cuda")
    # The connector class is imported inside vLLM's (spawned) processes.
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    )
    kwargs = engine_kwargs(
        plan,
        tmp_path / "connector",
        connector="CPUHiddenStatesConnector",
        connector_module_path="support.cpu_hidden_states_connector",
    )
    llm = engines.get("qwen3-extract-hidden-states", settings(qwen3.path), kwargs)
    states = capture(llm, qwen3.shard, plan, tmp_path / "out").states
    assert not list((tmp_path / "connector").glob("*.safetensors*"))  # every request file converted
    # The same shard layout and the same states as the aux_layers strategy, and the reference.
    assert states.shape == qwen3_aux.shape and states.dtype == qwen3_aux.dtype
    assert_same_states(states, qwen3_aux, "extract_hidden_states vs aux_layers (Qwen3)")
    assert_matches_reference(load_reference_model(qwen3.path), states, qwen3.shard, ids)
