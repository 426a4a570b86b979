"""Does a briefly trained tiny target answer its prompts? One training arm, then its figures.

Builds an untrained tiny target (the Kimi-K2.5 replica's text model with its tokenizer, or the
embedded target), trains it with the same trainer as the embedded targets
(`eagleflow.embedded.train_target`) on the bundled corpus, and prints the loss of each held-out
conversation's first reply token after its own prompt and after another conversation's
(`first_reply_loss`; a model that ignores its prompt scores them alike), always rendered with
the target's real chat template, plus the held-out loss and a few greedy replies.

The options vary what the training sees, to find why the replica does not learn what the
embedded target learns (docs/measurements/kimi-replica.md):
  --template no-default-system   Kimi's template without its default system turn (training
                                 and figures), to isolate that turn;
  --train-system empty           training conversations start with an explicit empty system
                                 turn (figures still with the default turn);
  --tokenizer-covers-template    the replica's BPE also learns the template's own text (role
                                 names, the default system prompt), as Kimi's vocabulary does.

For the embedded target's corpus (docs/measurements/embedded-chat-corpus.md):
  --corpus, --families, --synthetic-share   the bundled dataset, as the data.bundled_* keys;
  --prompts N                    greedy replies to N held-out prompts (transformers, at most 32
                                 tokens), reported as distinct replies (as `evaluate` counts
                                 them) and as the acceptance length vLLM's n-gram proposer
                                 would reach on them (`ngram_acceptance`), in all and per
                                 family: a quick look, without vLLM, at what `evaluate` will
                                 measure once the pipeline has run.

Usage: .venv/bin/python benchmarks/replica_prompt_dependence.py --workdir /tmp/rpd
       [--target kimi|embedded] [--steps 300] [--batch-tokens 1024] [--lr 6e-3] [options above]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from eagleflow.data.conversations import read_conversations  # noqa: E402
from eagleflow.data.heldout import split  # noqa: E402
from eagleflow.embedded import tiny_kimi  # noqa: E402
from eagleflow.embedded.bundled_data import bundled_rows, write_jsonl  # noqa: E402
from eagleflow.embedded.tiny_target import build_tiny_target, corpus_texts  # noqa: E402
from eagleflow.embedded.train_target import (  # noqa: E402
    TargetTrainConfig,
    first_reply_loss,
    train_target,
)
from eagleflow.evaluate.acceptance import distinct_replies  # noqa: E402
from eagleflow.evaluate.spec_decode_check import Speculation  # noqa: E402
from eagleflow.target.load import load_tokenizer  # noqa: E402


def ngram_acceptance(context: list[int], reply: list[int], k: int, lo: int, hi: int):
    """(draft steps, accepted tokens) of prompt-lookup speculation on a greedy `reply` after
    `context`, as vLLM's n-gram proposer drafts: the longest suffix of `hi` down to `lo`
    tokens found earlier in the text proposes the `k` tokens that followed it (its latest
    occurrence); a verified step adds the accepted tokens and the target's own."""
    ctx, drafts, accepted, i = list(context), 0, 0, 0
    while i < len(reply):
        proposal = []
        for n in range(hi, lo - 1, -1):
            suffix = ctx[-n:]
            for j in range(len(ctx) - n - 1, -1, -1):
                if ctx[j : j + n] == suffix:
                    proposal = ctx[j + n : j + n + k]
                    break
            if proposal:
                break
        m = 0
        if proposal:
            drafts += 1
            while m < len(proposal) and i + m < len(reply) and reply[i + m] == proposal[m]:
                m += 1
            accepted += m
        ctx += reply[i : i + m + 1]
        i += m + 1
    return drafts, accepted


def reply_figures(tok, rows, samples) -> None:
    """Distinct replies and the simulated n-gram acceptance length, in all and per family."""
    lookup = Speculation("ngram", 3).config()  # evaluate's n-gram settings
    family = {r["messages"][0]["content"]: r.get("family", "chat") for r in rows}
    groups: dict[str, list] = {}
    for s in samples:
        ids = tok.apply_chat_template(
            s["messages"], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        reply = tok(s["greedy"], add_special_tokens=False)["input_ids"]
        d, a = ngram_acceptance(
            ids,
            reply,
            lookup["num_speculative_tokens"],
            *(lookup[f"prompt_lookup_{m}"] for m in ("min", "max")),
        )
        groups.setdefault(family.get(s["messages"][0]["content"], "chat"), []).append(
            (s["greedy"], d, a)
        )
    every = [x for g in groups.values() for x in g]
    for name, g in sorted(groups.items()) + [("all", every)]:
        d, a = sum(x[1] for x in g), sum(x[2] for x in g)
        distinct = distinct_replies([x[0] for x in g])
        print(
            f"{name}: {len(g)} prompts, {distinct['different']} different replies, "
            f"{distinct['unique']} unique, n-gram {d} drafts, AL {1 + a / d if d else 1.0:.3f}"
        )
    d, a = sum(x[1] for x in every), sum(x[2] for x in every)
    unique = distinct_replies([x[0] for x in every])["unique"]
    print(f"unique_share={unique / len(every):.3f} ngram_al={1 + a / d if d else 1.0:.3f}")


def default_families() -> list[str]:
    """data.bundled_synthetic_families as the workflow's schema defaults it."""
    from snakemake.utils import validate

    config = {"data": {}}
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    return config["data"]["bundled_synthetic_families"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--target", choices=("kimi", "embedded"), default="kimi")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=6e-3)
    ap.add_argument("--conversations", type=int, default=3000, help="bundled dataset size")
    ap.add_argument("--data-seed", type=int, default=0, help="bundled dataset seed")
    ap.add_argument("--corpus", choices=("synthetic", "chitchat", "mixed"), default="synthetic")
    ap.add_argument("--families", nargs="+", default=default_families(), help="synthetic families")
    ap.add_argument("--synthetic-share", type=float, default=0.8, help="mixed corpus only")
    ap.add_argument("--prompts", type=int, default=6, help="held-out prompts answered greedily")
    ap.add_argument("--template", choices=("kimi", "no-default-system"), default="kimi")
    ap.add_argument("--train-system", choices=("default", "empty"), default="default")
    ap.add_argument("--tokenizer-covers-template", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    data = args.workdir / "bundled-chat.jsonl"  # as the workflow's bundled_dataset rule
    rows = bundled_rows(
        {
            "bundled_conversations": args.conversations,
            "bundled_seed": args.data_seed,
            "bundled_corpus": args.corpus,
            "bundled_synthetic_families": args.families,
            "bundled_synthetic_share": args.synthetic_share,
            "bundled_max_messages": 2,
        }
    )
    write_jsonl(rows, data)
    convs, _ = read_conversations(data)
    base, out = args.workdir / "base", args.workdir / "trained"
    texts = corpus_texts(convs)
    if args.target == "embedded":
        build_tiny_target(texts, base, seed=0)
    else:
        if args.template == "no-default-system":
            turn = tiny_kimi.DEFAULT_SYSTEM_TURN
            assert turn in tiny_kimi.CHAT_TEMPLATE
            tiny_kimi.CHAT_TEMPLATE = tiny_kimi.CHAT_TEMPLATE.replace(turn, "")
        if args.tokenizer_covers_template:
            texts += [tiny_kimi.DEFAULT_SYSTEM, "system", "user", "assistant"] * len(convs)
        tiny_kimi.build_text_model(texts, base, seed=0)
    train_convs = convs
    if args.train_system == "empty":
        train_convs = tiny_kimi.with_empty_system_turn(convs)
    cfg = TargetTrainConfig(
        steps=args.steps, batch_tokens=args.batch_tokens, lr=args.lr, sample_prompts=args.prompts
    )
    summary = train_target(base, train_convs, out, cfg)
    figures = summary["first_reply_token_loss"]
    if args.train_system == "empty":  # the figures that matter: with the default turn
        from transformers import DeepseekV3ForCausalLM

        for name in tiny_kimi.TOKENIZER_FILES:
            shutil.copyfile(base / name, out / name)
        model = DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32)
        figures = first_reply_loss(model, load_tokenizer(out), split(convs)[1])
    print(json.dumps({"arm": vars(args) | {"workdir": str(args.workdir)}}, default=str))
    print(
        f"held-out loss: {summary['heldout_loss_before']:.3f} -> "
        f"{summary['heldout_loss_after']:.3f} ({summary['epochs']} epochs)"
    )
    for s in summary["greedy_heldout_samples"][:4]:
        print(f"greedy: {s['prompt']!r} -> {s['greedy']!r}")
    print(
        f"first reply token loss over {figures['conversations']} held-out conversations: "
        f"own prompt {figures['own_prompt']:.3f}, another's {figures['other_prompt']:.3f}"
    )
    if args.prompts > 6:
        reply_figures(load_tokenizer(out), rows, summary["greedy_heldout_samples"])
    print(f"prompt_gap={figures['other_prompt'] - figures['own_prompt']:.3f}")


if __name__ == "__main__":
    main()
