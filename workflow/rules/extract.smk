# One job per shard: load the target in vLLM once, prefill the shard, capture the planned
# layers, commit chunks, write one safetensors file atomically.
# Inputs are content-addressed by their paths (the shard id hashes the tokens, the
# fingerprint hashes what makes the tensors), so a newer mtime cannot mean new content:
# they are ancient() and never trigger re-extraction.


rule extract_shard:
    input:
        tokens=ancient(f"{R}/shards/tokens/{{shard}}.safetensors"),
        plan=ancient(f"{HIDDEN}/capture_plan.json"),
    output:
        hidden=f"{HIDDEN}/{{shard}}.safetensors",
        record=f"{HIDDEN}/{{shard}}.json",
    log:
        f"{R}/logs/extract/{{fp}}/{{shard}}.log",
    benchmark:
        f"{R}/benchmarks/extract/{{fp}}/{{shard}}.tsv"
    conda:
        CONDA_ENV
    threads: workflow.cores
    params:
        target=TARGET,
    script:
        "../scripts/extract_shard.py"
