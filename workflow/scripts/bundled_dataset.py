from eagleflow.embedded.bundled_data import generate_conversations, write_jsonl
from eagleflow.logs import redirect_to_log

with redirect_to_log(snakemake.log[0]):
    rows = generate_conversations(snakemake.params.n, snakemake.params.seed)
    write_jsonl(rows, snakemake.output[0])
    print(f"wrote {len(rows)} conversations to {snakemake.output[0]}")
