"""The MLA draft (`draft.architecture: mla`): its shape from the target, the refusals, the
export vLLM 0.32 loads as `Eagle3DeepseekV2ForCausalLM`, and its forward against vLLM's own
module. The kernels' equality for MLA is in `test_draft_model.py`."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagleflow.draft.model import draft_config_for
from eagleflow.draft.vocab import build_draft_vocab
from eagleflow.draft.weights import build_draft
from eagleflow.export.speculators_format import export_draft
from support.draft_fixtures import (
    TINY_DRAFT,
    TINY_MLA_DRAFT,
    V,
    vllm_reference_drafts,
    write_shard,
    write_target,
)
from support.target_configs import DEEPSEEK_V3, KIMI_K25

REPO = Path(__file__).resolve().parents[1]
L = 4  # write_target's layers
# As DeepSeek-V3's config.json publishes its rope (the older rope_scaling layout).
DEEPSEEK_V3_ROPE = dict(
    rope_theta=10000,
    rope_scaling={
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    max_position_embeddings=163840,
)
TINY_MLA = TINY_MLA_DRAFT  # for write_target's target, which has no MLA: every key given
YARN = dict(
    rope_type="yarn",
    factor=8.0,
    original_max_position_embeddings=16,
    beta_fast=32,
    beta_slow=1,
    mscale=0.8,
    mscale_all_dim=0.6,
)
MLA_NAMES = {
    "fc.weight",
    "layers.0.input_layernorm.weight",
    "layers.0.hidden_norm.weight",
    "layers.0.post_attention_layernorm.weight",
    "layers.0.self_attn.q_a_proj.weight",
    "layers.0.self_attn.q_a_layernorm.weight",
    "layers.0.self_attn.q_b_proj.weight",
    "layers.0.self_attn.kv_a_proj_with_mqa.weight",
    "layers.0.self_attn.kv_a_layernorm.weight",
    "layers.0.self_attn.kv_b_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "embed_tokens.weight",
    "d2t",
    "t2d",
}


@pytest.fixture
def tiny(tmp_path):
    target = write_target(tmp_path / "target")
    shards = [write_shard(tmp_path / f"shard{i}.safetensors", 12, seed=i) for i in range(2)]
    return target, shards


def test_mla_shape_defaults_from_the_target_and_its_yarn_rope():
    cfg = draft_config_for({**DEEPSEEK_V3, **DEEPSEEK_V3_ROPE}, 32000, 3, decoder="mla")
    assert (cfg.decoder, cfg.num_attention_heads, cfg.num_key_value_heads) == ("mla", 128, 128)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank) == (1536, 512)
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (128, 64, 128)
    assert cfg.head_dim == 192 and cfg.intermediate_size == 18432
    assert cfg.rope_theta == 10000.0
    published = {k: v for k, v in DEEPSEEK_V3_ROPE["rope_scaling"].items() if k != "type"}
    assert cfg.rope_scaling == {"rope_type": "yarn", **published}
    # Kimi-K2.5: the wrapper's text config (64 heads); a key set in draft: wins
    kimi = draft_config_for(KIMI_K25, 32000, 3, decoder="mla", q_lora_rank=768)
    assert (kimi.num_attention_heads, kimi.q_lora_rank, kimi.kv_lora_rank) == (64, 768, 512)
    assert kimi.rope_scaling is None  # no rope_scaling in this config: plain rope
    # the architecture a resume must match names the MLA shape; a llama draft's does not
    assert cfg.architecture()["decoder"] == "mla" and cfg.architecture()["q_lora_rank"] == 1536
    llama = draft_config_for(DEEPSEEK_V3, 32000, 3).architecture()
    assert not {"decoder", "q_lora_rank", "rope_scaling"} & set(llama)


def test_mla_refused_on_a_target_without_mla_unless_every_shape_key_is_given():
    plain = {"hidden_size": 64, "vocab_size": 100, "num_attention_heads": 4}
    with pytest.raises(ValueError) as e:
        draft_config_for(plain, 50, 3, decoder="mla", kv_lora_rank=32)
    assert str(e.value) == (
        "draft.architecture mla on a target without MLA (no kv_lora_rank in its config) "
        "needs every MLA shape key, and draft.q_lora_rank is not set"
    )
    cfg = draft_config_for(plain, 50, 3, **TINY_MLA)
    assert (cfg.q_lora_rank, cfg.head_dim, cfg.rope_scaling) == (16, 16, None)
    no_q_lora = {**DEEPSEEK_V3, "q_lora_rank": None}
    with pytest.raises(ValueError, match="set draft.q_lora_rank"):
        draft_config_for(no_q_lora, 50, 3, decoder="mla")
    assert draft_config_for(no_q_lora, 50, 3, decoder="mla", q_lora_rank=64).q_lora_rank == 64


def mla_export(tiny, out, seed, norm_before_residual=True, **arch):
    """An exported MLA draft with a pruned vocabulary and every weight perturbed (norms
    included), so each placement shows in the logits."""
    target, shards = tiny
    vocab = build_draft_vocab(shards, V, 48)
    draft = build_draft(
        target, vocab, 3, seed=seed, norm_before_residual=norm_before_residual, **TINY_MLA, **arch
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    export_draft(draft, [1, 2, 3], shards, target, out, dtype="float32")
    return draft, vocab


def test_mla_export_is_the_layout_vllm_loads_as_eagle3_deepseek_v2(tiny, tmp_path):
    draft, _ = mla_export(tiny, tmp_path / "export", seed=0, rope_scaling=YARN)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert config["model_type"] == "deepseek_v2"  # deepseek_v3 would become an MTP draft
    assert config["q_lora_rank"] == 16 and config["num_hidden_layers"] == 1
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["norm_before_residual"] is True  # vLLM's default there is False
    assert config["rope_parameters"] == {**YARN, "rope_theta": 10000.0}
    assert config["draft_vocab_size"] == 48 and config["vocab_size"] == V
    tensors = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert set(tensors) == MLA_NAMES
    assert tensors["d2t"].dtype == torch.int64
    assert tensors["layers.0.self_attn.q_a_proj.weight"].shape == (16, 2 * 32)
    assert tensors["layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (24 + 8, 2 * 32)
    assert tensors["layers.0.self_attn.kv_b_proj.weight"].shape == (4 * (8 + 12), 24)
    assert tensors["layers.0.self_attn.o_proj.weight"].shape == (32, 4 * 12)
    # the aux ids are checked against the shards as for the llama draft
    with pytest.raises(ValueError, match="trained on aux ids"):
        export_draft(draft, [0, 2, 3], tiny[1], tiny[0], tmp_path / "other", dtype="float32")


@pytest.mark.slow
def test_mla_draft_forward_matches_vllm_eagle3_deepseek_module(tiny, tmp_path):
    """eagleflow's TTT forward against vLLM 0.32's own Eagle3DeepseekV2ForCausalLM loaded
    from the export (config parsing, load_weights, MLA projections, rotary, softmax scale,
    compute_logits), drafting three tokens for the last position of a prompt the way vLLM's
    proposer does. Plain rope; DeepSeek YaRN ("deepseek_yarn": softmax mscale) with the other
    residual; YaRN with attention_factor 1 ("deepseek_llama_scaling") and Eagle 3.1."""
    n, steps = 9, 3
    g = torch.Generator().manual_seed(7)
    aux = torch.randn(n, 3 * 32, generator=g)
    seq = torch.randint(0, V, (n + steps,), generator=g)
    tokens = torch.stack([seq[1 + k : 1 + k + n] for k in range(steps)])  # step k reads t+1+k
    variants = [
        (True, {}),
        (False, {"rope_scaling": YARN}),
        (True, {"rope_scaling": {**YARN, "attention_factor": 1.0}, "fc_norm": True,
                "norm_output": True}),
    ]  # fmt: skip
    drafts, dirs = [], []
    for i, (nbr, arch) in enumerate(variants):
        d = tmp_path / f"export{i}"
        drafts.append(mla_export(tiny, d, seed=i, norm_before_residual=nbr, **arch))
        dirs.append(str(d))
    results = vllm_reference_drafts("vllm_mla_eagle3_reference.py", tmp_path, aux, tokens, dirs)
    expected = [("default", "RotaryEmbedding"), ("deepseek_yarn", "DeepseekScalingRotaryEmbedding"),
                ("deepseek_llama_scaling", "DeepseekScalingRotaryEmbedding")]  # fmt: skip
    for (draft, vocab), res, (nbr, arch), exp in zip(drafts, results, variants, expected):
        assert res["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
        assert (res["rope_type"], res["rotary"]) == exp
        assert res["norm_before_residual"] is nbr and res["draft_vocab_size"] == 48
        assert res["fc_norm"] is arch.get("fc_norm", False)
        assert res["norm_output"] is arch.get("norm_output", False)
        attn = draft.layers[0].self_attn
        assert res["scaling"] == pytest.approx(attn.scale, rel=1e-12)
        with torch.no_grad():  # eagleflow: positions of token t+1 (vLLM: t); RoPE is relative
            ours = draft.ttt_forward(
                aux, tokens, torch.arange(n) + 1, torch.zeros(n, dtype=torch.long), steps
            )
        theirs = res["logits"]  # [steps, V], -inf outside the draft vocabulary
        assert (
            torch.isinf(theirs[:, ~vocab.t2d]).all() and torch.isfinite(theirs[:, vocab.t2d]).all()
        )
        for k in range(steps):
            torch.testing.assert_close(
                theirs[k, vocab.target_ids], ours[k][-1], atol=1e-4, rtol=1e-4
            )
        assert (
            theirs.argmax(-1) == vocab.target_ids[torch.stack([o[-1] for o in ours]).argmax(-1)]
        ).all()


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_mla_draft_trains_with_each_optimizer_and_its_best_loads_back(tiny, tmp_path, optimizer):
    """The trainer on the MLA draft (one rank, CPU, blockwise kernel): Muon takes its latent
    and head projections (2D), AdamW its norms; the loss falls; `best/` loads back as the MLA
    draft it saved and exports in vLLM's layout."""
    import csv

    from eagleflow.draft.weights import load_trained
    from eagleflow.plan.settings import TrainConfig
    from eagleflow.train.optimizer import muon_split
    from eagleflow.train.trainer import train

    target, shards = tiny
    vocab = build_draft_vocab(shards, V, 48)
    draft = build_draft(target, vocab, 3, seed=0, **TINY_MLA)
    muon, adamw = muon_split(draft)
    names = {id(p): n for n, p in draft.named_parameters()}
    assert {names[id(p)] for p in muon} == {
        n for n in MLA_NAMES if n.endswith(("proj.weight", "mqa.weight")) or n == "fc.weight"
    }
    assert all(p.ndim == 1 for p in adamw if "lm_head" not in names[id(p)])
    cfg = TrainConfig(
        epochs=100,
        max_steps=40,
        batch_packs=1,
        ttt_steps=3,
        lr=1e-2,
        warmup_ratio=0.05,
        min_lr_ratio=0.1,
        weight_decay=0.0,
        grad_clip=1.0,
        max_tokens=64,
        save_every=40,
        eval_every=0,
        seed=0,
        num_workers=0,  # in-process: no forked loader worker (it can deadlock under pytest)
        device="cpu",
        optimizer=optimizer,
    )
    train(shards, target, vocab, tmp_path / "run", cfg, TINY_MLA)
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    losses = [float(r["loss"]) for r in rows if r.get("loss")]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    back, meta = load_trained(tmp_path / "run", target_dir=target)
    assert back.cfg.decoder == "mla" and back.cfg.q_lora_rank == 16
    assert type(back.layers[0].self_attn).__name__ == "MLAAttention"
    config = export_draft(back, meta["aux_ids"], shards, target, tmp_path / "export")
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]


def test_the_reference_loop_rebuilds_the_exported_mla_draft(tiny, tmp_path):
    """The evaluation's plain-torch reference loads an MLA export as the draft that was
    exported: the same config and the same logits."""
    from eagleflow.evaluate.acceptance import load_export

    draft, _ = mla_export(tiny, tmp_path / "export", seed=3, rope_scaling=YARN, fc_norm=True)
    back, config = load_export(tmp_path / "export")
    assert back.cfg.architecture() == draft.cfg.architecture()
    g = torch.Generator().manual_seed(0)
    n = 20
    aux = torch.randn(n, 3 * 32, generator=g)
    tokens = torch.randint(0, V, (3, n), generator=g)
    args = (aux, tokens, torch.arange(n) + 1, torch.zeros(n, dtype=torch.long), 3)
    with torch.no_grad():
        for a, b in zip(draft.ttt_forward(*args), back.ttt_forward(*args)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_acceptance_report_names_the_exports_architecture(tiny, tmp_path):
    from eagleflow.evaluate.acceptance import draft_architecture

    mla_export(tiny, tmp_path / "mla", seed=0)
    target, shards = tiny
    vocab = build_draft_vocab(shards, V, 48)
    llama = build_draft(target, vocab, 3, seed=0, **TINY_DRAFT)
    export_draft(llama, [1, 2, 3], shards, target, tmp_path / "llama")
    assert draft_architecture(tmp_path / "mla") == "mla"
    assert draft_architecture(tmp_path / "llama") == "llama"


# ---------------------------------------------------------------- draft.architecture


def test_draft_architecture_keys_become_the_draft_configs_overrides():
    from eagleflow.plan.settings import SettingsError
    from support.workflow_config import draft_settings

    def settings(**draft):
        return draft_settings(draft)

    llama = settings(attention="flex", fc_norm=False, architecture="llama")
    assert llama.model.overrides() == {
        "attention": "flex",
        "activation_checkpointing": llama.model.activation_checkpointing,
        "fc_norm": False,
        "norm_output": llama.model.norm_output,
    }
    # a llama draft's train_draft params are what they were before the MLA keys existed
    assert not {"architecture", "q_lora_rank", "v_head_dim"} & set(llama.recipe())
    mla = settings(attention="flex", fc_norm=False, architecture="mla", q_lora_rank=64)
    assert mla.model.overrides() == {**llama.model.overrides(), "decoder": "mla", "q_lora_rank": 64}
    assert mla.recipe()["architecture"] == "mla"
    assert mla.recipe()["q_lora_rank"] == 64 and mla.recipe()["v_head_dim"] is None
    with pytest.raises(SettingsError) as e:
        settings(v_head_dim=64)
    assert str(e.value) == "draft.v_head_dim is an MLA shape key: it needs draft.architecture: mla"
    with pytest.raises(SettingsError, match="draft.q_lora_rank is an MLA shape key"):
        settings(architecture="auto", q_lora_rank=64)
    # the overrides give the draft the trainer builds
    cfg = draft_config_for(DEEPSEEK_V3, 100, 3, **mla.model.overrides())
    assert (cfg.decoder, cfg.q_lora_rank, cfg.kv_lora_rank) == ("mla", 64, 512)


def test_the_default_architecture_is_mla_for_the_deepseek_v2_family_and_llama_otherwise():
    """draft.architecture auto (the schema's default): the trainer's draft is the target's own
    MLA shape for DeepSeek-V3 and Kimi-K2.5 (through its text_config), llama for a target
    without MLA, and llama for an MLA target without q_lora_rank (DeepSeek-V2-Lite), which
    vLLM's MLA draft cannot serve. train_draft's params carry `auto`: the resolved draft
    follows the target, an input of the rule."""
    from eagleflow.target.info import draft_architecture_for as architecture_for
    from support.workflow_config import draft_settings

    auto = draft_settings({"attention": "flex"})
    assert auto.model.architecture == "auto" and auto.model.overrides()["decoder"] == "auto"
    assert auto.recipe()["architecture"] == "auto" and "q_lora_rank" not in auto.recipe()
    explicit = draft_config_for(DEEPSEEK_V3, 100, 3, **{**auto.model.overrides(), "decoder": "mla"})
    assert draft_config_for(DEEPSEEK_V3, 100, 3, **auto.model.overrides()) == explicit
    kimi = draft_config_for(KIMI_K25, 100, 3, **auto.model.overrides())
    text = KIMI_K25["text_config"]
    assert kimi.decoder == "mla" and (kimi.q_lora_rank, kimi.v_head_dim) == (
        text["q_lora_rank"],
        text["v_head_dim"],
    )
    lite = {**DEEPSEEK_V3, "q_lora_rank": None}
    plain = {k: v for k, v in DEEPSEEK_V3.items() if k not in ("kv_lora_rank", "q_lora_rank")}
    assert [architecture_for(c) for c in (DEEPSEEK_V3, text, lite, plain)] == [
        "mla",
        "mla",
        "llama",
        "llama",
    ]
    for target in (lite, plain):
        cfg = draft_config_for(target, 100, 3, **auto.model.overrides())
        assert cfg == draft_config_for(
            target, 100, 3, **{**auto.model.overrides(), "decoder": "llama"}
        )


def test_an_mla_draft_with_evaluate_mla_off_is_refused_before_the_dag(tmp_path):
    from support.workflow_runner import snakemake

    proc = snakemake(
        tmp_path,
        "-n",
        "all",
        config={"draft": {"architecture": "mla"}, "evaluate": {"mla": False}},
        check=False,
    )
    assert proc.returncode != 0
    assert (
        "draft.architecture mla is served by vLLM's Eagle3DeepseekV2ForCausalLM, which runs "
        "only with MLA on: set evaluate.mla: true"
    ) in proc.stderr + proc.stdout
    proc = snakemake(
        tmp_path,
        "-n",
        "all",
        config={"draft": {"architecture": "mla"}},  # evaluate.mla null: the draft's
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_auto_with_evaluate_mla_off_is_refused_once_the_target_is_known(tmp_path):
    """draft.architecture auto with evaluate.mla false: refused before the DAG when the
    target's config.json gives an MLA draft, naming the target and the keys to change; let
    through for a target without MLA, and for one not built yet (the evaluation refuses it
    then: test_evaluation_sets.py)."""
    from eagleflow.plan.settings import SettingsError, check_architecture
    from support.workflow_config import workflow_config

    def check(target_config):
        target = tmp_path / "target"
        target.mkdir(exist_ok=True)
        if target_config is not None:
            (target / "config.json").write_text(json.dumps(target_config))
        check_architecture(
            workflow_config({"target": {"path": str(target)}, "evaluate": {"mla": False}})
        )

    check(None)
    check({k: v for k, v in DEEPSEEK_V3.items() if k not in ("kv_lora_rank", "q_lora_rank")})
    with pytest.raises(SettingsError) as e:
        check(DEEPSEEK_V3)
    assert str(e.value) == (
        f"draft.architecture auto trains an MLA draft for {tmp_path / 'target'} "
        "(DeepseekV3ForCausalLM), which vLLM serves only with MLA on, and evaluate.mla is "
        "false: set evaluate.mla to null or true, or draft.architecture to llama"
    )


@pytest.mark.slow  # a search of 256 meta-device drafts at Kimi-K2.5's shape
def test_the_architecture_benchmark_matches_the_llama_drafts_parameter_budget():
    """benchmarks/draft_architecture.py's `mla_matched` arm: on the embedded target, within 1%
    of the llama draft's trainable parameters, nope = v as published, kv_lora_rank and rope
    kept (vLLM's CPU MLA kernel takes only 576). At Kimi-K2.5's shape the MLA draft of the
    target's own shape is already under the llama draft's budget, so it is that shape."""
    import importlib.util

    from eagleflow.embedded.tiny_target import TINY_ARCH
    from support.workflow_runner import REPO

    path = REPO / "benchmarks" / "draft_architecture.py"
    spec = importlib.util.spec_from_file_location("draft_architecture", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    tiny = {**TINY_ARCH, "vocab_size": 1024}
    shape = bench.matched_mla_shape(tiny, 512, 3)
    assert shape["qk_nope_head_dim"] == shape["v_head_dim"] < TINY_ARCH["v_head_dim"]
    assert shape["q_lora_rank"] <= TINY_ARCH["q_lora_rank"]
    llama = bench.trainable_parameters(tiny, 512, 3, {})
    mla = bench.trainable_parameters(tiny, 512, 3, {"decoder": "mla", **shape})
    assert abs(mla - llama) / llama < 0.01, (shape, mla, llama)
    assert bench.arm_config("mla_matched", shape)["draft"] == {"architecture": "mla", **shape}

    text = KIMI_K25["text_config"]
    shape = bench.matched_mla_shape(KIMI_K25, 32000, 3)
    assert shape == {k: text[k] for k in ("q_lora_rank", "qk_nope_head_dim", "v_head_dim")}
    llama = bench.trainable_parameters(KIMI_K25, 32000, 3, {})
    assert bench.trainable_parameters(KIMI_K25, 32000, 3, {"decoder": "mla"}) < llama
