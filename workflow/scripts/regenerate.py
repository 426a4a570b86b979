import json

from eagleflow.data.regenerate import regenerate_dataset
from eagleflow.engine.settings import EngineSettings
from eagleflow.logs import redirect_to_log

# vLLM spawns its engine core for some targets (TP > 1, multimodal wrappers): the spawned
# process imports this file again, without the `snakemake` object.
if __name__ == "__main__":
    with redirect_to_log(snakemake.log[0]):
        summary = regenerate_dataset(
            snakemake.input.data,
            snakemake.params.target,
            snakemake.output.data,
            snakemake.output.rejects,
            max_length=snakemake.params.max_length,
            max_new_tokens=snakemake.params.max_new_tokens,
            on_bad_row=snakemake.params.on_bad_row,
            engine=EngineSettings.from_config(snakemake.config, "regenerate"),
        )
        with open(snakemake.output.summary, "w") as f:
            json.dump(summary, f, indent=1)
