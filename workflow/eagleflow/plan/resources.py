"""What a train_draft job asks a cluster scheduler for, and what the evaluate job does: ranks
(nodes x processes per node), GPUs, tasks, CPUs, memory and a time limit sized from the tokens
to train and a rate. Torch-free except `host_mem_mb`'s memory plan: the workflow calls these
while it plans (workflow/rules/resources.smk; docs/slurm.md).

Rates and tokens are the trainer's: loss-masked target tokens (`tokens_trained` in its
summary), per rank and second, as `progress.json` records them after every checkpoint.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from eagleflow.extract.resources import (
    CPU_OVERHEAD_MB,
    RUNTIME_MARGIN,
    STARTUP_MINUTES,
    extract_gpus,
)
from eagleflow.plan.settings import DraftSettings, Ranks, TrainConfig

CPUS_PER_GPU_RANK = 8  # as an extract job per GPU (eagleflow.extract.resources.CPUS_PER_GPU)
# Start-up and end of a training job beyond its steps: imports, reading the target's
# embedding and head, the data plan, the final validation and consolidated save.
TRAIN_STARTUP_MINUTES = 5
# Host memory of one rank beyond its packs: Python, torch (and the CUDA runtime), the target
# tensors read before they move to the device, and the consolidated best draft (rank 0).
RANK_OVERHEAD_MB = 4096
PROGRESS = "progress.json"  # eagleflow.train.records.PROGRESS, in the trainer's work dir


def requested_gpus_per_node(extract: dict) -> int:
    """A node's GPUs as an extract job asks for them (`extract.gpus_per_job`, else TP x PP /
    nodes): what `draft.processes_per_node: null` asks SLURM for on CUDA."""
    return max(1, extract_gpus({**extract, "device": "cuda"}))


def processes_per_node(ranks: Ranks, extract: dict, visible_gpus: int | None = None) -> int:
    """`draft.processes_per_node`; null: 1 on CPU; on CUDA every GPU the job sees
    (`visible_gpus`, counted in a job that runs on this machine) or, for a job to be
    submitted, the GPUs it asks for (`requested_gpus_per_node`)."""
    if ranks.processes_per_node is not None:
        return int(ranks.processes_per_node)
    if ranks.device == "cpu":
        return 1
    return visible_gpus or requested_gpus_per_node(extract)


@dataclass(frozen=True)
class TrainJob:
    """The shape of a train_draft job: `nodes` x `processes_per_node` ranks on `device`."""

    nodes: int
    processes_per_node: int
    device: str  # cuda or cpu
    cpus_per_rank: int

    @classmethod
    def from_settings(cls, draft: DraftSettings, extract: dict) -> TrainJob:
        """The job `draft` asks for; `extract`: the config's section, whose GPUs per job a
        CUDA rank count left null follows."""
        ranks = draft.ranks
        cpus = ranks.cpus_per_rank
        if cpus is None:
            cpus = CPUS_PER_GPU_RANK if ranks.device == "cuda" else draft.train.num_workers + 1
        per_node = processes_per_node(ranks, extract)
        return cls(ranks.nodes, per_node, ranks.device, int(cpus))

    @property
    def ranks(self) -> int:
        return self.nodes * self.processes_per_node

    def slurm(self) -> dict:
        """The resources snakemake-executor-plugin-slurm (2.8) turns into sbatch options.

        More than one rank: `mpi="srun"` (the job's script starts the ranks with srun, and
        the jobstep plugin adds no srun of its own) and `--ntasks-per-node` = processes per
        node (`tasks_per_node`), or, at one process per node, `--ntasks` = nodes (`tasks`).
        GPUs: `gpu` (`--gpus`) on one node, `gres` (`--gres=gpu:P`, per node) on several,
        none on CPU. `tasks_per_gpu` is 0 (no `--ntasks-per-gpu`, which the plugin would
        otherwise derive from `tasks`, and which SLURM does not combine with
        `--ntasks-per-node`) except at one rank per node, where it is that one."""
        multi = self.ranks > 1
        per_node, gpus = self.processes_per_node, self.device == "cuda"
        one_per_node = multi and per_node == 1
        return {
            "nodes": self.nodes,
            "gpu": per_node if gpus and self.nodes == 1 else 0,
            "gres": f"gpu:{per_node}" if gpus and self.nodes > 1 else "",
            "mpi": "srun" if multi else "",
            "tasks_per_node": per_node if multi and per_node > 1 else 0,
            "tasks": self.nodes if one_per_node else 0,
            "tasks_per_gpu": 1 if one_per_node and gpus else 0,
            "cpus_per_task": self.cpus_per_rank,
        }


def host_mem_mb(plan, num_workers: int, prefetch_factor: int, processes_per_node: int) -> int:
    """Host memory (MB) per node: per rank an overhead, the packs its data loader holds (each
    worker's `prefetch_factor`, plus the one in use and its pinned copy) at the plan's pack
    size, and on CPU everything the plan places on the device (`MemoryPlan`,
    eagleflow.train.memory_plan)."""
    packs = num_workers * prefetch_factor + 2
    per_rank = RANK_OVERHEAD_MB * 2**20 + packs * plan.inputs + 4 * plan.trainable_params
    if plan.workload.device_type == "cpu":
        per_rank += plan.total + CPU_OVERHEAD_MB * 2**20
    return math.ceil(processes_per_node * per_rank / 2**20)


# ---------------------------------------------------------------- tokens, rate, time


@dataclass(frozen=True)
class TrainingTokens:
    """What one epoch trains, from the token manifest (one row per sample)."""

    samples: int  # training samples (not held out, not longer than max_sample_tokens)
    tokens: int  # their tokens
    loss_tokens: int  # their loss-masked tokens: what the trainer counts as trained

    @classmethod
    def from_manifest(cls, manifest, heldout, max_sample_tokens: int = 0) -> TrainingTokens:
        """`manifest`: a frame with sample_id, n_tokens, n_loss_tokens; `heldout(sample_id)`
        true for a held-out sample (eagleflow.data.heldout.excluder)."""
        keep = ~manifest["sample_id"].map(heldout).astype(bool)
        if max_sample_tokens:
            keep &= manifest["n_tokens"] <= max_sample_tokens
        rows = manifest[keep]
        return cls(len(rows), int(rows["n_tokens"].sum()), int(rows["n_loss_tokens"].sum()))

    def to_train(self, cfg: TrainConfig) -> int:
        """Loss-masked tokens of the whole run: `epochs` x an epoch's, or the share of that
        `max_steps` covers (counting an epoch's steps as if every pack were full, so the
        share is never underestimated)."""
        total = cfg.epochs * self.loss_tokens
        if not cfg.max_steps:
            return total
        steps = cfg.epochs * math.ceil(self.tokens / cfg.max_tokens / cfg.batch_packs)
        return min(total, math.ceil(total * cfg.max_steps / max(1, steps)))


def read_progress(work_dir) -> dict | None:
    """The trainer's `progress.json` (written at every checkpoint), or None."""
    try:
        return json.loads((Path(work_dir) / PROGRESS).read_text())
    except (OSError, ValueError):
        return None


def measured_rate_per_rank(progress: dict | None) -> float | None:
    """Loss-masked tokens per second and rank that the run measured, None before any."""
    if not progress or not progress.get("tokens_per_second"):
        return None
    return float(progress["tokens_per_second"]) / max(1, int(progress.get("world_size") or 1))


def train_runtime_minutes(tokens: int, rate_per_rank: float, ranks: int, attempt: int = 1) -> int:
    """SLURM time limit of a train_draft job: 1.5 x the tokens at the rate, plus start-up and
    end, times attempt (a job killed at its limit resumes from its latest checkpoint)."""
    minutes = tokens / (rate_per_rank * ranks) / 60
    est = RUNTIME_MARGIN * minutes + TRAIN_STARTUP_MINUTES + STARTUP_MINUTES
    return math.ceil(est) * max(1, attempt)


def evaluate_runtime_minutes(
    evaluate: dict, load_minutes: float, decode_tokens_per_second: float, attempt: int = 1
) -> int:
    """SLURM time limit of the evaluate job, counting what `eagleflow.evaluate.acceptance`
    plans: one target load per vLLM path and k (vLLM fixes k when an engine is built) and one
    for the reference loop, for this run's draft and again for evaluate.draft's (the n-gram
    baseline needs no draft: measured once), and every measured path's tokens at every k
    (prompts of each set, its limit or num_prompts, x 2 turns for MT-Bench-style sets, x
    max_tokens, x each of evaluate.modes) at the decode rate, with evaluate.speed's engine and
    requests, with the extract jobs' margin and start-up, times attempt."""
    k = evaluate.get("speculative_tokens", 3)
    ks = len(k) if isinstance(k, list) else 1
    paths = list(evaluate["paths"])
    drafts = 2 if evaluate.get("draft") else 1
    ngram = "vllm_ngram" in paths
    drafted_vllm = sum(p not in ("reference", "vllm_ngram") for p in paths)
    loads = (drafted_vllm * ks + ("reference" in paths)) * drafts + ngram * ks
    measured = (len(paths) - ngram) * drafts + ngram  # paths x drafts, each at every k
    sets = evaluate.get("sets") or [{"name": "heldout"}]
    prompts = sum(
        (s.get("limit") or int(evaluate["num_prompts"]))
        * (2 if s.get("format") == "mt_bench" else 1)
        for s in sets
    )
    modes = len(evaluate.get("modes") or {}) or 1
    tokens = measured * ks * prompts * modes * int(evaluate["max_tokens"])
    if evaluate.get("speed"):  # the target alone, then every eagle3 engine, at each concurrency
        loads += 1
        timed = 1 + ("vllm_eagle3" in paths) * ks * drafts
        concurrency = sum(evaluate.get("speed_concurrencies") or [1, 8, 32])
        tokens += timed * concurrency * int(evaluate["max_tokens"])
    est = RUNTIME_MARGIN * (loads * load_minutes + tokens / decode_tokens_per_second / 60)
    return math.ceil(est + STARTUP_MINUTES) * max(1, attempt)
