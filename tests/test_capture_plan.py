from dataclasses import replace

import pytest

from eagleflow.capture.plan import (
    ARCHITECTURES,
    ArchSpec,
    CaptureCheckError,
    CapturePlan,
    Strategy,
    check_plan,
    introspect,
    make_plan,
)
from eagleflow.target.info import read_target
from eagleflow.target.layers import default_layer_ids, resolve_layer_ids
from support.target_configs import KIMI_K25

DEEPSEEK = ARCHITECTURES["DeepseekV3ForCausalLM"]
FAKE_OLD = ArchSpec(
    "support.fake_vllm_models",
    "OldForCausalLM",
    "OldModel",
    "OldDecoderLayer",
    DEEPSEEK.layer_params,
    False,
)


def test_layer_ids_default_and_conventions():
    assert default_layer_ids(8) == [2, 4, 5, 8]
    assert resolve_layer_ids(None, "vllm", 61) == [2, 30, 58, 61]
    # SpecForge's default [1, L//2-1, L-4] names the same tensors as vLLM's (2, L//2, L-3).
    assert resolve_layer_ids([1, 29, 57], "output", 61) == [2, 30, 58]
    with pytest.raises(ValueError, match=r"\[9\].*outside 0..8"):
        resolve_layer_ids([2, 9], "vllm", 8)
    with pytest.raises(ValueError, match="duplicate"):
        resolve_layer_ids([2, 2], "vllm", 8)


def test_installed_vllm_offers_aux_capture_for_deepseek():
    found = introspect(DEEPSEEK)
    assert found["has_aux_interface"] and found["aux_captures_final"]
    assert found["embedding_method"] == "embed_input_ids"
    assert found["layer_call_signature"][:4] == [
        "positions",
        "hidden_states",
        "residual",
        "llama_4_scaling",
    ]
    assert check_plan("patched_forward", found, [2, 4, 5, 8], 8, DEEPSEEK)


def test_auto_picks_aux_layers_and_falls_back_for_id_zero(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(
        '{"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 8, '
        '"hidden_size": 256, "vocab_size": 1024, "kv_lora_rank": 512}'
    )
    info = read_target(tmp_path)
    assert make_plan(info, [2, 4, 5, 8], "auto").strategy == "aux_layers"
    # vLLM's DeepseekV2Model sums hidden + residual, and the residual is None before layer 0.
    assert make_plan(info, [0, 4, 8], "auto").strategy == "patched_forward"
    with pytest.raises(CaptureCheckError, match="Drop id 0"):
        make_plan(info, [0, 4, 8], "aux_layers")


def test_old_vllm_signature_mismatch_names_version_class_and_signatures():
    found = introspect(FAKE_OLD)
    assert found["embedding_method"] == "get_input_embeddings"
    assert not found["has_aux_interface"]
    with pytest.raises(CaptureCheckError) as e:
        check_plan("patched_forward", found, [2, 4, 8], 8, DEEPSEEK)
    msg = str(e.value)
    assert "vLLM 0.32.0" in msg and "OldDecoderLayer.forward" in msg
    assert "expected (positions, hidden_states, residual, llama_4_scaling)" in msg
    assert "found (positions, hidden_states, residual)" in msg
    with pytest.raises(CaptureCheckError, match="set_aux_hidden_state_layers"):
        check_plan("aux_layers", found, [2, 4, 8], 8, DEEPSEEK)


def test_reordered_parameters_are_a_mismatch():
    spec = ArchSpec(
        "support.fake_vllm_models",
        "OldForCausalLM",
        "OldModel",
        "KeywordOnlyDecoderLayer",
        DEEPSEEK.layer_params,
        False,
    )
    with pytest.raises(CaptureCheckError, match=r"found \(hidden_states, positions"):
        check_plan("patched_forward", introspect(spec), [2], 8, DEEPSEEK)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"architectures": ["GPT2LMHeadModel"], "num_hidden_layers": 2, '
        '"hidden_size": 8, "vocab_size": 10}'
    )
    with pytest.raises(CaptureCheckError, match="GPT2LMHeadModel has no capture adapter"):
        make_plan(read_target(tmp_path), [1], "auto")


def test_dense_models_use_their_own_aux_interface_only(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, '
        '"hidden_size": 64, "vocab_size": 100}'
    )
    info = read_target(tmp_path)
    assert make_plan(info, [0, 2, 4, 8], "auto").strategy == "aux_layers"
    with pytest.raises(CaptureCheckError, match="DeepseekV2-family"):
        make_plan(info, [2, 4], "patched_forward")


# vLLM's own extract_hidden_states strategy: refused before any weights load wherever it cannot
# work.

LLAMA_CFG = (
    '{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "hidden_size": 64, '
    '"vocab_size": 100}'
)
QWEN3_CFG = (
    '{"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 8, "hidden_size": 64, '
    '"vocab_size": 100, "head_dim": 16}'
)
DEEPSEEK_CFG = (
    '{"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 8, "hidden_size": 256, '
    '"vocab_size": 1024, "kv_lora_rank": 512}'
)


def _target(tmp_path, cfg):
    (tmp_path / "config.json").write_text(cfg)
    return read_target(tmp_path)


@pytest.mark.parametrize("cfg", [LLAMA_CFG, QWEN3_CFG])
def test_extract_hidden_states_plans_on_cuda_for_dense_targets(tmp_path, cfg):
    info = _target(tmp_path, cfg)
    plan = make_plan(info, [0, 2, 4, 8], "extract_hidden_states", device="cuda")
    assert plan.strategy == "extract_hidden_states" and plan.device == "cuda"
    assert (
        plan.introspection["ehs_file_keys"] == ["hidden_states", "token_ids"]
        and plan.introspection["ehs_connector_registered"]
    )
    assert any("device is cuda" in c for c in plan.checks_passed)
    assert any("id 8 (final pre-norm state)" in c for c in plan.checks_passed)
    # auto never picks it, whatever the device.
    assert make_plan(info, [2, 4, 8], "auto", device="cuda").strategy == "aux_layers"


def test_extract_hidden_states_engine_settings_follow_the_plan(tmp_path):
    from eagleflow.capture.connector import engine_kwargs, strategy_engine_kwargs

    plan = make_plan(
        _target(tmp_path, LLAMA_CFG), [2, 4, 8], "extract_hidden_states", device="cuda"
    )
    kw = strategy_engine_kwargs(plan, tmp_path / "conn")
    assert kw == engine_kwargs(plan, tmp_path / "conn")
    assert kw["speculative_config"] == {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 8]}},
    }
    assert kw["kv_transfer_config"]["kv_connector"] == "ExampleHiddenStatesConnector"
    assert kw["kv_transfer_config"]["kv_connector_extra_config"]["shared_storage_path"] == str(
        tmp_path / "conn"
    )
    assert kw["enable_chunked_prefill"] is False and kw["enable_prefix_caching"] is False
    # vLLM itself accepts these settings (config objects only, no model load).
    from vllm.config import KVTransferConfig

    assert KVTransferConfig(**kw["kv_transfer_config"]).kv_role == "kv_producer"
    assert strategy_engine_kwargs(replace(plan, strategy=Strategy.AUX_LAYERS), tmp_path) == {}


def test_extract_hidden_states_refused_on_cpu_naming_version_reason_and_remedy(tmp_path):
    with pytest.raises(CaptureCheckError) as e:
        make_plan(_target(tmp_path, LLAMA_CFG), [2, 4, 8], "extract_hidden_states", device="cpu")
    msg = str(e.value)
    assert msg.startswith(
        "vLLM 0.32.0: capture.strategy extract_hidden_states: extract.device is 'cpu'"
    )
    assert "pinned memory on a CUDA stream" in msg and "capture.strategy: auto" in msg


def test_extract_hidden_states_refused_for_mla_targets(tmp_path):
    with pytest.raises(
        CaptureCheckError,
        match=r"vLLM 0\.32\.0: .*the target uses MLA.*MLA verifiers are "
        r"unsupported.*capture.strategy: auto",
    ):
        make_plan(
            _target(tmp_path, DEEPSEEK_CFG), [2, 4, 8], "extract_hidden_states", device="cuda"
        )


def test_extract_hidden_states_refused_for_kimi_k25_wrapper(tmp_path):
    import json

    info = _target(tmp_path, json.dumps(KIMI_K25))
    assert info.wrapper and info.is_mla
    with pytest.raises(CaptureCheckError, match="the target uses MLA"):
        make_plan(info, [2, 30, 58, 61], "extract_hidden_states", device="cuda")
    # Its text model plans with the aux interface (id 61 = final pre-norm state), through the
    # wrapper class vLLM loads, checked to delegate to its language_model.
    plan = make_plan(info, [2, 30, 58, 61], "auto", device="cuda")
    assert plan.strategy == "aux_layers" and plan.num_hidden_layers == 61
    assert (
        plan.introspection["model_class"].endswith("DeepseekV3ForCausalLM")
        and plan.wrapper == "KimiK25ForConditionalGeneration"
    )
    assert (
        plan.introspection["wrapper_class"]
        == "vllm.model_executor.models.kimi_k25.KimiK25ForConditionalGeneration"
    )
    assert any(
        "set_aux_hidden_state_layers delegates to language_model" in c for c in plan.checks_passed
    )
    assert make_plan(info, [0, 30, 61], "auto", device="cuda").strategy == "patched_forward"


def test_a_wrapper_that_does_not_delegate_is_refused(monkeypatch):
    import eagleflow.capture.plan as capture

    monkeypatch.setitem(
        capture.WRAPPER_CLASSES,
        "KimiK25ForConditionalGeneration",
        ("support.fake_vllm_models", "NoDelegateWrapper"),
    )
    with pytest.raises(
        CaptureCheckError,
        match=r"vLLM 0\.32\.0: support\.fake_vllm_models\.NoDelegateWrapper: expected .*"
        r"found not: forward returns self\.language_model",
    ):
        capture.introspect_wrapper("KimiK25ForConditionalGeneration")
    with pytest.raises(CaptureCheckError, match="no adapter"):
        capture.introspect_wrapper("SomeOtherForConditionalGeneration")


@pytest.mark.parametrize("version", ["0.17.1", "0.31.2", "0.33.0", "1.0.0", "unknown"])
def test_extract_hidden_states_refused_outside_the_version_range(version):
    from eagleflow.capture.plan import check_extract_hidden_states, introspect_extract_hidden_states

    found = {**introspect_extract_hidden_states(), "vllm_version": version}
    with pytest.raises(CaptureCheckError, match=r"outside that range.*Install vLLM 0\.32\.x"):
        check_extract_hidden_states(found, "cuda", False)
    assert check_extract_hidden_states({**found, "vllm_version": "0.32.4"}, "cuda", False)


def test_extract_hidden_states_refused_when_the_installed_code_differs():
    from eagleflow.capture.plan import check_extract_hidden_states, introspect_extract_hidden_states

    found = introspect_extract_hidden_states()
    assert found["ehs_connector_needs_cuda"] and found["ehs_single_rank_finish"]
    for change, what in [
        ({"ehs_connector": None}, "ExampleHiddenStatesConnector is missing"),
        ({"ehs_file_keys": ["hidden_states"]}, r"writes keys \['hidden_states'\]"),
        ({"ehs_single_rank_finish": False}, "get_finished_count"),
    ]:
        with pytest.raises(CaptureCheckError, match=what):
            check_extract_hidden_states({**found, **change}, "cuda", False)


def test_extract_hidden_states_keeps_the_aux_interface_limits(tmp_path):
    # vLLM hands the ids to DeepseekV2's set_aux_hidden_state_layers, which cannot capture id 0.
    from eagleflow.capture.plan import check_plan, introspect_extract_hidden_states

    found = introspect(DEEPSEEK) | introspect_extract_hidden_states()
    with pytest.raises(CaptureCheckError, match="Drop id 0"):
        check_plan(
            "extract_hidden_states", found, [0, 4, 8], 8, DEEPSEEK, device="cuda", is_mla=False
        )


QWEN3_32B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "num_hidden_layers": 64,
    "hidden_size": 5120,
    "intermediate_size": 25600,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
}


def test_extract_hidden_states_example_plans_for_a_dense_gpu_target(tmp_path):
    import json
    from pathlib import Path

    import yaml
    from snakemake.utils import validate

    repo = Path(__file__).resolve().parents[1]
    cfg = yaml.safe_load(
        (repo / "config/examples/qwen3-32b-tp4-extract-hidden-states.yaml").read_text()
    )
    validate(cfg, str(repo / "workflow/schemas/config.schema.yaml"))
    info = _target(tmp_path, json.dumps(QWEN3_32B))
    cap = cfg["capture"]
    ids = resolve_layer_ids(cap["layer_ids"], cap["layer_id_convention"], info.num_layers)
    assert ids == [2, 32, 61, 64]
    plan = make_plan(info, ids, cap["strategy"], device=cfg["extract"]["device"])
    assert plan.strategy == "extract_hidden_states"
    # The same config with the device this machine has is refused before any load.
    with pytest.raises(CaptureCheckError, match="extract.device is 'cpu'"):
        make_plan(info, ids, cap["strategy"], device="cpu")


def test_patch_script_passes_the_configured_device(tmp_path):
    """workflow/scripts/patch.py (what the `patch` rule runs) plans with `extract.device`: on
    cpu it stops before any load with the refusal (the rule's log gets its traceback), on cuda
    it writes the plan, with `capture.storage_dtype` from the config."""
    import json
    import runpy
    from pathlib import Path
    from types import SimpleNamespace

    repo = Path(__file__).resolve().parents[1]
    target = tmp_path / "llama"
    target.mkdir()
    (target / "config.json").write_text(LLAMA_CFG)

    def run(device):
        log, out = tmp_path / f"{device}.log", tmp_path / f"{device}-plan.json"
        sm = SimpleNamespace(
            params=SimpleNamespace(
                target=str(target),
                capture={
                    "layer_ids": None,
                    "layer_id_convention": "vllm",
                    "strategy": "extract_hidden_states",
                },
            ),
            config={
                "extract": {"device": device, "pipeline_parallel_size": 1},
                "capture": {"storage_dtype": "float8_e4m3fn"},
            },
            wildcards=SimpleNamespace(fp="fp0"),
            log=[str(log)],
            output=[str(out)],
        )
        runpy.run_path(str(repo / "workflow/scripts/patch.py"), init_globals={"snakemake": sm})
        return log, out

    with pytest.raises(
        CaptureCheckError,
        match="vLLM 0.32.0: capture.strategy extract_hidden_states: extract.device is 'cpu'",
    ):
        run("cpu")
    assert not (tmp_path / "cpu-plan.json").exists()
    _, out = run("cuda")
    plan = CapturePlan.load(out)
    assert plan.strategy == "extract_hidden_states" and plan.device == "cuda"
    assert plan.layer_ids == [2, 4, 5, 8] and plan.fingerprint == "fp0"
    assert plan.storage_dtype == "float8_e4m3fn"
    assert json.loads(out.read_text())["strategy"] == "extract_hidden_states"
