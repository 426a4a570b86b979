import json

from eagleflow.draft_vocab import build_draft_vocab, save_vocab
from eagleflow.logs import redirect_to_log
from eagleflow.target_head import read_target_config

with redirect_to_log(snakemake.log[0]):
    vocab_size = int(read_target_config(snakemake.params.target)["vocab_size"])
    vocab = build_draft_vocab(sorted(snakemake.input.shards), vocab_size, snakemake.params.size)
    summary = vocab.summary()
    print(f"draft vocabulary: {vocab.size} of {vocab_size} target ids, coverage of the "
          f"loss-masked tokens {summary['coverage']:.2%} ({summary['masked_tokens']} tokens, "
          f"{summary['distinct_tokens']} distinct)")
    save_vocab(vocab, snakemake.output.vocab)
    with open(snakemake.output.summary, "w") as f:
        json.dump(summary, f, indent=1)
