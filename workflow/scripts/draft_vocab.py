import json

from eagleflow.data.heldout import excluder
from eagleflow.draft.vocab import build_draft_vocab, count_masked_tokens, coverage, save_vocab
from eagleflow.logs import redirect_to_log
from eagleflow.target.head import read_target_config

with redirect_to_log(snakemake.log[0]):
    vocab_size = int(read_target_config(snakemake.params.target)["vocab_size"])
    shards = sorted(snakemake.input.shards)
    heldout = excluder(snakemake.params.heldout_modulus)
    vocab = build_draft_vocab(shards, vocab_size, snakemake.params.size, exclude=heldout)
    held_counts = count_masked_tokens(shards, vocab_size, exclude=lambda sid: not heldout(sid))
    summary = {
        **vocab.summary(),
        "heldout_coverage": coverage(vocab, held_counts),
        "heldout_masked_tokens": int(held_counts.sum()),
    }
    print(
        f"draft vocabulary: {vocab.size} of {vocab_size} target ids, coverage of the "
        f"loss-masked training tokens {summary['coverage']:.2%} ({summary['masked_tokens']} "
        "tokens, "
        f"{summary['distinct_tokens']} distinct), of the held-out ones "
        f"{summary['heldout_coverage']:.2%} ({summary['heldout_masked_tokens']} tokens)"
    )
    save_vocab(vocab, snakemake.output.vocab)
    with open(snakemake.output.summary, "w") as f:
        json.dump(summary, f, indent=1)
