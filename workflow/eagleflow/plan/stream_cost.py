"""What each `draft.states` mode costs, stated before anything runs (`snakemake progress`,
validate_env): bytes of hidden states on disk, target prefill-hours per epoch and for the run,
and the rate training can go at when the capture engine prefills slower than the trainer
trains. Torch-free arithmetic on figures the caller reads:

- tokens: the token manifest's, as extraction and `eagleflow.plan.resources` count them;
- bytes per token: `eagleflow.store.quant.bytes_per_token` of the capture plan's layers;
- the engine's prefill rate: what finished extract jobs measured (`eagleflow.extract.rates`),
  else `extract.tokens_per_second`: the figure extraction's estimates use;
- the trainer's rate: loss-masked tokens per second over all ranks, measured by the trainer's
  checkpoints, else `draft.tokens_per_second_per_rank` x ranks (`eagleflow.plan.resources`).

The engine prefills every token of a sample, the trainer counts the loss-masked ones, so the
engine's rate is compared in the trainer's unit (x loss-masked tokens / tokens). In the
streamed modes prefill and training overlap (the DataLoader's prefetch,
`eagleflow.train.states`), so the slower of the two sets the pace; cached reads are taken as
free. The held-out samples prefilled again at every validation are not counted.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from eagleflow.plan.settings import DraftSettings

ENGINE_ASSUMED = "extract.tokens_per_second"
TRAINER_ASSUMED = "draft.tokens_per_second_per_rank"


def engine_rate(extract: dict, measured: float | None = None) -> tuple[float, str]:
    """The engine's prefill tok/s and where it comes from: `measured` by finished extract
    jobs, else `extract.tokens_per_second`."""
    if measured:
        return float(measured), "measured by finished extract jobs"
    return float(extract["tokens_per_second"]), ENGINE_ASSUMED


@dataclass(frozen=True)
class StatesCost:
    mode: str  # draft.states (checked by `eagleflow.plan.settings.StatesSource`)
    epochs: int  # draft.epochs
    tokens_per_epoch: int  # tokens of an epoch's training samples: what stream prefills
    loss_tokens_per_epoch: int  # their loss-masked tokens: what the trainer counts
    extracted_tokens: int  # what stored extracts once: every sample, held-out ones too
    bytes_per_token: int
    cache_bytes: int  # draft.cache_bytes (cached)
    engine_tokens_per_second: float  # prefilled tokens
    trainer_tokens_per_second: float  # loss-masked, all ranks together
    engine_source: str = ENGINE_ASSUMED
    trainer_source: str = TRAINER_ASSUMED

    @classmethod
    def from_settings(cls, draft: DraftSettings, **figures) -> StatesCost:
        """The mode, epochs and cache budget of the draft's settings; the token counts, bytes
        per token and rates (the fields above) as keywords."""
        return cls(
            mode=draft.states.mode,
            epochs=draft.train.epochs,
            cache_bytes=draft.states.cache_bytes,
            **figures,
        )

    # ------------------------------------------------------------ bytes

    @property
    def epoch_bytes(self) -> int:
        """An epoch's states: what cached would keep with no budget."""
        return self.tokens_per_epoch * self.bytes_per_token

    @property
    def bytes_on_disk(self) -> int:
        if self.mode == "stored":
            return self.extracted_tokens * self.bytes_per_token
        if self.mode == "stream":
            return 0
        return min(self.cache_bytes, self.epoch_bytes)

    @property
    def cached_fraction(self) -> float:
        """The share of an epoch's tokens that later epochs read from the cache (cached)."""
        if self.mode != "cached" or not self.epoch_bytes:
            return 0.0
        return self.bytes_on_disk / self.epoch_bytes

    # ------------------------------------------------------------ prefill

    @property
    def prefill_tokens_before_training(self) -> int:
        return self.extracted_tokens if self.mode == "stored" else 0

    def prefill_tokens(self, epoch: int) -> int:
        """Tokens the target prefills while training epoch `epoch` (1-based)."""
        if self.mode == "stored":
            return 0
        if self.mode == "stream" or epoch == 1:
            return self.tokens_per_epoch
        return round(self.tokens_per_epoch * (1 - self.cached_fraction))

    @property
    def prefill_tokens_total(self) -> int:
        during = sum(self.prefill_tokens(e) for e in range(1, self.epochs + 1))
        return self.prefill_tokens_before_training + during

    def _hours(self, tokens: int) -> float:
        return tokens / self.engine_tokens_per_second / 3600

    def prefill_hours(self, epoch: int) -> float:
        return self._hours(self.prefill_tokens(epoch))

    @property
    def prefill_hours_total(self) -> float:
        return self._hours(self.prefill_tokens_total)

    # ------------------------------------------------------------ rate

    @property
    def engine_loss_tokens_per_second(self) -> float:
        """The engine's rate in the trainer's unit (loss-masked tokens of the prefilled ones)."""
        if not self.tokens_per_epoch:
            return self.engine_tokens_per_second
        return self.engine_tokens_per_second * self.loss_tokens_per_epoch / self.tokens_per_epoch

    def engine_limit(self, epoch: int) -> float:
        """Loss-masked tok/s the engine can feed the trainer in epoch `epoch`: unlimited when it
        prefills nothing, else its rate over the share of the epoch it prefills."""
        share = self.prefill_tokens(epoch) / self.tokens_per_epoch if self.tokens_per_epoch else 0
        return self.engine_loss_tokens_per_second / share if share else math.inf

    def training_rate(self, epoch: int = 1) -> float:
        """Loss-masked tok/s over all ranks in epoch `epoch`: the slower of trainer and engine."""
        return min(self.trainer_tokens_per_second, self.engine_limit(epoch))

    @property
    def training_hours(self) -> float:
        return sum(
            self.loss_tokens_per_epoch / self.training_rate(e) / 3600
            for e in range(1, self.epochs + 1)
        )

    # ------------------------------------------------------------ report

    def as_dict(self) -> dict:
        later = 2 if self.epochs > 1 else 1
        return {
            **asdict(self),
            "bytes_on_disk": self.bytes_on_disk,
            "prefill_hours_before_training": round(self._hours(self.extracted_tokens), 4)
            if self.mode == "stored"
            else 0.0,
            "prefill_hours_first_epoch": round(self.prefill_hours(1), 4),
            "prefill_hours_later_epoch": round(self.prefill_hours(later), 4),
            "prefill_hours_total": round(self.prefill_hours_total, 4),
            "training_tokens_per_second_first_epoch": round(self.training_rate(1), 1),
            "training_tokens_per_second_later_epoch": round(self.training_rate(later), 1),
            "engine_limits_training": self.engine_limit(1) < self.trainer_tokens_per_second,
            "training_hours": round(self.training_hours, 4),
            "lines": self.lines(),
        }

    def lines(self) -> list[str]:
        """Two to four sentences: the mode's bytes and prefill-hours, then the training rate."""
        epochs = f"{self.epochs} epoch{'s' if self.epochs != 1 else ''} (draft.epochs)"
        at = f"at {_rate(self.engine_tokens_per_second)} tok/s ({self.engine_source})"
        stored = replace(self, mode="stored")
        if self.mode == "stored":
            stream = replace(self, mode="stream")
            return [
                f"draft.states stored: {_gib(self.bytes_on_disk)} of states on disk "
                f"({_count(self.extracted_tokens)} tokens x {self.bytes_per_token:,} bytes); the "
                f"target prefills them once, before training: "
                f"{_h(self.prefill_hours_total)} prefill-hours {at}, none during {epochs} "
                f"(draft.states stream: 0 bytes, {_h(stream.prefill_hours(1))} prefill-hours per "
                f"epoch, {_h(stream.prefill_hours_total)} in all).",
                f"training reads the states from disk at the trainer's rate, about "
                f"{_rate(self.training_rate())} loss-masked tok/s ({self.trainer_source}): "
                f"{_h(self.training_hours)} training hours.",
            ]
        versus = (
            f"(draft.states stored: {_h(stored.prefill_hours_total)} prefill-hours once, "
            f"{_gib(stored.bytes_on_disk)} on disk)"
        )
        if self.mode == "stream":
            first = (
                f"draft.states stream: 0 bytes of states on disk; the target prefills "
                f"{_count(self.tokens_per_epoch)} tokens every epoch: "
                f"{_h(self.prefill_hours(1))} prefill-hours per epoch {at}, "
                f"{_h(self.prefill_hours_total)} over {epochs} {versus}."
            )
        else:
            first = (
                f"draft.states cached: {_gib(self.bytes_on_disk)} of states on disk (draft."
                f"cache_bytes {_gib(self.cache_bytes)}; an epoch's states are "
                f"{_gib(self.epoch_bytes)}, {self.cached_fraction:.0%} fit); the target "
                f"prefills {_count(self.tokens_per_epoch)} tokens in epoch 1 and "
                f"{_count(self.prefill_tokens(2))} in each later one: "
                f"{_h(self.prefill_hours(1))} prefill-hours in epoch 1, "
                f"{_h(self.prefill_hours(2))} in each later {at}, "
                f"{_h(self.prefill_hours_total)} over {epochs} {versus}."
            )
        return [first, self._rate_line(), *self._later_line()]

    def _rate_line(self) -> str:
        engine = (
            f"the engine ({_rate(self.engine_tokens_per_second)} tok/s prefilled, "
            f"{_rate(self.engine_loss_tokens_per_second)} loss-masked)"
        )
        trainer = (
            f"the trainer ({_rate(self.trainer_tokens_per_second)} loss-masked tok/s, "
            f"{self.trainer_source})"
        )
        rate = f"about {_rate(self.training_rate(1))} loss-masked tok/s"
        when = f"every epoch, {_h(self.training_hours)} training hours"
        if self.mode == "cached":
            when = "in epoch 1"
        if self.engine_limit(1) < self.trainer_tokens_per_second:
            return f"{engine} is slower than {trainer}: training runs at {rate} {when}."
        return f"{trainer} is slower than {engine}: training runs at {rate} {when}."

    def _later_line(self) -> list[str]:
        if self.mode != "cached" or self.epochs < 2:
            return []
        uncached = 1 - self.cached_fraction
        who = (
            f"the engine, prefilling the uncached {uncached:.0%}"
            if self.engine_limit(2) < self.trainer_tokens_per_second
            else "the trainer"
        )
        return [
            f"later epochs: about {_rate(self.training_rate(2))} loss-masked tok/s, "
            f"limited by {who}; {_h(self.training_hours)} training hours over {self.epochs} "
            f"epochs."
        ]


def _h(hours: float) -> str:
    """Hours: two decimals, or two significant digits below 0.01 (a small run's)."""
    if hours >= 100:
        return f"{hours:,.0f}"
    return f"{hours:.2f}" if hours >= 0.01 or hours == 0 else f"{hours:.2g}"


def _rate(x: float) -> str:
    return "unlimited" if math.isinf(x) else f"{x:,.0f}"


def _count(n: int) -> str:
    if n >= 10**9:
        return f"{n / 1e9:.2f} G"
    if n >= 10**6:
        return f"{n / 1e6:.2f} M"
    return f"{n:,}"


def _gib(n: float) -> str:
    if n == 0:
        return "0 bytes"
    return f"{n / 2**30:.2f} GiB" if n >= 2**26 else f"{n / 2**20:.1f} MiB"


def configured_states_cost(
    draft: DraftSettings, extract: dict, total_tokens: int, per_token: int, training=None
):
    """validate_env's cost of the configured mode at the configured rates:
    `extract.tokens_per_second` (no extract job has measured one yet) and
    `draft.tokens_per_second_per_rank` x the train job's ranks; `training`: an epoch's
    `eagleflow.plan.resources.TrainingTokens` (None: every token, each loss-masked)."""
    from eagleflow.plan.resources import TrainingTokens, TrainJob

    epoch = training or TrainingTokens(0, total_tokens, total_tokens)
    ranks = TrainJob.from_settings(draft, extract).ranks
    per_rank = draft.ranks.tokens_per_second_per_rank
    rate, source = engine_rate(extract)
    return StatesCost.from_settings(
        draft,
        tokens_per_epoch=epoch.tokens,
        loss_tokens_per_epoch=epoch.loss_tokens,
        extracted_tokens=total_tokens,
        bytes_per_token=per_token,
        engine_tokens_per_second=rate,
        trainer_tokens_per_second=per_rank * ranks,
        engine_source=source,
        trainer_source=f"{TRAINER_ASSUMED} {per_rank:,.0f} x {ranks} rank(s)",
    )
