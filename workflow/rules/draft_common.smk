# Input functions and paths of the target-training, regeneration, draft and evaluation rules
# (functions only, as `snakemake --lint` asks; common.smk holds the extraction's).

# Response regeneration (regenerate.smk): its output is the dataset the shard rule reads.
REGENERATE = config["data"]["regenerate"]
REGENERATED_DATA = f"{R}/regenerated/dataset.jsonl"
SHARD_DATA = REGENERATED_DATA if REGENERATE["enabled"] else config["data"]["path"]


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
