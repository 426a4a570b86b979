import json
import os
import sys
from functools import cache
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

# The eagleflow package: importable here and in every job (local, conda or SLURM).
PACKAGE_DIR = str(Path(workflow.basedir) / "workflow")
sys.path.insert(0, PACKAGE_DIR)
os.environ.update(
    PYTHONPATH=os.pathsep.join(
        p for p in (PACKAGE_DIR, os.environ.get("PYTHONPATH")) if p
    )
)

from eagleflow.store.integrity import (
    check_finished_shards,
    set_aside_incomplete_manifest,
)
from eagleflow.extract.fingerprint import config_fingerprint
from eagleflow.target.layers import resolve_layer_ids
from eagleflow.target.info import TOKENIZER_FILES, read_target
from eagleflow.embedded.tiny_target import TINY_TARGET_FILES, TINY_TOKENIZER_FILES
from eagleflow.embedded.tiny_kimi import (
    TINY_KIMI_FILES,
    TOKENIZER_FILES as KIMI_TOKENIZER_FILES,
)
from eagleflow.target.info import TargetError
from eagleflow.target.load import check_remote_code

validate(config, workflow.source_path("../schemas/config.schema.yaml"))

R = config["results_dir"]
TARGET = config["target"]["path"]
TINY_TARGET = "resources/targets/tiny-deepseek-v3"
# The embedded tiny target briefly trained on the bundled corpus (target_training.smk), built
# from the untrained fixture; config/config.yaml points `target.path` here.
TRAINED_TINY_TARGET = "resources/targets/tiny-deepseek-v3-trained"
# A tiny replica of Kimi-K2.5's published layout (embedded.smk, rule tiny_kimi_k25); it ships
# its tokenizer as code.
TINY_KIMI_TARGET = "resources/targets/tiny-kimi-k25"
EMBEDDED_TARGETS = (TINY_TARGET, TRAINED_TINY_TARGET, TINY_KIMI_TARGET)
EMBEDDED_FILES = {
    TINY_TARGET: TINY_TARGET_FILES,
    TRAINED_TINY_TARGET: TINY_TARGET_FILES,
    TINY_KIMI_TARGET: TINY_KIMI_FILES,
}
EMBEDDED_TOKENIZER_FILES = {
    TINY_TARGET: TINY_TOKENIZER_FILES,
    TRAINED_TINY_TARGET: TINY_TOKENIZER_FILES,
    TINY_KIMI_TARGET: KIMI_TOKENIZER_FILES,
}
BUNDLED_DATA = "resources/data/bundled-chat.jsonl"
HIDDEN = f"{R}/hidden/{{fp}}"
CONDA_ENV = "../../envs/vllm-cuda.yaml"


def check_target_path(path):
    """A target the workflow does not build must exist before the DAG is: one sentence, not an
    input function's traceback."""
    if path in EMBEDDED_TARGETS:
        return
    where = "" if os.path.isabs(path) else f" (relative to {os.getcwd()})"
    if not os.path.isdir(path):
        problem = "does not exist" if not os.path.exists(path) else "is not a directory"
    elif not os.path.isfile(os.path.join(path, "config.json")):
        problem = "has no config.json"
    else:
        return
    raise WorkflowError(
        f"target.path: {path}{where} {problem}; set `target.path` in the config file to a local "
        "Hugging Face model directory (config.json, tokenizer files and safetensors weights)."
    )


check_target_path(TARGET)


def check_target_code(path, trust):
    """A target that ships code (Kimi's tokenizer) is refused, in one sentence naming
    `target.trust_remote_code`, before anything loads it."""
    if path == TINY_KIMI_TARGET and not trust:
        raise WorkflowError(
            f"{path} ships its tokenizer as code; set `target.trust_remote_code: true` to allow it"
        )
    if os.path.isdir(path):
        try:
            check_remote_code(path, trust)
        except TargetError as e:
            raise WorkflowError(str(e))


check_target_code(TARGET, config["target"]["trust_remote_code"])


wildcard_constraints:
    fp="[0-9a-f]{16}",
    shard="[0-9a-f]{20}",


def tokenizer_files(wildcards=None):
    """The target's tokenizer and chat template files (the embedded target's are built here)."""
    if TARGET in (TINY_TARGET, TINY_KIMI_TARGET):
        return [f"{TARGET}/{name}" for name in EMBEDDED_TOKENIZER_FILES[TARGET]]
    return [str(p) for p in sorted(Path(TARGET).iterdir()) if p.name in TOKENIZER_FILES]


@cache
def layer_ids():
    info = read_target(TARGET)
    return resolve_layer_ids(
        config["capture"]["layer_ids"],
        config["capture"]["layer_id_convention"],
        info.num_layers,
    )


@cache
def fingerprint():
    """(fingerprint, record) of the extraction; cheap: config, tokenizer, weight headers."""
    return config_fingerprint(config)


@cache
def check_token_shards():
    """Once per run, before the shard checkpoint is asked for: a manifest listing a token shard
    that was deleted is moved aside, so the checkpoint re-shards instead of the extraction
    jobs lacking their input."""
    set_aside_incomplete_manifest(
        f"{R}/shards", log=lambda m: print(m, file=sys.stderr)
    )


def shard_manifest(wildcards=None):
    check_token_shards()
    return checkpoints.shard.get().output.manifest


def shard_ids():
    import pandas as pd

    return sorted(
        pd.read_parquet(shard_manifest(), columns=["shard_id"])["shard_id"].unique()
    )


@cache
def checked_shard_ids(fp):
    """Shard ids, after the cheap integrity check of every finished shard (once per run)."""
    ids = shard_ids()
    if fp == fingerprint()[0]:
        check_finished_shards(
            HIDDEN.format(fp=fp), ids, fp, log=lambda m: print(m, file=sys.stderr)
        )
    return ids


def hidden_dir(wildcards=None):
    """The current configuration's output directory, once sharding is done: sharding needs the
    target's tokenizer, so the target exists then (the embedded one is built first) and can
    be fingerprinted."""
    shard_manifest()
    return HIDDEN.format(fp=fingerprint()[0])


def extraction_summary(wildcards):
    return f"{hidden_dir()}/verify_summary.tsv"


def fingerprint_record(fp):
    current, record = fingerprint()
    if fp != current:
        raise ValueError(
            f"{R}/hidden/{fp}: this fingerprint is not the current configuration's ({current}); "
            "its record cannot be rewritten from here"
        )
    return record


def shard_files(fp, suffix):
    return [f"{R}/hidden/{fp}/{shard}{suffix}" for shard in checked_shard_ids(fp)]


def per_shard(suffix):
    """Input function: `<hidden dir>/<shard><suffix>` for every shard, for the wildcard fp."""
    return lambda wildcards: shard_files(wildcards.fp, suffix)


def current_shard_files(suffix):
    """Input function: the same for the current configuration's fingerprint."""

    def files(wildcards):
        hidden_dir()  # the target exists once sharding is done
        return shard_files(fingerprint()[0], suffix)

    return files
