"""Draft-training throughput on CPU: tokens per second per rank and the data wait, 1 and 2 ranks.

Runs the trainer as the workflow does (`torchrun --nproc_per_node N -m eagleflow.train.cli`,
FSDP2 over gloo) at the trainer's loader defaults (`TrainConfig.num_workers`,
`prefetch_factor`), for 1 and 2 ranks on each of two sets, and reads each run's summary.json
and metrics.csv:

  embedded  the embedded default's shards: a finished run's (`--shards`, `--target`, `--vocab`,
            or found under results/ and resources/ of the working directory), else built here
            as the workflow builds them (the embedded target, the 3,000 bundled conversations
            tokenized and cut into shards of 512) with random states of its shape (layer ids
            [2, 4, 5, 8] x hidden 256, bf16), written by the extraction's own shard writer;
            the draft vocabulary as `draft_vocab` makes it (512 ids).
  kimi      synthetic shards at Kimi-K2.5's row width (layer ids [2, 30, 58, 61] x hidden
            7168: 57,344 bytes per token in bf16, 28,672 plus scales in fp8), written by the
            same writer, so the loader reads real files; a target of that hidden size with a
            small vocabulary and a draft with a small vocabulary, MLP and attention, so that it
            fits a CPU and a step takes seconds. The draft's fc (3 x 7168 -> 7168) stays real.

Per run: trained (loss-masked) tokens per second per rank and rows (packed tokens) per second
per rank over the steps after the first, the states those rows carry (MB/s per rank), and
`data_wait_share` (summary.json: seconds the ranks waited for their next pack over seconds in
steps, the whole run, the first step's worker start included), with the share after the first
step beside it. Then the loader alone (`TrainData.loaders` for rank 0 of 1, nothing training):
the rows and MB per second it delivers on this machine. The last line is
`embedded_rank1_tok_s=... embedded_rank2_tok_s=... kimi_rank1_tok_s=... kimi_rank2_tok_s=...
data_wait_share=<largest of the runs>`; the goal (issue 26) is a data_wait_share of at most
0.05.

Usage (from the repository root):
  .venv/bin/python benchmarks/train_throughput.py [--workdir DIR] [--sets embedded kimi]
  .venv/bin/python benchmarks/train_throughput.py --shards results/hidden/FP/*.safetensors \
      --target resources/targets/tiny-deepseek-v3-trained --vocab results/draft/FP/vocab.safetensors
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from eagleflow.capture.plan import CapturePlan, Strategy  # noqa: E402
from eagleflow.data.heldout import HELDOUT_MODULUS, excluder  # noqa: E402
from eagleflow.data.shards import TokenShard  # noqa: E402
from eagleflow.draft.vocab import build_draft_vocab, save_vocab  # noqa: E402
from eagleflow.extract.shard import chunk_targets, finish_shard, prepare_shard_file  # noqa: E402
from eagleflow.plan.settings import TrainConfig  # noqa: E402
from eagleflow.store.chunks import ShardChunks  # noqa: E402
from eagleflow.store.quant import DEFAULT_STORAGE, STORAGE_DTYPES, is_fp8, quantize  # noqa: E402
from eagleflow.target.head import EMBED, LM_HEAD, NORM, read_target_config  # noqa: E402
from eagleflow.target.layers import default_layer_ids  # noqa: E402
from eagleflow.train.data import (  # noqa: E402
    PackPlan,
    RankSampler,
    StoredStates,
    TrainData,
    sample_table,
    shard_paths,
)

FP = "benchmark000000"  # the synthetic sets' extraction fingerprint
CHUNK_TOKENS = 4096  # extract.chunk_tokens: rows committed per chunk, as the workflow writes
# A finished embedded run's files, relative to its working directory.
EMBEDDED_TARGET = "resources/targets/tiny-deepseek-v3-trained"
EMBEDDED_SHARDS = "results/hidden/*/*.safetensors"
EMBEDDED_VOCAB = "results/draft/*/vocab.safetensors"
EMBEDDED_SHARD_SIZE, EMBEDDED_MAX_LENGTH, EMBEDDED_VOCAB_SIZE = 512, 512, 512  # config.yaml

# Kimi-K2.5's text model: the widths the stored rows and the draft's fc have.
KIMI_HIDDEN, KIMI_LAYERS = 7168, 61
# Small vocabularies: the embedding and the lm_heads are not what this measures.
KIMI_TARGET_VOCAB, KIMI_DRAFT_VOCAB = 2048, 256
# The draft's attention and MLP cut to a sliver of their real size (the fc's 154M weights,
# which read the rows, stay): a step of 512 rows takes seconds on 2 cores, not minutes.
KIMI_DRAFT = dict(intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
KIMI_SAMPLES = (2, 24, 32, 192)  # shards, samples per shard, shortest and longest sample
ITEM_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}  # safetensors dtype codes


@dataclass(frozen=True)
class Arm:
    """One data set and the trainer settings it runs at (TrainConfig fields, DraftConfig
    overrides)."""

    name: str
    shards: list[str]
    target: str
    vocab: str
    train: dict
    draft: dict
    row_bytes: int  # bytes of states per stored token


# ---------------------------------------------------------------- the sets


def capture_plan(layer_ids: list[int], num_layers: int, hidden: int, storage: str) -> CapturePlan:
    """The plan an extraction of this shape would have (what the shard writer reads)."""
    return CapturePlan(
        strategy=Strategy.AUX_LAYERS,
        requested_strategy="auto",
        layer_ids=layer_ids,
        num_hidden_layers=num_layers,
        hidden_size=hidden,
        architecture="DeepseekV3ForCausalLM",
        wrapper=None,
        llama_4_scaling=None,
        vllm_version="benchmark",
        device="cpu",
        checks_passed=[],
        fingerprint=FP,
        storage_dtype=storage,
    )


def write_extracted(shard: TokenShard, plan: CapturePlan, out_dir: Path, seed: int) -> Path:
    """`shard` with random bf16 states, through the extraction's writer: the file made in its
    final layout, every chunk's rows written in place (quantized in fp8 storage) and committed,
    the file linked into place."""
    out = out_dir / f"{shard.shard_id}.safetensors"
    chunks = ShardChunks.plan(shard, FP, out, CHUNK_TOKENS)
    shard_file = prepare_shard_file(chunks, plan, "bfloat16")
    g = torch.Generator().manual_seed(seed)
    for i in range(len(chunks.ranges)):
        n = chunks.n_tokens(i)
        states = torch.randn(n, len(plan.layer_ids), plan.hidden_size, generator=g).bfloat16()
        (target,) = chunk_targets(chunks, plan, shard_file, i).values()
        target.commit(*(quantize(states) if is_fp8(plan.storage_dtype) else (states, None)))
    finish_shard(chunks, out)
    shutil.rmtree(chunks.partial_dir)
    return out


def build_embedded(root: Path) -> tuple[list[str], str, str]:
    """The embedded default's target, token shards and vocabulary, with random states."""
    from transformers import AutoTokenizer

    from eagleflow.data.conversations import Conversation
    from eagleflow.data.shards import build_shards
    from eagleflow.data.templating import tokenize_conversation, tokenizer_digest
    from eagleflow.embedded.bundled_data import generate_conversations
    from eagleflow.embedded.tiny_target import build_tiny_target, corpus_texts

    done = root / "done.json"
    if done.exists():
        return tuple(json.loads(done.read_text()))
    shutil.rmtree(root, ignore_errors=True)
    rows = generate_conversations(3000, 0)  # data.bundled_conversations, bundled_seed
    convs = [Conversation(r["id"], tuple(r["messages"]), "bundled", i) for i, r in enumerate(rows)]
    target = build_tiny_target(corpus_texts(convs), root / "target", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(target)
    toks = [tokenize_conversation(tokenizer, c.messages, EMBEDDED_MAX_LENGTH) for c in convs]
    shards = build_shards(convs, toks, EMBEDDED_SHARD_SIZE, tokenizer_digest(tokenizer))
    config = json.loads((target / "config.json").read_text())
    num_layers = config["num_hidden_layers"]
    plan = capture_plan(
        default_layer_ids(num_layers), num_layers, config["hidden_size"], DEFAULT_STORAGE
    )
    hidden = root / "hidden"
    hidden.mkdir()
    paths = [str(write_extracted(s, plan, hidden, i)) for i, s in enumerate(shards)]
    vocab = root / "vocab.safetensors"
    counts_vocab = build_draft_vocab(
        paths, config["vocab_size"], EMBEDDED_VOCAB_SIZE, exclude=excluder(HELDOUT_MODULUS)
    )
    save_vocab(counts_vocab, vocab)
    result = [paths, str(target), str(vocab)]
    done.write_text(json.dumps(result))
    return tuple(result)


def finished_embedded(args) -> tuple[list[str], str, str] | None:
    """A finished run's shards, target and vocabulary: the ones given, else the working
    directory's (one extraction fingerprint only)."""
    if args.shards:
        return list(args.shards), args.target, args.vocab
    shards = sorted(Path.cwd().glob(EMBEDDED_SHARDS))
    vocabs = sorted(Path.cwd().glob(EMBEDDED_VOCAB))
    target = Path.cwd() / EMBEDDED_TARGET
    fps = {p.parent.name for p in shards}
    if len(fps) == 1 and len(vocabs) == 1 and (target / "config.json").exists():
        return [str(p) for p in shards], str(target), str(vocabs[0])
    return None


def build_kimi(root: Path, storage: str) -> tuple[list[str], str, str]:
    """A target of Kimi-K2.5's hidden size (small vocabulary; only its embedding, final norm
    and lm_head are read) and shards of its row width: random token ids, each sample's first
    third a prompt (loss mask 0), states random."""
    done = root / "done.json"
    if done.exists():
        return tuple(json.loads(done.read_text()))
    shutil.rmtree(root, ignore_errors=True)
    target = root / "target"
    target.mkdir(parents=True)
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": KIMI_HIDDEN,
        "intermediate_size": 18432,
        "num_hidden_layers": KIMI_LAYERS,
        "vocab_size": KIMI_TARGET_VOCAB,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
    }
    (target / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    save_file(
        {
            EMBED: (0.02 * torch.randn(KIMI_TARGET_VOCAB, KIMI_HIDDEN, generator=g)).bfloat16(),
            NORM: torch.ones(KIMI_HIDDEN).bfloat16(),
            LM_HEAD: (0.02 * torch.randn(KIMI_TARGET_VOCAB, KIMI_HIDDEN, generator=g)).bfloat16(),
        },
        str(target / "model.safetensors"),
    )
    plan = capture_plan(default_layer_ids(KIMI_LAYERS), KIMI_LAYERS, KIMI_HIDDEN, storage)
    hidden = root / "hidden"
    hidden.mkdir()
    n_shards, n_samples, shortest, longest = KIMI_SAMPLES
    paths = []
    for s in range(n_shards):
        lengths = torch.randint(shortest, longest + 1, (n_samples,), generator=g)
        offsets = np.concatenate([[0], np.cumsum(lengths.numpy())]).astype(np.int64)
        ids = torch.randint(0, KIMI_TARGET_VOCAB, (int(offsets[-1]),), generator=g).numpy()
        mask = np.ones(len(ids), dtype=np.uint8)
        for a, b in zip(offsets[:-1], offsets[1:]):
            mask[a : a + (b - a) // 3] = 0
        sample_ids = [f"kimi-{s}-{i}" for i in range(n_samples)]
        shard = TokenShard(f"kimi{s:016d}", sample_ids, ids.astype(np.int64), mask, offsets)
        paths.append(str(write_extracted(shard, plan, hidden, s)))
    vocab = root / "vocab.safetensors"
    save_vocab(
        build_draft_vocab(paths, KIMI_TARGET_VOCAB, KIMI_DRAFT_VOCAB, excluder(HELDOUT_MODULUS)),
        vocab,
    )
    result = [paths, str(target), str(vocab)]
    done.write_text(json.dumps(result))
    return tuple(result)


def row_bytes(path: str) -> int:
    """Bytes of states (and fp8 scales) per stored token of a shard."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        slices = [f.get_slice(k) for k in f.keys() if k.startswith("hidden_")]
        return sum(ITEM_BYTES[t.get_dtype()] * int(np.prod(t.get_shape()[1:])) for t in slices)


# ---------------------------------------------------------------- the runs


def train_rows(arm: Arm, steps: int) -> list[int]:
    """Rows (packed tokens, all ranks) of each of the first `steps` steps: the trainer's pack
    plan, computed again (it is a pure function of the shards and the settings)."""
    cfg = TrainConfig(**arm.train)
    table = sample_table(shard_paths(arm.shards), excluder(cfg.heldout_modulus))
    plan = PackPlan(table, cfg.max_tokens, cfg.batch_packs, cfg.seed)
    starts = plan.epoch_starts(cfg.epochs)
    rows = []
    for step in range(min(steps, starts[-1])):
        packs = RankSampler(plan, starts, step, step + 1, 0, 1)
        rows.append(sum(int(table.length[list(p)].sum()) for p in packs))
    return rows


def run(arm: Arm, ranks: int, workdir: Path) -> dict:
    """One trainer run under torchrun; its figures."""
    out = workdir / "runs" / f"{arm.name}-{ranks}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc_per_node", str(ranks), "-m", "eagleflow.train.cli"]
    cmd += ["--shards", *arm.shards, "--target", arm.target, "--vocab", arm.vocab]
    cmd += ["--out", str(out), "--config", json.dumps(arm.train), "--draft", json.dumps(arm.draft)]
    env = dict(os.environ, PYTHONPATH=str(REPO / "workflow"))
    t0 = time.perf_counter()
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    if proc.returncode:
        tail = log.read_text()[-4000:]
        sys.exit(f"{arm.name}, {ranks} rank(s) failed ({proc.returncode}), {log}:\n{tail}")
    summary = json.loads((out / "summary.json").read_text())
    with open(out / "metrics.csv", newline="") as f:
        steps = list(csv.DictReader(f))
    rows = train_rows(arm, len(steps))
    elapsed = [float(r["elapsed_s"]) for r in steps]
    tokens = [int(r["tokens"]) for r in steps]
    wait = [float(r["data_wait_s"]) for r in steps]  # per step, mean over the ranks
    later = elapsed[-1] - elapsed[0]  # the steps after the first
    result = {
        "set": arm.name,
        "ranks": ranks,
        "steps": len(steps),
        "tokens": summary["tokens_trained"],
        "first_step_s": elapsed[0],
        "step_s": later / max(len(steps) - 1, 1),
        "tok_s": sum(tokens[1:]) / later / ranks,
        "rows_s": sum(rows[1:]) / later / ranks,
        "wait_share": summary["data_wait_share"],
        "wait_share_later": sum(wait[1:]) / later,
        "wall_s": wall,
    }
    result["mb_s"] = result["rows_s"] * arm.row_bytes / 1e6
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # the largest files
    return result


def feed_rate(arm: Arm, packs: int) -> dict:
    """The loader alone, as rank 0 of 1 builds it (`TrainData.loaders`: the trainer's workers
    and prefetch), its first `packs` packs read as fast as it delivers them: the rows per
    second it can feed on this machine, worker start included, and its first pack's wait."""
    warnings.filterwarnings("ignore", "This DataLoader will create")  # more workers than CPUs
    cfg = TrainConfig(**arm.train | {"max_steps": 0})  # every epoch's packs, not the runs' steps
    num_layers = int(read_target_config(arm.target)["num_hidden_layers"])
    source = StoredStates(shard_paths(arm.shards))
    data = TrainData.read(source, num_layers, cfg, log=lambda msg: None)
    loader, sampler, _ = data.loaders(cfg, 0, data.total, 0, 1, pin=False)
    packs = min(packs, len(sampler))
    t0 = time.perf_counter()
    batches = iter(loader)
    rows = next(batches).states.shape[0]
    first = time.perf_counter() - t0
    for _, batch in zip(range(packs - 1), batches):
        rows += batch.states.shape[0]
    seconds = time.perf_counter() - t0
    del batches
    rows_s = rows / seconds
    return {
        "packs": packs,
        "first_s": first,
        "rows_s": rows_s,
        "mb_s": rows_s * arm.row_bytes / 1e6,
    }


def arms(args, workdir: Path) -> list[Arm]:
    common = {"eval_every": 0, "save_every": 10**9, "seed": 0}
    if args.num_workers is not None:
        common["num_workers"] = args.num_workers
    if args.prefetch_factor is not None:
        common["prefetch_factor"] = args.prefetch_factor
    out = []
    if "embedded" in args.sets:
        found = finished_embedded(args)
        source = "a finished run" if found else "built here"
        shards, target, vocab = found or build_embedded(workdir / "embedded")
        train = common | {"max_steps": args.embedded_steps, "max_tokens": 512, "batch_packs": 8}
        train |= {"eval_samples": 64}
        arm = Arm("embedded", shards, target, vocab, train, {}, row_bytes(shards[0]))
        print(f"embedded: {len(shards)} shards ({source}), target {target}")
        out.append(arm)
    if "kimi" in args.sets:
        storage = args.storage_dtype
        shards, target, vocab = build_kimi(workdir / f"kimi-{storage}", storage)
        train = common | {"max_steps": args.kimi_steps, "max_tokens": 256, "batch_packs": 2}
        train |= {"eval_samples": 4}
        out.append(Arm("kimi", shards, target, vocab, train, KIMI_DRAFT, row_bytes(shards[0])))
        print(f"kimi: {len(shards)} shards of {storage} states, target {target}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="/tmp/ef-train-bench", help="sets and runs go here")
    p.add_argument("--sets", nargs="+", default=["embedded", "kimi"], choices=["embedded", "kimi"])
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 2])
    p.add_argument("--shards", nargs="+", help="a finished embedded run's shards")
    p.add_argument("--target", help="its target (with --shards)")
    p.add_argument("--vocab", help="its vocab.safetensors (with --shards)")
    p.add_argument("--embedded-steps", type=int, default=12)
    p.add_argument("--kimi-steps", type=int, default=4)
    p.add_argument("--feed-packs", type=int, default=200, help="packs the loader alone reads")
    p.add_argument("--storage-dtype", default=DEFAULT_STORAGE, choices=STORAGE_DTYPES)
    p.add_argument("--num-workers", type=int, help="default: TrainConfig's")
    p.add_argument("--prefetch-factor", type=int, help="default: TrainConfig's")
    args = p.parse_args(argv)
    if args.shards and not (args.target and args.vocab):
        p.error("--shards needs --target and --vocab")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    sets = arms(args, workdir)
    print(
        f"sets ready in {time.perf_counter() - t0:.0f} s; {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}, load average {os.getloadavg()[0]:.1f}"
    )
    loader = TrainConfig()
    print(
        f"loader: {args.num_workers or loader.num_workers} workers, prefetch "
        f"{args.prefetch_factor or loader.prefetch_factor} per worker, per rank"
    )
    results = [run(arm, ranks, workdir) for arm in sets for ranks in args.ranks]
    print()
    print(
        "| set | ranks | steps | tokens trained | first step s | s/step | trained tok/s per rank "
        "| rows/s per rank | states MB/s per rank | data_wait_share | after step 1 | run wall s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['set']} | {r['ranks']} | {r['steps']} | {r['tokens']:,} | "
            f"{r['first_step_s']:.2f} | {r['step_s']:.2f} | {r['tok_s']:,.0f} | "
            f"{r['rows_s']:,.0f} | {r['mb_s']:,.1f} | {r['wait_share']:.4f} | "
            f"{r['wait_share_later']:.4f} | {r['wall_s']:.0f} |"
        )
    print()
    print("| set | bytes of states per row | loader alone: packs | first pack s | rows/s | MB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for arm in sets:
        feed = feed_rate(arm, args.feed_packs)
        print(
            f"| {arm.name} | {arm.row_bytes:,} | {feed['packs']} | {feed['first_s']:.2f} | "
            f"{feed['rows_s']:,.0f} | "
            f"{feed['mb_s']:,.0f} |"
        )
    for arm in sets:
        draft = f"; draft {json.dumps(arm.draft)}" if arm.draft else ""
        print(f"{arm.name}: settings {json.dumps(arm.train)}{draft}")
    print(f"load average {os.getloadavg()[0]:.1f}; total {time.perf_counter() - t0:.0f} s")
    figures = " ".join(f"{r['set']}_rank{r['ranks']}_tok_s={r['tok_s']:.0f}" for r in results)
    print(f"{figures} data_wait_share={max(r['wait_share'] for r in results):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
