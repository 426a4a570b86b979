"""What finished jobs measured, for the two things that estimate from it: `snakemake progress`
(the time left, extract.progress) and the SLURM time limits (extract.resources). Both read it
through `measure`, so they agree on one rate and one model load.

A job is an extract job (its shard's record, `<shard>.json`) or a regenerate job (its source
shard's `<source>.summary.json`): the tokens it processed (prefilled, or generated), at what
rate, and what it waited for its engine. With engine reuse, only the job that started a server
loaded the model (`model_loaded`); the others waited for a connection.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

SIDECAR = re.compile(r"[0-9a-f]{20}\.json")


@dataclass(frozen=True)
class JobTiming:
    tokens: int  # processed by this job (a resumed job: only those it added)
    tokens_per_second: float | None
    engine_start_seconds: float  # waited for the engine: a load, or a connection
    loaded: bool  # the job loaded the model itself

    @classmethod
    def of_extraction(cls, record: dict) -> JobTiming:
        return cls(
            int(record.get("tokens_extracted_now") or 0),
            record.get("tokens_per_second"),
            float((record.get("seconds") or {}).get("engine_start") or 0),
            bool(record.get("model_loaded")),
        )

    @classmethod
    def of_regeneration(cls, summary: dict) -> JobTiming:
        return cls(
            int(summary.get("generated_tokens_now") or 0),
            summary.get("tokens_per_second"),
            float(summary.get("engine_start_s") or 0),
            bool(summary.get("model_loaded")),
        )


@dataclass(frozen=True)
class Measured:
    """None where no finished job has measured it yet."""

    tokens_per_second: float | None
    load_seconds: float | None  # one model load
    loads_per_job: float | None  # the share of jobs that loaded the model

    def seconds(self, tokens: int, jobs: int) -> float | None:
        """Time for `jobs` more jobs processing `tokens` in all, with loads as often as in the
        finished jobs (one per job without engine reuse, one per server with it)."""
        if not self.tokens_per_second:
            return None
        loads = jobs * (self.loads_per_job or 0) * (self.load_seconds or 0)
        return tokens / self.tokens_per_second + loads


def measure(jobs: Iterable[JobTiming]) -> Measured:
    """The rate and the load of the finished jobs that processed tokens.

    Rate: their tokens over their seconds (each job's tokens / its rate). This is the rate the
    finished work went at, which is what the tokens still to do will take; a median or plain
    mean of per-job rates would weigh a short tail shard, whose rate is mostly warm-up, like a
    full one.

    Load: the longest engine start of the jobs that loaded the model, never a connection to
    another job's server. A load's time depends on where it runs (a cold page cache reads the
    weights from the shared filesystem; a warm one does not), and the next job may land on a
    cold node; a time limit too short kills the job, one too long only costs scheduling slack.
    The progress report spreads it by `loads_per_job`, so with engine reuse it counts one load
    per server, not one per job.
    """
    done = [j for j in jobs if j.tokens and j.tokens_per_second]
    if not done:
        return Measured(None, None, None)
    seconds = sum(j.tokens / j.tokens_per_second for j in done)
    loads = [j.engine_start_seconds for j in done if j.loaded and j.engine_start_seconds > 0]
    return Measured(
        sum(j.tokens for j in done) / seconds,
        max(loads) if loads else None,
        len(loads) / len(done),
    )


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def extraction_timings(hidden_dir: str | Path) -> list[JobTiming]:
    """The finished shards' records of one extraction (`<hidden dir>/<shard>.json`)."""
    d = Path(hidden_dir)
    paths = [p for p in d.iterdir() if SIDECAR.fullmatch(p.name)] if d.is_dir() else []
    return [JobTiming.of_extraction(r) for r in map(_read_json, sorted(paths)) if r]


def regeneration_timings(regenerated_dir: str | Path) -> list[JobTiming]:
    """The finished source shards' summaries (`<regenerated dir>/<source>.summary.json`)."""
    paths = sorted(Path(regenerated_dir).glob("*.summary.json"))
    return [JobTiming.of_regeneration(r) for r in map(_read_json, paths) if r]
