"""Reading real targets' configs without weights: DeepSeek-V3, Kimi-K2, Kimi-K2.5's wrapper."""

import json
from pathlib import Path

import pytest
import yaml
from snakemake.utils import validate
from snakemake.utils import validate as validate_schema

from eagleflow.target.head import read_target_config
from eagleflow.target.info import (
    TargetError,
    bytes_per_weight,
    count_parameters,
    read_target,
    unwrap_text_config,
)
from eagleflow.target.layers import resolve_layer_ids
from support.target_configs import DEEPSEEK_V3, KIMI_K2, KIMI_K25, fake_checkpoint

REPO = Path(__file__).resolve().parents[1]


def target(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return read_target(tmp_path)


@pytest.mark.parametrize("cfg, billions", [(DEEPSEEK_V3, 671.0), (KIMI_K2, 1026.4)])
def test_parameter_counts_match_the_published_sizes(tmp_path, cfg, billions):
    # DeepSeek-V3: 671B (without its MTP module); Kimi-K2: "1T" (1.03e12).
    assert count_parameters(target(tmp_path, cfg)) / 1e9 == pytest.approx(billions, rel=1e-3)


def test_kimi_k25_text_model_is_found_under_its_wrapper(tmp_path):
    info = target(tmp_path, KIMI_K25)
    assert info.wrapper == "KimiK25ForConditionalGeneration"
    assert info.architecture == "DeepseekV3ForCausalLM" and info.is_mla
    assert (info.num_layers, info.hidden_size) == (61, 7168)
    assert resolve_layer_ids(None, "vllm", info.num_layers) == [2, 30, 58, 61]
    assert bytes_per_weight(info.text_config) == 0.5 + 2 / 32  # int4 + a bf16 scale per 32
    assert bytes_per_weight(DEEPSEEK_V3) == 1.0


def test_kimi_k25_weight_estimate_matches_the_published_checkpoint(tmp_path):
    """The real Kimi-K2.5 checkpoint is about 595 GB: 1.015T routed-expert weights in int4 with a
    bf16 scale per 32 (0.5625 bytes each) and 11.7B weights in bf16 (attention, shared experts,
    dense MLP, embeddings, head, router), plus a bf16 vision tower of about 0.4B that eagleflow
    does not load (`language_model_only`)."""
    from eagleflow.target.info import weight_bytes

    info = target(tmp_path, KIMI_K25)
    routed = 60 * 384 * 3 * 7168 * 2048
    assert routed / 1e12 == pytest.approx(1.0147, rel=1e-4)
    estimate = weight_bytes(info)
    assert estimate == pytest.approx(routed * 0.5625 + (1026.408e9 - routed) * 2, rel=1e-5)
    assert estimate / 1e9 == pytest.approx(595, rel=0.02)  # within 2% of the hub's size
    # The ignore list matters: quantizing every Linear (the head included) would claim 578 GB.
    unquantized_rules = json.loads(json.dumps(KIMI_K25))
    del unquantized_rules["text_config"]["quantization_config"]["ignore"]
    assert weight_bytes(target(tmp_path, unquantized_rules)) / 1e9 == pytest.approx(578.3, rel=2e-3)


@pytest.mark.parametrize(
    "cfg, wrapper",
    [
        (KIMI_K25, "KimiK25ForConditionalGeneration"),
        # A wrapper's own top-level sizes (its vision side's) are not the text model's.
        ({**KIMI_K25, "hidden_size": 1152}, "KimiK25ForConditionalGeneration"),
        (DEEPSEEK_V3, None),
        # A supported text model is its own text config, whatever else it carries.
        ({**DEEPSEEK_V3, "text_config": {"hidden_size": 1}}, None),
    ],
)
def test_target_config_is_unwrapped_by_one_rule(tmp_path, cfg, wrapper):
    """read_target (the text model's facts) and read_target_config (the draft's config source)
    take the same text config from a wrapper and from a plain config."""
    text = cfg["text_config"] if wrapper else cfg
    assert unwrap_text_config(cfg) == (wrapper, text)
    info = target(tmp_path, cfg)
    assert (info.wrapper, info.text_config, info.hidden_size) == (wrapper, text, 7168)
    assert read_target_config(tmp_path) == text


def test_missing_or_broken_config_is_named(tmp_path):
    with pytest.raises(TargetError, match="config.json: not found; set `target.path`"):
        read_target(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(TargetError, match="not valid JSON"):
        read_target(tmp_path)


@pytest.mark.parametrize(
    "name",
    [
        "config/config.yaml",
        "config/examples/kimi-k2.5-tp8.yaml",
        "config/examples/deepseek-v3-tp8.yaml",
    ],
)
def test_shipped_configs_validate_against_the_schema(name):
    cfg = yaml.safe_load((REPO / name).read_text())
    validate(cfg, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    assert cfg["extract"]["tensor_parallel_size"] == (1 if name == "config/config.yaml" else 8)


def test_every_schema_key_has_a_default_and_a_description():
    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())

    def walk(props, path):
        for key, spec in props.items():
            assert "description" in spec, f"{path}{key} lacks a description"
            assert "default" in spec, f"{path}{key} lacks a default"
            walk(spec.get("properties", {}), f"{path}{key}.")

    walk(schema["properties"], "")


def test_kimi_k25_validates_before_any_load(tmp_path, tokenizer_dir):
    """validate_env on Kimi-K2.5's real config (text model under the wrapper's text_config): the
    text model, its layer ids and int4 weight size are found; on this CPU machine the 8-GPU
    example fails the device check, and with devices deferred (a login node) it passes."""
    from eagleflow.extract.preflight import validate

    d = fake_checkpoint(
        tmp_path / "Kimi-K2.5",
        KIMI_K25,
        tokenizer_dir,
        "language_model.model.norm.weight",
        "model-00001-of-000064.safetensors",
    )
    cfg = yaml.safe_load((REPO / "config/examples/kimi-k2.5-tp8.yaml").read_text())
    validate_schema(
        cfg, str(REPO / "workflow" / "schemas" / "config.schema.yaml")
    )  # fills the defaults
    ok, report = validate(cfg, str(d), 10_000, str(tmp_path / "results"))
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["model_config"]["detail"] == (
        "DeepseekV3ForCausalLM, 61 layers, hidden 7168 "
        "(text model of KimiK25ForConditionalGeneration)"
    )
    assert report["layer_ids"] == [2, 30, 58, 61] and checks["layer_ids"]["ok"]
    assert report["weight_bytes_estimate"] == pytest.approx(594.2e9, rel=1e-3)
    assert not ok and any(
        "tensor_parallel_size=8 needs 8 CUDA devices" in c["detail"] for c in report["checks"]
    )
    ok, report = validate(cfg, str(d), 10_000, str(tmp_path / "results"), device_checks=False)
    assert ok, [c for c in report["checks"] if not c["ok"]]
