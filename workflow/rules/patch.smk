# The capture plan: how hidden states are taken out of the installed vLLM, checked before
# any weights load. The fingerprint is a few small reads (local on a cluster); the plan
# introspects the vLLM of the job environment, so it is a small job.


localrules:
    fingerprint,


rule fingerprint:
    output:
        f"{HIDDEN}/fingerprint.json",
    log:
        f"{R}/logs/fingerprint/{{fp}}.log",
    benchmark:
        f"{R}/benchmarks/fingerprint/{{fp}}.tsv"
    conda:
        CONDA_ENV
    params:
        record=lambda wc: fingerprint_record(wc.fp),
    script:
        "../scripts/write_json.py"


rule patch:
    # Writes the capture plan (capture_plan.json): the strategy and every vLLM method and
    # signature the capture patches rely on, checked. Named after its stage in the workflow's
    # specification.
    input:
        ancient(f"{HIDDEN}/fingerprint.json"),
        # ancient: a re-validation (new settings) must not re-run patch (see extract.smk).
        validated=ancient(f"{HIDDEN}/validate_env.json"),
    output:
        f"{HIDDEN}/capture_plan.json",
    log:
        f"{R}/logs/patch/{{fp}}.log",
    benchmark:
        f"{R}/benchmarks/patch/{{fp}}.tsv"
    conda:
        CONDA_ENV
    resources:
        mem_mb=8000,
        runtime=lambda wildcards, attempt: 15 * attempt,
    params:
        target=TARGET,
        capture=CAPTURE_PARAMS,
    script:
        "../scripts/patch.py"
