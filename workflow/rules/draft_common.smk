# Input functions and paths of the target-training, regeneration, draft and evaluation rules
# (functions only, as `snakemake --lint` asks; common.smk holds the extraction's).

# Response regeneration (regenerate.smk): its source shards, regenerated, are the dataset
# the shard rule reads.
REGENERATE = config["data"]["regenerate"]
SOURCES_MANIFEST = f"{R}/regenerated/sources.json"


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
    """What sharding reads (shard.smk): the regenerated source shards in dataset order, or
    data.path as it is."""
    if REGENERATE["enabled"]:
        return regenerated_files(".jsonl")(wildcards)
    return [config["data"]["path"]]


def shard_regeneration_rejects(wildcards):
    return (
        regenerated_files(".rejects.jsonl")(wildcards) if REGENERATE["enabled"] else []
    )


@cache
def measured_regeneration():
    return jobres.measured_regeneration(f"{R}/regenerated")


def regenerate_runtime(wildcards, attempt):
    """SLURM time limit: the shard's user turns x max_new_tokens at the measured decode rate
    (finished shards' summaries, else data.regenerate.tokens_per_second), plus the model load
    (measured, else extract.model_load_minutes), times the attempt. In a group of N that
    shares one engine server (REGENERATE_GROUP), each job carries 1/N of the load."""
    (entry,) = [s for s in source_shards() if s["id"] == wildcards.source]
    tokens_per_second, engine_start_s = measured_regeneration()
    load = engine_start_s / 60 if engine_start_s else EXTRACT["model_load_minutes"]
    if REGENERATE_GROUP and EXTRACT["engine_reuse"]:
        load /= SHARDS_PER_ALLOCATION
    return jobres.extract_runtime_minutes(
        entry["prompts"] * REGENERATE["max_new_tokens"],
        tokens_per_second or REGENERATE["tokens_per_second"],
        load,
        attempt=attempt,
    )


def target_tokenizer_files(wildcards=None):
    """The target's tokenizer and chat template files; the embedded targets' are built here."""
    if TARGET in EMBEDDED_TARGETS:
        return [f"{TARGET}/{name}" for name in EMBEDDED_TOKENIZER_FILES[TARGET]]
    return tokenizer_files(wildcards)


def target_files(wildcards=None):
    """What a job that loads the target needs: config, tokenizer (and, for the embedded
    targets, which the workflow builds, the weights)."""
    if TARGET in EMBEDDED_TARGETS:
        return [f"{TARGET}/{name}" for name in EMBEDDED_FILES[TARGET]]
    return [f"{TARGET}/config.json", *tokenizer_files(wildcards)]


def evaluation_outputs(wildcards):
    """The current configuration's draft vocabulary and acceptance report, for `all`; the
    draft trained on, exported from and evaluated against extraction {fp}."""
    fp = os.path.basename(hidden_dir())
    return [f"{R}/draft/{fp}/vocab.json", f"{R}/eval/{fp}/acceptance.json"]


# The progress report (progress.smk).
def regeneration_done():
    return all(os.path.exists(f) for f in regenerated_files(".jsonl")(None))


def progress_inputs(wildcards):
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
