"""The `draft:` section's one typed owner (eagleflow.plan.settings.DraftSettings): every key
read into it, each classed as recipe (decides the weights), extent or runtime, and the recipe
params that decide whether train_draft reruns unchanged for the configs users have."""

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from eagleflow.plan import launch
from eagleflow.plan.settings import (
    ARCH_KEYS,
    EXTENT_KEYS,
    MLA_KEYS,
    RECIPE_KEYS,
    DraftSettings,
    SettingsError,
    TrainConfig,
)
from support.workflow_config import SCHEMA, draft_settings, workflow_config

# train_draft's params.recipe of the default config as the workflow wrote them before the
# typed settings (commit ee28e1f, `launch.recipe_settings` + data.heldout_modulus): Snakemake
# compares their repr with a finished run's record, so a change here reruns users' training.
# Changed once on purpose: `'architecture': 'auto'` when auto became draft.architecture's
# default (issue 36), which trains the MLA draft where the llama one was.
DEFAULT_RECIPE = (
    "{'architecture': 'auto', 'batch_packs': 2, 'epochs': 1, 'fc_norm': False, "
    "'grad_clip': 0.5, 'lm_head': 'random', "
    "'loss': 'kl', 'lr': 0.003, 'mask_oov': False, 'max_sample_tokens': 0, 'max_steps': 0, "
    "'max_tokens': 256, 'min_lr_ratio': 0.1, 'muon_lr': 0.02, 'muon_weight_decay': 0.1, "
    "'noise_std': 0.0, 'norm_output': False, 'optimizer': 'muon', 'seed': 0, "
    "'step_weight': 0.8, 'ttt_steps': 3, 'warmup_ratio': 0.05, 'weight_decay': 0.01, "
    "'heldout_modulus': 20}"
)
# The same for each example over the default (sha256 of the repr, first 16 hex digits).
EXAMPLE_RECIPES = {
    "deepseek-v3-tp8.yaml": "fbb20456d52ccfb8",
    "kimi-k2.5-tp8-pp2-2nodes.yaml": "fbb20456d52ccfb8",
    "kimi-k2.5-tp8.yaml": "fbb20456d52ccfb8",
    "qwen3-32b-tp4-extract-hidden-states.yaml": "4d702513ac8cc7a0",
    "stream.yaml": "7bde2b957777b89a",
    "tiny-kimi-k25.yaml": "7bde2b957777b89a",
}


def test_the_default_config_s_recipe_params_are_unchanged():
    assert repr(draft_settings().recipe()) == DEFAULT_RECIPE


@pytest.mark.parametrize("example", sorted(EXAMPLE_RECIPES))
def test_each_example_s_recipe_params_are_unchanged(example):
    recipe = DraftSettings.from_config(workflow_config(example=example)).recipe()
    assert hashlib.sha256(repr(recipe).encode()).hexdigest()[:16] == EXAMPLE_RECIPES[example]


def another_value(spec: dict, value):
    """A valid value of a schema property other than `value`."""
    if "enum" in spec:
        return next(v for v in spec["enum"] if v != value)
    kinds = spec["type"] if isinstance(spec["type"], list) else [spec["type"]]
    if value is None:
        return "0" if "string" in kinds else 2
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        top = spec.get("maximum", spec.get("exclusiveMaximum"))
        return value + 1 if top is None or value + 1 < top else (value + top) / 2
    return value + "-other"


DRAFT_SCHEMA = yaml.safe_load(Path(SCHEMA).read_text())["properties"]["draft"]["properties"]


@pytest.mark.parametrize("key", sorted(DRAFT_SCHEMA))
def test_every_draft_key_is_read_into_the_record_and_classed(key):
    """A changed key changes the typed settings (no key is left for a rule to read from the
    dict), and changes train_draft's recipe params exactly when it decides the weights or the
    extent."""
    # stream_tls means something only over TCP; device: auto follows extract.device (cpu); the
    # MLA shape keys only for an MLA draft
    base = {"stream_tcp": True} if key == "stream_tls" else {}
    base |= {"architecture": "mla"} if key in MLA_KEYS else {}
    before = draft_settings(base)
    default = workflow_config()["draft"][key]
    value = "cuda" if key == "device" else another_value(DRAFT_SCHEMA[key], default)
    after = draft_settings({**base, key: value})
    assert after != before
    decides = key in set(RECIPE_KEYS) | set(EXTENT_KEYS) | set(ARCH_KEYS) | set(MLA_KEYS)
    decides |= key == "architecture"
    assert (after.recipe() != before.recipe()) == decides, key


def test_heldout_modulus_takes_one_route():
    """data.heldout_modulus reaches the trainer's settings, the recipe params and every draft
    rule through the record alone."""
    draft = draft_settings(data={"heldout_modulus": 7})
    assert draft.heldout_modulus == draft.train.heldout_modulus == 7
    assert draft.recipe()["heldout_modulus"] == 7
    assert list(draft.recipe())[-1] == "heldout_modulus"  # where the old params had it


def test_the_trainer_gets_the_record_s_settings(tmp_path):
    draft = draft_settings(
        {
            "epochs": 2,
            "lr": 0.001,
            "eval_every": 50,
            "device": "cuda",
            "attention": "eager",
            "activation_checkpointing": True,
        },
        data={"heldout_modulus": 10},
    )
    cfg = draft.train
    assert (cfg.epochs, cfg.lr, cfg.eval_every, cfg.heldout_modulus) == (2, 0.001, 50, 10)
    assert cfg.device == "auto" and draft.ranks.device == "cuda"  # each rank: cuda:LOCAL_RANK
    assert draft_settings({"device": "cpu"}).train.device == "cpu"
    overrides = draft.model.overrides()
    assert overrides == {
        "attention": "eager",
        "activation_checkpointing": True,
        "fc_norm": False,
        "norm_output": False,
        "decoder": "auto",  # the trainer resolves it against the target (draft_config_for)
    }
    args = launch.trainer_args(["s1", "s2"], "t", "v", tmp_path / "work", draft)
    assert args[:3] == ["--shards", "s1", "s2"]
    config = args[args.index("--config") + 1]  # a file in the work directory
    assert config == str(tmp_path / "work" / "train_config.json")
    assert TrainConfig(**json.loads(Path(config).read_text())) == cfg
    assert json.loads(args[args.index("--draft") + 1]) == overrides


def test_a_setting_that_cannot_work_is_refused_naming_its_key():
    config = workflow_config()
    config["draft"]["states"] = "somewhere"  # past the schema, as a Python caller could
    with pytest.raises(SettingsError, match=r"draft\.states = 'somewhere'"):
        DraftSettings.from_config(config)
    config = workflow_config()
    config["draft"]["batch_packs"] = 0
    with pytest.raises(ValueError, match=r"draft\.batch_packs = 0"):
        DraftSettings.from_config(config)
