"""eagleflow's draft trainer against speculators' own trainer, on the same extraction.

Both arms train an EAGLE-3 draft on the same extracted shards, with the same draft shape and
draft vocabulary and the same token budget, are exported in the speculators format and are
evaluated through the `evaluate` rule's vLLM path (`eagleflow.evaluate.acceptance.run_vllm`:
vLLM eagle3, k = `evaluate.speculative_tokens`, the same held-out prompts for every run):

  ours         `eagleflow.train.trainer.train` with the workflow's `draft:` settings (one process,
               as `train_draft` runs it at one rank), exported by `export_draft` from `best/`.
  speculators  speculators 0.9.0: `Eagle3DraftModel.from_training_args` and its `Trainer`, fed
               by its own `create_train_val_loaders` (`ArrowDataset`, `shift_batch`, multipack
               sampler) from the shards converted to its offline format; exported as its
               `Trainer` saves it (`save_pretrained` of the epoch's checkpoint, bf16).

The conversion (`convert`): every training sample of the shards (outside the held-out split,
`eagleflow.data.heldout.excluder`, and within `draft.max_sample_tokens`: `sample_table`, as the
trainer reads them), then every held-out sample, becomes `hidden_states/hs_{i}.safetensors`
holding `hidden_states` [tokens, aux layers + 1, hidden] (the aux layers in stored order, then
the final pre-norm state: speculators' `ArrowDataset` takes `[:, :-1]` as the aux states and
`[:, -1]` as `verifier_last_hidden_states`, which its model passes through the target's norm and
lm_head) and `token_ids`; bf16 states are copied as stored, fp8 ones dequantized to float32 as
our trainer does. The token dataset (`input_ids`, `loss_mask`, `seq_len`, torch format) is
saved with `datasets.save_to_disk`. The held-out samples come last and `train_data_ratio` puts
the split exactly between them: speculators trains on our training samples only and validates
on our held-out ones.

What the speculators arm is given (from `config/config.yaml`'s `draft:` and the vocabulary):
  - our draft's decoder shape, as its `--draft-config` takes one (the `transformer_layer_config`
    our export writes, read by its `load_draft_transformer_layer_config`), one layer; our
    draft's `norm_before_residual` (and `fc_norm`, `norm_output` where our `DraftConfig` has
    them); our aux layer ids; our `vocab.safetensors` (d2t / t2d);
  - packs of `max_tokens x batch_packs` tokens, one per optimizer step (its trainer takes one
    packed sequence per step), `epochs` epochs: the same tokens per step and about the same
    steps;
  - our optimizer (`draft.optimizer`): AdamW at our lr and weight decay, or its Muon at our
    `muon_lr` and `muon_weight_decay` with torch's lr adjustment ("original", as our
    `torch.optim.Muon`; its own default is "match_rms_adamw") and AdamW on the rest; cosine
    schedule with our warm-up ratio, its cosine cycles set so that it ends at `min_lr_ratio` of
    the peak as ours does;
  - KL loss (`kl_div`, eager implementation), `ttt_steps`, per-step weight `step_weight**k`
    (its `ttt_step_loss_decay`); float32 states and compute (our trainer on CPU: no autocast).
What stays its own (it has no setting for it): gradient clipping at 1.0 (ours 0.5), its draft
lm_head frozen at the target's lm_head rows (ours is trained from a random init), the cosine's
shape (ours: min + (1 - min) * cosine; its: a cosine cut off at min), its multipack packing,
its loss over packed documents (a later TTT step's target may lie in the next document; ours
masks it), its initialisation (`post_init`), and the checkpoint exported (its end-of-epoch one;
ours: the best simulated acceptance length of the validations every `eval_every` steps).

CPU: speculators' `Trainer` places the model and every batch with `.to(self.local_rank)` (the
integer from `get_local_rank()`, i.e. `cuda:0`) and its step timer calls
`torch.accelerator.synchronize()`, which raises without an accelerator. Inside this benchmark
only (`cpu_placement`), while its trainer runs, `speculators.train.trainer.get_local_rank`
returns "cpu" and `torch.accelerator.synchronize` is a no-op when no accelerator is there; both
are restored afterwards. Its autocast then targets "cuda", which torch disables on a CPU-only
machine (float32 compute, as ours). The model is built with `draft_attn_impl="sdpa"` and the
eager loss: its default flex attention and fused Triton losses do not run on CPU.

speculators is not a dependency of eagleflow. Install it outside the venv and outside git:

  .venv/bin/python -m pip install --target /work/spec-deps --no-deps speculators==0.9.0 \\
      hs-connectors==0.9.0 loguru typer "datasets<=5.1.0" multiprocess xxhash

and pass `--speculators-path /work/spec-deps` (put on `sys.path` here, in this process only; the
vLLM evaluation subprocess does not see it).

Per arm and seed it prints the vLLM eagle3 acceptance length (AL, counting the bonus token),
per-position acceptance, drafts, steps, loss-masked tokens trained, the step exported, the
held-out loss (each trainer's own validation: KL weighted by `step_weight**k`) and training
seconds; then per arm the mean, and the paired difference ours - speculators (paired by seed)
with its standard error. Runs already finished in `--workdir` are read back, not redone (use
another `--workdir` for another extraction or config; `--max-steps N`, a smoke run, keeps its
runs apart). Last line:
`ours_al=<mean> speculators_al=<mean>`.

Usage (from the repository root, after `snakemake --cores all all`, which leaves the shards,
the vocabulary and the trained target there):
  .venv/bin/python benchmarks/trainer_head_to_head.py --speculators-path /work/spec-deps
  .venv/bin/python benchmarks/trainer_head_to_head.py --speculators-path DIR \\
      --shards results/hidden/FP/*.safetensors --vocab results/draft/FP/vocab.safetensors \\
      --target resources/targets/tiny-deepseek-v3-trained --seeds 0 1 2
`--threads 1` trains with one torch thread: on a machine that other jobs load, two spinning
threads per process slow down many times over (the vLLM evaluation is not affected).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "workflow"))

import torch  # noqa: E402
import yaml  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from eagleflow.data.heldout import excluder  # noqa: E402
from eagleflow.store.quant import dequantize  # noqa: E402
from eagleflow.target.head import read_target_config  # noqa: E402
from eagleflow.train.data import PackDataset, read_layout, sample_table, shard_paths  # noqa: E402

ARMS = ("ours", "speculators")
# The DraftConfig overrides of an MLA draft, which the speculators arm cannot train.
MLA_KEYS = (
    "decoder",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope_scaling",
)
EMBEDDED_TARGET = "resources/targets/tiny-deepseek-v3-trained"  # a finished run's files
EMBEDDED_SHARDS = "results/hidden/*/*.safetensors"
EMBEDDED_VOCAB = "results/draft/*/vocab.safetensors"


# ---------------------------------------------------------------- settings


def workflow_config(configfiles: list[str]) -> dict:
    """config/config.yaml with each `configfile` merged over it (top-level sections updated
    key by key), defaults filled from the schema as Snakemake fills them."""
    from snakemake.utils import validate

    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    for path in configfiles:
        for section, values in (yaml.safe_load(Path(path).read_text()) or {}).items():
            if isinstance(values, dict):
                config.setdefault(section, {}).update(values)
            else:
                config[section] = values
    validate(config, str(REPO / "workflow" / "schemas" / "config.schema.yaml"))
    return config


def cosine_cycles(min_lr_ratio: float) -> float:
    """HF's cosine schedule (speculators' `scheduler_type: cosine`) is
    0.5 * (1 + cos(2 pi c p)) after warm-up, p from 0 to 1; the `c` that ends it at
    `min_lr_ratio` (0.5 for 0: the usual half cosine)."""
    return math.acos(2 * min_lr_ratio - 1) / (2 * math.pi)


def paired_difference(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of a - b (paired) and its standard error (sd / sqrt(n); 0 for n = 1)."""
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
    return statistics.fmean(diffs), se


# ---------------------------------------------------------------- conversion


def speculators_sample(ids, mask, hidden, scales, layout) -> dict:
    """One sample as speculators' offline hidden-state file holds it: `hidden_states`
    [tokens, aux + 1, hidden] (aux layers in stored order, the final state last; fp8 dequantized
    to float32, bf16 as stored) and `token_ids` (int64); plus its `loss_mask` (int64)."""
    order = layout.aux_index + [layout.final_index]
    states = hidden[:, order]
    if scales is not None:
        states = dequantize(states, scales[:, order])
    return {
        "hidden_states": states.contiguous(),
        "token_ids": ids.long().contiguous(),
        "loss_mask": mask.long(),
    }


@dataclass
class Converted:
    root: str  # the speculators data directory (dataset + hidden_states/)
    train: int  # samples 0 .. train-1: our training samples
    heldout: int  # the rest: our held-out samples
    train_tokens: int  # loss-masked tokens our trainer counts (rows 1..n-1 of each sample)
    aux_ids: list[int]
    hidden_size: int

    @property
    def train_ratio(self) -> float:
        """`train_data_ratio` whose split, int(n * ratio), is exactly `train`."""
        return (self.train + 0.5) / (self.train + self.heldout)


def convert(shards, target, out: Path, max_sample_tokens: int, heldout_modulus: int):
    """The shards' training then held-out samples in speculators' offline format (module doc)."""
    from datasets import Dataset

    layout = read_layout(shard_paths(shards), int(read_target_config(target)["num_hidden_layers"]))
    # what the conversion is of (shard names are content hashes): a match is read back
    source = [[Path(p).name for p in layout.paths], max_sample_tokens, heldout_modulus]
    done = out / "converted.json"
    if done.exists() and json.loads(done.read_text())["source"] == source:
        return Converted(**json.loads(done.read_text())["converted"])
    shutil.rmtree(out, ignore_errors=True)
    (out / "hidden_states").mkdir(parents=True)
    table = sample_table(layout.paths, excluder(heldout_modulus), max_sample_tokens)
    reader = PackDataset(layout, table, 1)
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    train_tokens = 0
    for i, sample in enumerate([*table.train.tolist(), *table.heldout.tolist()]):
        s = speculators_sample(*reader.read(sample), layout)
        save_file(
            {"hidden_states": s["hidden_states"], "token_ids": s["token_ids"]},
            str(out / "hidden_states" / f"hs_{i}.safetensors"),
        )
        rows["input_ids"].append(s["token_ids"].tolist())
        rows["loss_mask"].append(s["loss_mask"].tolist())
        rows["seq_len"].append(len(s["token_ids"]))
        if i < len(table.train):
            train_tokens += int(s["loss_mask"][1:].sum())
    dataset = Dataset.from_dict(rows)
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(out))
    hidden = int(read_target_config(target)["hidden_size"])
    result = Converted(
        str(out), len(table.train), len(table.heldout), train_tokens, layout.aux_ids, hidden
    )
    done.write_text(json.dumps({"source": source, "converted": asdict(result)}))
    return result


# ---------------------------------------------------------------- the arms


def train_ours(shards, target, vocab_path, cfg, overrides, out: Path) -> dict:
    """Our trainer as `train_draft` runs it at one rank, then `export_draft` of `best/`."""
    from eagleflow.draft.vocab import load_vocab
    from eagleflow.draft.weights import load_trained
    from eagleflow.export.speculators_format import export_draft
    from eagleflow.train.trainer import train

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.time()
    summary = train(shards, target, load_vocab(vocab_path), out / "train", cfg, overrides)
    seconds = time.time() - t0
    draft, meta = load_trained(out / "train", target_dir=target)
    export_draft(draft, meta["aux_ids"], shards, target, out / "export")
    return {
        "export": str(out / "export"),
        "train_seconds": round(seconds, 1),
        "steps": summary["steps"],
        "tokens_trained": summary["tokens_trained"],
        "exported_step": summary["best_step"],
        "final_loss": float(summary["last"]["loss"]),
        "val_loss": summary["validation_loss"],
    }


@contextlib.contextmanager
def cpu_placement():
    """speculators' `Trainer` on a CPU-only machine (module doc): its `local_rank` is "cpu",
    and `torch.accelerator.synchronize` does nothing when there is no accelerator."""
    import speculators.train.trainer as trainer_module

    get_local_rank, synchronize = trainer_module.get_local_rank, torch.accelerator.synchronize

    def synchronize_if_any(*args, **kwargs):
        if torch.accelerator.is_available():
            synchronize(*args, **kwargs)

    trainer_module.get_local_rank = lambda: "cpu"
    torch.accelerator.synchronize = synchronize_if_any
    try:
        yield
    finally:
        trainer_module.get_local_rank = get_local_rank
        torch.accelerator.synchronize = synchronize


class MetricRecords(logging.Handler):
    """The dicts speculators' trainer logs to `speculators.metrics` (train steps, validation)."""

    def __init__(self):
        super().__init__()
        self.records: list[dict] = []

    def emit(self, record):
        if isinstance(record.msg, dict):
            self.records.append(record.msg)


def train_speculators(conv: Converted, target, vocab_path, cfg, draft, out: Path):
    """speculators' `Eagle3DraftModel` and `Trainer` on the converted data (module doc), at
    the shape and architecture flags of our `DraftConfig` `draft`."""
    from hs_connectors import FileTransfer
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.cli import load_draft_transformer_layer_config, set_seed
    from speculators.train.dataloader import create_train_val_loaders
    from speculators.train.trainer import Trainer, TrainerConfig

    from eagleflow.draft.model import Eagle3Draft
    from eagleflow.draft.vocab import load_vocab
    from eagleflow.export.speculators_format import transformer_layer_config

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    layer = transformer_layer_config(Eagle3Draft(draft), read_target_config(target))
    (out / "draft_config.json").write_text(json.dumps(layer, indent=1))
    vocab = load_vocab(vocab_path)
    t0 = time.time()
    set_seed(cfg.seed)  # the draft's initialisation (and python / numpy), as its CLI does
    model = Eagle3DraftModel.from_training_args(
        verifier_config=load_draft_transformer_layer_config(str(out / "draft_config.json"), target),
        t2d=vocab.t2d,
        d2t=vocab.d2t,
        verifier_name_or_path=target,
        draft_vocab_size=vocab.size,
        norm_before_residual=draft.norm_before_residual,
        fc_norm=getattr(draft, "fc_norm", False),  # Eagle 3.1 flags, where our draft has them
        norm_output=getattr(draft, "norm_output", False),
        ttt_steps=cfg.ttt_steps,
        target_layer_ids=conv.aux_ids,
        draft_attn_impl="sdpa",
    )
    train_loader, val_loader = create_train_val_loaders(
        data_path=conv.root,
        total_seq_len=cfg.max_tokens * cfg.batch_packs,
        hidden_states_dtype=torch.float32,
        transfer=FileTransfer(Path(conv.root) / "hidden_states"),
        vllm_endpoint="http://localhost:8000/v1",  # never called: on_missing="raise"
        on_missing="raise",
        verifier_name_or_path=target,
        request_timeout=None,
        max_retries=0,
        generation_validation_retries=0,
        max_consecutive_generation_failures=1,
        hidden_size=conv.hidden_size,
        num_target_layers=len(conv.aux_ids),
        num_workers=cfg.num_workers,
        prefetch_factor=cfg.prefetch_factor,
        preprocess=shift_batch,
        train_data_ratio=conv.train_ratio,
        seed=cfg.seed,
    )
    if len(train_loader.dataset) != conv.train or len(val_loader.dataset) != conv.heldout:
        raise RuntimeError("speculators' split does not fall between our train and held-out")
    train_kwargs, val_kwargs = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn="kl_div",
        loss_implementation="eager",
        ttt_steps=cfg.ttt_steps,
        ttt_step_loss_decay=cfg.step_weight,
    )
    config = TrainerConfig(
        lr=cfg.lr,
        num_epochs=cfg.epochs,
        save_path=str(out / "checkpoints"),
        train_call_kwargs=train_kwargs,
        val_call_kwargs=val_kwargs,
        optimizer=cfg.optimizer,
        weight_decay=cfg.weight_decay,
        muon_lr=cfg.muon_lr,
        muon_weight_decay=cfg.muon_weight_decay,
        muon_adjust_lr_fn="original",  # torch's Muon default, which ours steps with
        scheduler_type="cosine",
        scheduler_warmup_ratio=cfg.warmup_ratio,
        scheduler_num_cosine_cycles=cosine_cycles(cfg.min_lr_ratio),
        hidden_states_dtype=torch.float32,
        log_freq=1,
        max_steps=cfg.max_steps or None,
    )
    records, metric_logger = MetricRecords(), logging.getLogger("speculators.metrics")
    level = metric_logger.level
    metric_logger.addHandler(records)
    metric_logger.setLevel(logging.INFO)
    try:
        with cpu_placement():
            trainer = Trainer(model, config, train_loader, val_loader)
            trainer.run_training()
    finally:
        metric_logger.removeHandler(records)
        metric_logger.setLevel(level)
    seconds = time.time() - t0
    steps = trainer.global_step
    # Its export: the last epoch's checkpoint as its Trainer saved it (save_pretrained).
    saved = out / "checkpoints" / str(cfg.epochs - 1)
    export = out / "export"
    export.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(saved / name, export / name)
    train_steps = [r["train"] for r in records.records if "train" in r]
    val = next((r["val"] for r in reversed(records.records) if "val" in r), {})
    return {
        "export": str(export),
        "train_seconds": round(seconds, 1),
        "steps": steps,
        "tokens_trained": cfg.epochs * conv.train_tokens,
        "exported_step": steps,
        "final_loss": train_steps[-1].get("loss") if train_steps else None,
        "val_loss": val.get("loss_epoch"),
    }


# ---------------------------------------------------------------- evaluation and the run


def evaluate_export(export: str, engine, prompts, ev, workdir: Path) -> dict:
    """The `evaluate` rule's vLLM eagle3 path on `prompts`."""
    from eagleflow.evaluate.acceptance import per_prompt_summary, run_vllm
    from eagleflow.evaluate.spec_decode_check import Speculation

    result = run_vllm(engine, Speculation("eagle3", ev.k, export), prompts, ev.max_tokens, workdir)
    if "error" in result:
        raise RuntimeError(f"vLLM eagle3 on {export}: {result['error']}\n{result['stderr_tail']}")
    per_prompt_summary(result)
    keep = ("acceptance_length", "acceptance_rate_per_pos", "num_drafts", "interval")
    return {k: result.get(k) for k in keep} | {"output_token_ids": result["output_token_ids"]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--speculators-path", required=True, help="pip --target directory")
    p.add_argument("--workdir", default="/tmp/ef-head-to-head")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--configfile", nargs="*", default=[], help="merged over config.yaml")
    p.add_argument("--shards", nargs="*", help="default: the working directory's results/")
    p.add_argument("--target", default=EMBEDDED_TARGET)
    p.add_argument("--vocab", help="vocab.safetensors (default: the working directory's)")
    p.add_argument("--dataset", help="the dataset of the held-out prompts (default: data.path)")
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads for training (0: torch's default)"
    )
    p.add_argument("--max-steps", type=int, default=0, help="a smoke run: both arms end early")
    return p.parse_args(argv)


def finished_run(args) -> tuple[list[str], str]:
    """Shards and vocabulary: those given, else the working directory's (one fingerprint)."""
    if args.shards:
        return list(args.shards), args.vocab
    shards = sorted(str(p) for p in Path.cwd().glob(EMBEDDED_SHARDS))
    vocabs = sorted(str(p) for p in Path.cwd().glob(EMBEDDED_VOCAB))
    if len({Path(p).parent.name for p in shards}) != 1 or len(vocabs) != 1:
        sys.exit(f"give --shards and --vocab: found {len(shards)} shards, vocabularies {vocabs}")
    return shards, args.vocab or vocabs[0]


@dataclass
class RunSetup:
    """What every arm of a benchmark run shares: the workflow's draft settings, the finished
    run's shards, vocabulary and target, and the `evaluate` rule's engine and prompts."""

    cfg: object  # TrainConfig
    overrides: dict  # DraftConfig overrides
    modulus: int  # data.heldout_modulus
    shards: list[str]
    vocab: str  # vocab.safetensors
    target: str
    engine: object  # EngineSettings
    ev: object  # EvalSettings
    dataset: str
    prompts: list

    @classmethod
    def read(cls, args) -> RunSetup:
        """From `--configfile`, `--shards`, `--vocab`, `--target` and `--dataset`."""
        from eagleflow.engine.settings import EngineSettings
        from eagleflow.evaluate.acceptance import EvalSettings, load_prompts
        from eagleflow.plan.settings import DraftSettings

        config = workflow_config(args.configfile)
        draft = DraftSettings.from_config(config)
        modulus = draft.heldout_modulus
        cfg = replace(draft.train, device="cpu")  # both arms train on this machine's CPU
        overrides = draft.model.overrides()
        shards, vocab = finished_run(args)
        target = str(Path(args.target).resolve())
        config["target"]["path"] = target
        ev = EvalSettings.from_config(config)
        dataset = args.dataset or config["data"]["path"]
        prompts = load_prompts(dataset, target, ev.num_prompts, modulus)
        engine = EngineSettings.from_config(config, "evaluate")
        return cls(cfg, overrides, modulus, shards, vocab, target, engine, ev, dataset, prompts)


def print_table(results: dict, seeds: list[int], arms: list[str]) -> dict:
    """One row per run, then per arm the mean AL and per-position acceptance, and the paired
    difference; returns the arms' mean AL."""
    print(
        f"{'arm':<12} {'seed':>4} {'AL':>6}  {'per-position acceptance':<24} {'drafts':>6} "
        f"{'steps':>5} {'tokens':>7} {'exported':>8} {'val_loss':>8} {'train_s':>7}"
    )
    runs = {arm: [results[(arm, s)] for s in seeds if (arm, s) in results] for arm in arms}
    for arm in arms:
        for r in runs[arm]:
            pos = " / ".join(f"{x:.3f}" for x in r["acceptance_rate_per_pos"])
            print(
                f"{arm:<12} {r['seed']:>4} {r['acceptance_length']:>6.3f}  {pos:<24} "
                f"{r['num_drafts']:>6} {r['steps']:>5} {r['tokens_trained']:>7} "
                f"{r['exported_step']:>8} {r['val_loss']:>8.4f} {r['train_seconds']:>7.0f}"
            )
    replies = {tuple(map(tuple, r["output_token_ids"])) for r in results.values()}
    same = len(replies) == 1
    print(f"the same greedy replies in every run (speculation must not change them): {same}")
    means = {}
    for arm in arms:
        als = [r["acceptance_length"] for r in runs[arm]]
        if not als:
            continue
        means[arm] = statistics.fmean(als)
        per_pos = zip(*(r["acceptance_rate_per_pos"] for r in runs[arm]))
        print(
            f"{arm}: mean AL {means[arm]:.3f} over {len(als)} seeds ({min(als):.3f} to "
            f"{max(als):.3f}); mean per-position acceptance "
            + " / ".join(f"{statistics.fmean(p):.3f}" for p in per_pos)
        )
    paired = [s for s in seeds if ("ours", s) in results and ("speculators", s) in results]
    if paired:
        diff, se = paired_difference(
            [results[("ours", s)]["acceptance_length"] for s in paired],
            [results[("speculators", s)]["acceptance_length"] for s in paired],
        )
        print(f"ours - speculators, paired by seed {paired}: {diff:+.3f} +- {se:.3f} (SE)")
    return means


def main(argv=None):
    args = parse_args(argv)
    sys.path.insert(0, str(Path(args.speculators_path).resolve()))
    if args.threads:  # two spinning threads on a core another job uses slow down many times
        torch.set_num_threads(args.threads)
    from eagleflow.draft.model import DraftConfig
    from eagleflow.draft.vocab import load_vocab

    setup = RunSetup.read(args)
    cfg, overrides, modulus = setup.cfg, setup.overrides, setup.modulus
    if args.max_steps:
        cfg = replace(cfg, max_steps=args.max_steps)
    shards, vocab_path, target = setup.shards, setup.vocab, setup.target
    engine, ev, prompts, dataset = setup.engine, setup.ev, setup.prompts, setup.dataset
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"{len(shards)} shards, vocabulary {vocab_path}, target {target}; {len(prompts)} "
        f"held-out prompts of {dataset}, k={ev.k}, at most {ev.max_tokens} tokens"
    )
    print(f"draft settings: {json.dumps(asdict(cfg))}")

    conv = None
    if "speculators" in args.arms:
        t0 = time.time()
        conv = convert(shards, target, work / "speculators-data", cfg.max_sample_tokens, modulus)
        print(
            f"speculators' offline data: {conv.train} training + {conv.heldout} held-out samples "
            f"in {conv.root} ({time.time() - t0:.0f} s)"
        )
        vocab = load_vocab(vocab_path)
        # our trainer's draft (`build_draft`): the target's shape and the DraftConfig overrides;
        # always a Llama layer: speculators 0.9 trains Llama and Qwen3 drafts only
        llama = {k: v for k, v in overrides.items() if k not in MLA_KEYS}
        if llama != overrides:
            print(
                "speculators arm: a llama draft (speculators 0.9 has no MLA draft); ours: "
                f"draft.architecture {overrides['decoder']} (auto: mla for an MLA target)"
            )
        draft = DraftConfig.for_target(
            read_target_config(target), vocab.size, len(conv.aux_ids), **llama
        )

    results = {}
    for seed in args.seeds:
        for arm in args.arms:
            runs = work / (f"runs-max-steps-{args.max_steps}" if args.max_steps else "runs")
            run = runs / f"{arm}-seed{seed}"
            done = run / "result.json"
            if done.exists():
                results[(arm, seed)] = json.loads(done.read_text())
                continue
            print(f"--- {arm}, seed {seed}", flush=True)
            seeded = replace(cfg, seed=seed)
            if arm == "ours":
                trained = train_ours(shards, target, vocab_path, seeded, overrides, run)
            else:
                trained = train_speculators(conv, target, vocab_path, seeded, draft, run)
            measured = evaluate_export(trained["export"], engine, prompts, ev, run / "eval")
            results[(arm, seed)] = trained | measured | {"arm": arm, "seed": seed}
            done.write_text(json.dumps(results[(arm, seed)]))
            print(
                f"{arm} seed {seed}: AL {measured['acceptance_length']:.3f}, trained "
                f"{trained['steps']} steps in {trained['train_seconds']:.0f} s",
                flush=True,
            )

    print()
    means = print_table(results, args.seeds, args.arms)
    print(
        f"ours_al={means.get('ours', float('nan')):.3f} "
        f"speculators_al={means.get('speculators', float('nan')):.3f}"
    )


if __name__ == "__main__":
    main()
