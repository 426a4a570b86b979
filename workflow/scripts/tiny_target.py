from eagleflow.data.conversations import read_conversations
from eagleflow.embedded.tiny_target import build_tiny_target, corpus_texts, describe
from eagleflow.logs import redirect_to_log

with redirect_to_log(snakemake.log[0]):
    conversations, _ = read_conversations(snakemake.input[0])
    out = build_tiny_target(
        corpus_texts(conversations), snakemake.params.out_dir, seed=snakemake.params.seed
    )
    print(f"built {out}: {describe(out)}")
