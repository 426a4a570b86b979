import pytest

from eagleflow.capture import ARCHITECTURES, ArchSpec, CaptureCheckError, check_plan, introspect, make_plan
from eagleflow.layers import default_layer_ids, resolve_layer_ids
from eagleflow.target import read_target

DEEPSEEK = ARCHITECTURES["DeepseekV3ForCausalLM"]
FAKE_OLD = ArchSpec("fake_vllm_models", "OldForCausalLM", "OldModel", "OldDecoderLayer",
                    DEEPSEEK.layer_params, False)


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
    assert found["layer_call_signature"][:4] == ["positions", "hidden_states", "residual", "llama_4_scaling"]
    assert check_plan("patched_forward", found, [2, 4, 5, 8], 8, DEEPSEEK)


def test_auto_picks_aux_layers_and_falls_back_for_id_zero(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text('{"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 8, '
                   '"hidden_size": 256, "vocab_size": 1024, "kv_lora_rank": 512}')
    info = read_target(tmp_path)
    assert make_plan(info, [2, 4, 5, 8], "auto")["strategy"] == "aux_layers"
    # vLLM's DeepseekV2Model sums hidden + residual, and the residual is None before layer 0.
    assert make_plan(info, [0, 4, 8], "auto")["strategy"] == "patched_forward"
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
    spec = ArchSpec("fake_vllm_models", "OldForCausalLM", "OldModel", "KeywordOnlyDecoderLayer",
                    DEEPSEEK.layer_params, False)
    with pytest.raises(CaptureCheckError, match=r"found \(hidden_states, positions"):
        check_plan("patched_forward", introspect(spec), [2], 8, DEEPSEEK)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "num_hidden_layers": 2, '
                                          '"hidden_size": 8, "vocab_size": 10}')
    with pytest.raises(CaptureCheckError, match="GPT2LMHeadModel has no capture adapter"):
        make_plan(read_target(tmp_path), [1], "auto")


def test_dense_models_use_their_own_aux_interface_only(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, '
                                          '"hidden_size": 64, "vocab_size": 100}')
    info = read_target(tmp_path)
    assert make_plan(info, [0, 2, 4, 8], "auto")["strategy"] == "aux_layers"
    with pytest.raises(CaptureCheckError, match="DeepseekV2-family"):
        make_plan(info, [2, 4], "patched_forward")
