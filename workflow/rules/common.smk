# The config, paths, parse-time checks and input functions of every rule (functions only, as
# `snakemake --lint` asks); resources.smk holds the resource functions, the Snakefile the targets.
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
from eagleflow.evaluate.sets import HELDOUT as HELDOUT_SET, set_files, sets_from_config
from eagleflow.plan.settings import DraftSettings
from eagleflow.target.layers import resolve_layer_ids
from eagleflow.plan.settings import SettingsError, check_architecture
from eagleflow.target.checks import check_target_code, check_target_path
from eagleflow.target.info import TOKENIZER_FILES, TargetError, read_target
from eagleflow.embedded.tiny_target import TINY_TARGET_FILES, TINY_TOKENIZER_FILES
from eagleflow.embedded.tiny_kimi import (
    TINY_KIMI_FILES,
    TOKENIZER_FILES as KIMI_TOKENIZER_FILES,
)

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


# Response regeneration (regenerate.smk): its source shards, regenerated, are the dataset
# the shard rule reads.
REGENERATE = config["data"]["regenerate"]
SOURCES_MANIFEST = f"{R}/regenerated/sources.json"
# The capture settings as a param of validate_env and patch. storage_dtype is left out: it is
# in the fingerprint (the output's path), so its default must not re-run the plans of
# extractions made before it existed.
CAPTURE_PARAMS = {k: v for k, v in config["capture"].items() if k != "storage_dtype"}

# A target that is missing, or ships code it may not run, is one sentence before the DAG is.
try:
    check_target_path(TARGET, built=EMBEDDED_TARGETS)
    check_target_code(
        TARGET,
        config["target"]["trust_remote_code"],
        built_with_code=[TINY_KIMI_TARGET],
    )
except TargetError as e:
    raise WorkflowError(str(e))
# draft.architecture and its shape keys, and the evaluation engine an MLA draft needs.
try:
    check_architecture(config)
except SettingsError as e:
    raise WorkflowError(str(e))

# The `draft:` section, typed once (eagleflow.plan.settings): every draft rule, resource
# function and script reads this, not the dict. A setting that cannot work is one sentence.
try:
    DRAFT_SETTINGS = DraftSettings.from_config(config)
except ValueError as e:
    raise WorkflowError(str(e))


wildcard_constraints:
    fp="[0-9a-f]{16}",
    shard="[0-9a-f]{20}",


def tokenizer_files(wildcards=None):
    """The target's tokenizer and chat template files; the embedded targets' are built here."""
    if TARGET in EMBEDDED_TARGETS:
        return [f"{TARGET}/{name}" for name in EMBEDDED_TOKENIZER_FILES[TARGET]]
    return [str(p) for p in sorted(Path(TARGET).iterdir()) if p.name in TOKENIZER_FILES]


def target_files(wildcards=None):
    """What a job that loads the target needs: config, tokenizer (and, for the embedded
    targets, which the workflow builds, the weights)."""
    if TARGET in EMBEDDED_TARGETS:
        return [f"{TARGET}/{name}" for name in EMBEDDED_FILES[TARGET]]
    return [f"{TARGET}/config.json", *tokenizer_files()]


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
        # A dry run (`snakemake -n`) only reports; shards of running jobs are left alone.
        check_finished_shards(
            HIDDEN.format(fp=fp),
            ids,
            fp,
            log=lambda m: print(m, file=sys.stderr),
            dry_run=workflow.dryrun,
        )
    return ids


def hidden_dir(wildcards=None):
    """The current configuration's output directory, once sharding is done: sharding needs the
    target's tokenizer, so the target exists then (the embedded one is built first) and can
    be fingerprinted."""
    shard_manifest()
    return HIDDEN.format(fp=fingerprint()[0])


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


def draft_shards(wildcards):
    """What the draft's rules read: the extracted shards (draft.states: stored), or the token
    shards whose states the capture server streams (stream, cached)."""
    if DRAFT_SETTINGS.states.stored:
        return shard_files(wildcards.fp, ".safetensors")
    return [
        f"{R}/shards/tokens/{s}.safetensors" for s in checked_shard_ids(wildcards.fp)
    ]


def current_shard_files(suffix):
    """Input function: the same for the current configuration's fingerprint."""

    def files(wildcards):
        hidden_dir()  # the target exists once sharding is done
        return shard_files(fingerprint()[0], suffix)

    return files


# Regeneration (regenerate.smk) and what sharding reads (shard.smk).
def source_shards():
    """The source shards of data.path in dataset order, once split_sources has run."""
    with open(checkpoints.split_sources.get().output.manifest) as f:
        return json.load(f)["shards"]


def regenerated_files(suffix):
    """Input function: results/regenerated/<source shard><suffix>, in dataset order."""

    def files(wildcards):
        return [f"{R}/regenerated/{s['id']}{suffix}" for s in source_shards()]

    return files


def shard_data(wildcards):
    """What sharding reads: the regenerated source shards in dataset order, or data.path as
    it is."""
    if REGENERATE["enabled"]:
        return regenerated_files(".jsonl")(wildcards)
    return [config["data"]["path"]]


def shard_regeneration_rejects(wildcards):
    return (
        regenerated_files(".rejects.jsonl")(wildcards) if REGENERATE["enabled"] else []
    )


# The targets (Snakefile).
def extraction_summary(wildcards):
    """Every shard extracted and verified, for the targets. The validation record is named
    too, and not ancient(): when validation re-runs (new engine settings), Snakemake masks
    every job below it and reaches the extract jobs only across ancient() edges, which it
    skips, so their missing shards were never scheduled (Snakemake 9.27, dag.update_needrun).
    This direct edge makes it walk back from the target to every job whose output is missing;
    finished shards stay finished (extract.smk)."""
    return [f"{hidden_dir()}/verify_summary.tsv", f"{hidden_dir()}/validate_env.json"]


def stored_extraction(wildcards):
    """`all`'s extraction: every shard extracted and verified, unless the draft streams its
    states (draft.states: stream | cached), which extracts nothing."""
    return extraction_summary(wildcards) if DRAFT_SETTINGS.states.stored else []


def evaluation_outputs(wildcards):
    """The current configuration's draft vocabulary and acceptance report, for `all`; the
    draft trained on, exported from and evaluated against extraction {fp}."""
    fp = os.path.basename(hidden_dir())
    return [
        f"{R}/draft/{fp}/vocab.json",
        f"{R}/eval/{fp}/acceptance.json",
        # what extraction_summary says, for a streamed run too
        f"{hidden_dir()}/validate_env.json",
    ]


def evaluation_set_files():
    """The files of evaluate.sets that are the user's (not embedded, not the held-out split's
    data.path), as the evaluate rule's inputs, so that an edited set re-evaluates. A missing
    one is left out here: validate_env, and the evaluate job again, stop on it naming it.
    """
    sets = [s for s in sets_from_config(config) if s.format != HELDOUT_SET]
    return [f for f in set_files(sets) if os.path.exists(f)]


def evaluation_given_draft():
    """evaluate.draft's config.json, when set (its weights may be named or sharded as its
    publisher chose; vLLM finds them)."""
    given = config["evaluate"].get("draft")
    return [os.path.join(given, "config.json")] if given else []


def regeneration_done():
    return all(os.path.exists(f) for f in regenerated_files(".jsonl")(None))


def progress_inputs(wildcards):
    """The progress report waits for nothing but the split into source shards while
    regeneration is on and unfinished; then for sharding and the fingerprint."""
    inputs = {}
    if REGENERATE["enabled"]:
        inputs["sources"] = checkpoints.split_sources.get().output.manifest
        if not regeneration_done():
            return inputs
    inputs["manifest"] = shard_manifest()
    inputs["fingerprint"] = f"{hidden_dir()}/fingerprint.json"
    return inputs


def progress_extraction(wildcards):
    """What the extraction report needs, once sharding can be done; None before."""
    if REGENERATE["enabled"] and not regeneration_done():
        return None
    return {
        "hidden_dir": hidden_dir(),
        "layer_ids": layer_ids(),
        "hidden_size": read_target(TARGET).hidden_size,
    }


def progress_training(wildcards):
    """What the draft training report needs (the current extraction's trainer work directory),
    once sharding can be done; None before."""
    if REGENERATE["enabled"] and not regeneration_done():
        return None
    fp = os.path.basename(hidden_dir())
    return {
        "work_dir": f"{R}/draft/{fp}/train.work",
        "ranks": TRAIN_JOB.ranks,
    }
