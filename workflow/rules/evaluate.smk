# Evaluation: acceptance length of the exported draft on held-out prompts (chosen by content
# hash, eagleflow.data.heldout), through vLLM (eagle3 + the n-gram baseline) and a plain-torch
# reference loop. Outputs go under results/eval/{fp}/.

EVAL_CFG = config["evaluate"]


rule evaluate:
    input:
        config=f"{R}/draft/{{fp}}/export/config.json",
        weights=f"{R}/draft/{{fp}}/export/model.safetensors",
        dataset=config["data"]["path"],
        target=target_files,
    output:
        result=f"{R}/eval/{{fp}}/acceptance.json",
        plot=report(
            f"{R}/eval/{{fp}}/acceptance.png",
            caption="../report/acceptance.rst",
            category="Evaluation",
        ),
    log:
        f"{R}/logs/evaluate/{{fp}}.log",
    benchmark:
        f"{R}/benchmarks/evaluate/{{fp}}.tsv"
    conda:
        CONDA_ENV
    # Its engine is an extract job's (TP x PP of extract, on extract.nodes nodes): the same
    # GPUs, CPUs and memory; a runtime from a target load per path and the greedy tokens
    # (resources.smk, eagleflow.plan.resources).
    threads: extract_threads
    resources:
        gpu=jobres.extract_gpu_resource(EXTRACT),
        gres=jobres.extract_gres(EXTRACT),
        nodes=jobres.extract_nodes(EXTRACT),
        cpus_per_task=jobres.extract_cpus(EXTRACT),
        mem_mb=extract_mem_mb,
        runtime=evaluate_runtime,
    params:
        target=TARGET,
        export=lambda wildcards, input: os.path.dirname(input.config),
        workdir=f"{R}/eval/{{fp}}/work",
        cfg=EVAL_CFG,
        heldout_modulus=config["data"]["heldout_modulus"],
    script:
        "../scripts/evaluate.py"
