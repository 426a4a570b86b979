# Evaluation: acceptance length of the exported draft (and of evaluate.draft's, side by side)
# on each prompt set of evaluate.sets (default: the held-out split, chosen by content hash,
# eagleflow.data.heldout), at each k, through vLLM (eagle3 + the n-gram baseline) and a
# plain-torch reference loop. Outputs go under results/eval/{fp}/ (docs/evaluation.md).

EVAL_CFG = config["evaluate"]


rule evaluate:
    input:
        config=f"{R}/draft/{{fp}}/export/config.json",
        weights=f"{R}/draft/{{fp}}/export/model.safetensors",
        dataset=config["data"]["path"],
        sets=evaluation_set_files(),
        given_draft=evaluation_given_draft(),
        target=target_files,
    output:
        result=f"{R}/eval/{{fp}}/acceptance.json",
        plot=report(
            f"{R}/eval/{{fp}}/acceptance.png",
            caption="../report/acceptance.rst",
            category="Evaluation",
        ),
        table=report(
            f"{R}/eval/{{fp}}/acceptance.md",
            caption="../report/acceptance-table.rst",
            category="Evaluation",
        ),
    log:
        f"{R}/logs/evaluate/{{fp}}.log",
    benchmark:
        f"{R}/benchmarks/evaluate/{{fp}}.tsv"
    conda:
        CONDA_ENV
    # Its engine is an extract job's (TP x PP of extract, on extract.nodes nodes): the same
    # GPUs, CPUs and memory; a runtime from a target load per path and k and the greedy tokens
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
