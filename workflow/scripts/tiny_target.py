from eagleflow.conversations import read_conversations
from eagleflow.logs import redirect_to_log
from eagleflow.tiny_target import build_tiny_target, corpus_texts, describe

with redirect_to_log(snakemake.log[0]):
    conversations, _ = read_conversations(snakemake.input[0])
    out = build_tiny_target(corpus_texts(conversations), snakemake.params.out_dir, seed=snakemake.params.seed)
    print(f"built {out}: {describe(out)}")
