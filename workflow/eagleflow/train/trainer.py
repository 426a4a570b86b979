"""The EAGLE-3 draft trainer: a `Trainer` whose loop reads like the algorithm, and hands the
rest to its components.

    data        eagleflow.train.data        shards -> samples -> packs -> this rank's batches
    step        eagleflow.train.step        one optimizer step (objective per token over the
                                            global batch: eagleflow.train.objective)
    schedule    eagleflow.train.optimizer   AdamW or Muon + AdamW, warm-up then cosine
    parallel    eagleflow.train.parallel    process group, FSDP2 with its precision policy
    validation  eagleflow.train.validate    the held-out figures every `eval_every` steps
    checkpoint  eagleflow.train.checkpoint  save every `save_every` steps, resume, best/
    records     eagleflow.train.records     metrics.csv, validation.csv, curves, summary

One optimizer step trains one global batch of `batch_packs` packs, split over the ranks and
each rank's micro-steps, so 2 ranks x 1 pack and 1 rank x 2 packs take the same step. The
held-out samples are never trained on: they give the validation figures and pick the draft
kept in `best/` (what export reads). A rerun resumes from the latest checkpoint, at any world
size, also when the run was extended (`epochs`, `max_steps`); it starts from step 0 only when
something that decides the weights changed (`recipe`), and says which. The learning rate is a
function of the step, the run's total steps and the warm-up its first total fixed (linear
warm-up, cosine to `min_lr_ratio`), so an extended run stretches its remaining decay.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from eagleflow.draft.vocab import DraftVocab
from eagleflow.draft.weights import build_draft
from eagleflow.plan.settings import TrainConfig, check_world, recipe_of
from eagleflow.store.locks import work_lock
from eagleflow.target.head import TargetHead, read_target_config
from eagleflow.train.checkpoint import Checkpoints, Progress, training_state
from eagleflow.train.data import StateSource, StoredStates, TrainData, shard_paths
from eagleflow.train.memory_plan import check_memory
from eagleflow.train.objective import FIGURES, figures
from eagleflow.train.optimizer import build_optimizers, lr_factor, set_lr
from eagleflow.train.parallel import (
    all_reduce,
    all_reduce_sums,
    barrier,
    init_distributed,
    parallelize,
)
from eagleflow.train.records import RunFiles, StepRecord, summary
from eagleflow.train.sequence_parallel import split_groups
from eagleflow.train.states import ServedStates, StreamSource
from eagleflow.train.step import StepContext, train_step
from eagleflow.train.validate import Validator
from eagleflow.train.watchdog import Watchdog


@dataclass
class TrainRun:
    """What one invocation trains: inputs, output folder and settings."""

    shards: list  # the extracted shards (stored), or the token shards (`stream`)
    target_dir: str
    vocab: DraftVocab
    out_dir: str
    cfg: TrainConfig
    draft_overrides: dict = field(default_factory=dict)
    stream: StreamSource | None = None  # draft.states stream | cached: the capture server


@dataclass
class Timing:
    """This invocation's seconds waiting for data and stepping, and its trained tokens."""

    wait: float = 0.0
    step: float = 0.0
    tokens: int = 0
    started: float = field(default_factory=time.time)

    def tokens_per_second(self) -> float:
        return self.tokens / max(time.time() - self.started, 1e-9)


def state_source(run: TrainRun) -> StateSource:
    """The stored shards, or (`run.stream`) the capture server's states of the token shards."""
    paths = shard_paths(run.shards)
    return StoredStates(paths) if run.stream is None else ServedStates(run.stream, paths)


class Trainer:
    """Builds the run's parts (`__init__`), then `train()` runs the loop."""

    def __init__(self, run: TrainRun):
        self.run, cfg = run, run.cfg
        rank, world, device = init_distributed(cfg.device)
        check_world(world, cfg.batch_packs, cfg.sequence_parallel, run.stream is not None)
        self.rank, self.world = rank, world
        if rank == 0:
            os.makedirs(run.out_dir, exist_ok=True)
        num_layers = int(read_target_config(run.target_dir)["num_hidden_layers"])
        self.data = TrainData.read(state_source(run), num_layers, cfg, self.log)
        self._build_model(device)
        self.progress = Progress()
        self.state = training_state(self.model, self.optims, self.progress)
        recipe = recipe_of(cfg, self.model.cfg.architecture(), self.data.layout, run.vocab)
        self.checkpoints = Checkpoints(run.out_dir, rank, recipe, self.log)
        self.start = self.checkpoints.resume(self.state, self.data.total)
        if self.progress.warmup_steps is None:  # a fresh run (or a checkpoint without it)
            self.progress.warmup_steps = round(cfg.warmup_ratio * self.data.total)
        self.files = RunFiles(run.out_dir, cfg.ttt_steps, self.start, rank)
        self.timing = Timing()

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def _build_model(self, device) -> None:
        """The draft (checked against the device's memory first), the target's head, FSDP,
        the optimizers and the step's context."""
        run, cfg, data = self.run, self.run.cfg, self.data
        n_aux = len(data.layout.aux_ids)
        model = build_draft(
            run.target_dir, run.vocab, n_aux, cfg.seed, cfg.lm_head, **run.draft_overrides
        )
        pack_tokens = max(cfg.max_tokens, data.table.longest_train)
        check_memory(model.cfg, cfg, pack_tokens, self.world, device, self.log)
        head = TargetHead.load(run.target_dir, run.vocab.target_ids, dtype=torch.bfloat16)
        self.head = head.to(device)
        self.model = model.to(device)
        self.parallel = parallelize(self.model, device)
        self.optims = build_optimizers(self.model, cfg)
        split = split_groups(self.world, cfg.sequence_parallel, self.rank)
        self.ctx = StepContext(cfg, self.parallel, split)

    @property
    def device(self) -> torch.device:
        return self.parallel.device

    def train(self, stop_after: int | None = None) -> dict:
        """Train from the resumed step to the end (or to `stop_after`, ending there as a
        crash would: no summary) and return the summary."""
        cfg, total, start = self.run.cfg, self.data.total, self.start
        end = total if stop_after is None else min(total, stop_after)
        loader, sampler, val_loader = self.data.loaders(
            cfg, start, end, self.rank, self.world, self.device.type == "cuda", self.run.vocab.t2d
        )
        self.micro_steps = sampler.micro_steps
        if start < end:  # the capture server started before the first step's data wait
            self.data.source.prepare(self.data.table, self.log)
        self.batches = iter(loader)  # forks the loader's workers: before any thread starts
        self.watchdog = Watchdog(self.rank, cfg.stall_timeout)
        self.validate = Validator(self.model, self.head, val_loader, self.ctx, self.watchdog)
        per_rank = f"{self.micro_steps} pack(s) per rank and step"
        self.log(f"{self._mode()} on {self.world} rank(s), {per_rank}")
        self.model.train()
        try:
            for step in range(start, end):
                record = self.train_one(step)
                row = self.files.step(record)
                if (step - start) % 50 == 0:
                    self.log(f"step {step + 1}/{total}: loss {row['loss']}, acc_0 {row['acc_0']}")
                if (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or step + 1 == total:
                    self.validate_and_keep(step + 1)
                if (step + 1) % cfg.save_every == 0 or step + 1 == total:
                    self.save(step + 1)
            if end < total:  # stopped as a crash would
                return {"start_step": start, "end_step": end, "world_size": self.world}
            if start == total and self.checkpoints.best_missing(self.device):  # finished, lost
                self.validate_and_keep(total)
            return self.finish(start, end)
        finally:
            # The loader's workers and the watchdog's thread end with the run, raised or not,
            # not at some later garbage collection (a trainer run in a long-lived process, as
            # in the tests, would keep them, and a later fork would copy a running thread).
            self.batches = None
            self.watchdog.close()

    def train_one(self, step: int) -> StepRecord:
        """One optimizer step: its packs, the update, and its figures summed over the ranks
        (one all-reduce)."""
        cfg, t0 = self.run.cfg, time.perf_counter()
        factor = lr_factor(step, self.data.total, self.progress.warmup_steps, cfg.min_lr_ratio)
        set_lr(self.optims, factor)
        batches, samples, tokens, waited = self.fetch()
        with self.watchdog.waiting(f"step {step + 1}: forward, backward and the all-reduces"):
            result = train_step(self.model, self.head, self.optims, batches, self.ctx, step)
            counts = torch.tensor([samples, tokens, waited], dtype=torch.float64)
            reduced = all_reduce(torch.cat([result.sums.flatten(), counts.to(self.device)]))
        sums, (samples, tokens, wait) = reduced[:-3].view(-1, len(FIGURES)), reduced[-3:].tolist()
        self.watchdog.step_took(time.perf_counter() - t0 - waited)
        self.timing.step += time.perf_counter() - t0
        self.timing.tokens += int(tokens)
        self.progress.step = step + 1
        self.progress.tokens_trained += int(tokens)
        self.progress.samples_trained += int(samples)
        return StepRecord(
            step=step + 1,
            epoch=self.data.epoch_of(step) + 1,
            lr=cfg.lr * factor,
            figures=figures(sums, cfg.step_weight),
            grad_norm=result.grad_norm,
            tokens=int(tokens),
            wait_s=wait / self.world,
            elapsed_s=time.time() - self.timing.started,
        )

    def fetch(self) -> tuple[list, int, int, float]:
        """(this rank's packs of the step, on the host; their samples, their trained tokens,
        the seconds waited for them)."""
        batches, wait = [], 0.0
        for _ in range(self.micro_steps):
            t = time.perf_counter()
            with self.watchdog.waiting("the training loader's next pack"):
                batches.append(next(self.batches))
            wait += time.perf_counter() - t
        self.timing.wait += wait
        samples = sum(b.samples for b in batches)
        return batches, samples, sum(b.trained_tokens for b in batches), wait

    def validate_and_keep(self, step: int) -> None:
        """Validate, record, and offer the draft for best/ (`Checkpoints.offer_best`)."""
        metrics = self.validate(step)
        if metrics is not None:
            self.files.validation(step, metrics)
            al = metrics["simulated_acceptance_length"]
            self.log(f"step {step}: held-out loss {metrics['loss']:.4f}, simulated AL {al:.3f}")
        layout = self.data.layout
        meta = {
            "draft_config": self.model.cfg.to_dict(),
            "aux_ids": layout.aux_ids,
            "layer_ids": layout.layer_ids,
            "target": str(self.run.target_dir),
            "vocab": self.run.vocab.summary(),
        }
        with self.watchdog.waiting(f"keeping the draft of step {step} in best/"):
            self.checkpoints.offer_best(self.model, self.progress, step, metrics, meta)

    def save(self, step: int) -> None:
        """The rows so far, then the checkpoint, then progress.json."""
        self.files.save_rows()
        with self.watchdog.waiting(f"saving the checkpoint of step {step}"):
            self.checkpoints.save(self.state, step)
        self.files.checkpointed(
            {
                "step": step,
                "total_steps": self.data.total,
                "epochs": self.run.cfg.epochs,
                "tokens_trained": self.progress.tokens_trained,
                "tokens_per_second": self.timing.tokens_per_second(),
                "world_size": self.world,
            }
        )

    def finish(self, start: int, end: int) -> dict:
        """The summary (written by rank 0), after every rank arrived."""
        with self.watchdog.waiting("the run's final figures (all-reduce)"):
            wait_s, step_s = all_reduce_sums([self.timing.wait, self.timing.step], self.device)
        run = {
            "world_size": self.world,
            "parallelism": self._mode(),
            "device": self.device.type,
            "micro_steps_per_rank": self.micro_steps,
            "start_step": start,
            "end_step": end,
            "data_wait_share": wait_s / step_s if step_s else 0.0,
            "validation_seconds": self.validate.seconds,
            "seconds": time.time() - self.timing.started,
            "tokens_per_second": self.timing.tokens_per_second(),
        }
        last = self.files.rows[-1] if self.files.rows else None
        result = summary(run, self.data, self.run.cfg, self.progress, last)
        self.files.finished(result)
        with self.watchdog.waiting("the other ranks at the end (barrier)"):
            barrier()
        self.watchdog.close()
        return result

    def _mode(self) -> str:
        mode = self.parallel.describe()
        if self.ctx.split is not None:
            mode += f", sequence parallel over {self.ctx.split.parts} ranks"
        return mode


def train(shards, target_dir, vocab, out_dir, cfg, draft_overrides=None, **kw) -> dict:
    """Train (or resume) into `out_dir` and return the summary. `stop_after`: end after that
    step as a crash would (no checkpoint, no summary); `stream`: the states come from the
    capture server (`TrainRun`). Rank 0 holds the work folder's lock throughout: a second
    trainer on the same folder stops with a sentence instead of deleting this one's saves."""
    stop_after = kw.pop("stop_after", None)
    run = TrainRun(shards, target_dir, vocab, out_dir, cfg, draft_overrides or {}, **kw)
    if int(os.environ.get("RANK", "0")):
        return Trainer(run).train(stop_after)
    with work_lock(out_dir, "the trainer's work folder", "train.lock"):
        return Trainer(run).train(stop_after)
