"""Where the trainer's states come from (`draft.states`, docs/streaming.md).

- `stored`: the extracted shards on disk (`eagleflow.train.data.StoredStates`).
- `stream`: nothing on disk. Each pack's samples are prefilled by the capture engine server
  (the extract jobs' server kind, plan and fingerprint: `eagleflow.extract.stream`) when a
  DataLoader worker asks for the pack; every epoch prefills again. The packs, their order and
  the token ids are those of `stored`: only the states' source differs.
- `cached`: as `stream`, and the server also keeps what it prefills in the state cache
  (`eagleflow.store.state_cache`) up to `draft.cache_bytes`; a later read of a cached sample
  comes from there, and a run whose every sample is cached never starts the engine.

Back-pressure is the DataLoader's own: each rank has at most `num_workers x prefetch_factor`
packs requested or waiting, so the states in flight are bounded by the packs, whatever the
engine's speed. Every streamed or cached sample is checked as a shard is (`check_sample`:
shape, dtype, finite and non-zero rows, fp8 scales, its token ids equal to the token shard's),
and a failure names the token shard and the sample.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from eagleflow.capture.plan import CapturePlan
from eagleflow.data.shards import TokenShard, read_token_shard
from eagleflow.extract.stream import from_wire
from eagleflow.plan.settings import STATES, StatesSource
from eagleflow.serve.client import EngineClient, ServerSpec
from eagleflow.store.quant import is_fp8, row_peaks
from eagleflow.store.state_cache import StateCache, sample_index
from eagleflow.train.data import ShardLayout, StateSource, StoredStates, layout_of, shard_paths

CAPTURE_SERVER = "eagleflow.extract.capture_server"


def state_source(shards, stream: StreamSource | None) -> StateSource:
    """Where the states of `shards` come from: the extracted shards themselves
    (`StoredStates`), or, with a `stream` source, the capture server's states of these token
    shards (`ServedStates`). The one place the trainer's shards become a source."""
    paths = shard_paths(shards)
    return StoredStates(paths) if stream is None else ServedStates(stream, paths)


class StreamedStatesInvalid(ValueError):
    """A streamed or cached sample that is not what the shard would hold."""


@dataclass(frozen=True)
class StreamSource:
    """How a `stream` or `cached` run gets its states; written by the train_draft job into the
    trainer's work directory (`save`), read by every rank (`load`)."""

    mode: str  # stream | cached
    server: ServerSpec  # the capture server (its plan: the stored shards' layer ids)
    scratch_dir: str  # a memory filesystem on the server's host for one pack's states
    cache_dir: str | None = None  # cached: the state cache of this fingerprint
    cache_bytes: int = 0
    server_module: str = CAPTURE_SERVER

    def __post_init__(self):
        if self.mode not in STATES[1:]:
            raise ValueError(f"draft.states = {self.mode!r}: a source of one of {STATES[1:]}")

    @classmethod
    def for_job(cls, config: dict, states: StatesSource, plan_path, log_path) -> StreamSource:
        """The source of a train_draft job: the shared capture server the extract jobs of the
        workflow `config` would use (`plan_path`: <hidden>/capture_plan.json; the server's
        log next to `log_path`), reached as `states` (the draft's settings) says, its memory
        directory and, cached, <hidden>/cache/."""
        from eagleflow.capture.plan import Strategy, plan_for_pipeline
        from eagleflow.engine.settings import EngineSettings
        from eagleflow.serve.client import engine_server
        from eagleflow.target.info import read_target

        settings = EngineSettings.from_config(config, "extract")
        plan = CapturePlan.load(plan_path)
        if plan.strategy is Strategy.EXTRACT_HIDDEN_STATES:
            raise ValueError(
                f"draft.states = {states.mode}: the capture plan {plan_path} uses vLLM's "
                "extract_hidden_states connector, which writes every state to files; set "
                "capture.strategy to auto or patched_forward to stream"
            )
        plan = plan_for_pipeline(
            plan, read_target(settings.target), settings.pipeline_parallel_size
        )
        hidden = Path(plan_path).parent
        server = engine_server(config, settings, plan, hidden / "stream", log_path)
        if server is None:
            raise ValueError(
                f"draft.states = {states.mode} streams from the shared engine server: set "
                "extract.engine_reuse to true"
            )
        server = replace(server, tcp=states.tcp, tls=states.tls, devices=states.engine_devices)
        cached = states.mode == "cached"
        return cls(
            states.mode,
            server,
            states.scratch_dir,
            str(hidden / "cache") if cached else None,
            states.cache_bytes if cached else 0,
        )

    @property
    def plan(self) -> CapturePlan:
        return self.server.plan

    @property
    def storage_dtype(self) -> torch.dtype:
        if is_fp8(self.plan.storage_dtype):
            return torch.float8_e4m3fn
        return getattr(torch, self.server.settings.dtype)

    @property
    def cache(self) -> StateCache | None:
        return StateCache(self.cache_dir, self.cache_bytes) if self.mode == "cached" else None

    def to_json(self) -> dict:
        return {
            "mode": self.mode,
            "server": self.server.to_json(),
            "scratch_dir": self.scratch_dir,
            "cache_dir": self.cache_dir,
            "cache_bytes": self.cache_bytes,
            "server_module": self.server_module,
        }

    @classmethod
    def from_json(cls, d: dict) -> StreamSource:
        return cls(**(d | {"server": ServerSpec.from_json(d["server"])}))

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path) -> StreamSource:
        return cls.from_json(json.loads(Path(path).read_text()))


def check_sample(states, scales, ids, want_ids, dtype, n_layers: int, hidden: int, where: str):
    """Raise StreamedStatesInvalid, naming `where`, unless the sample's states are what a
    verified shard would hold for tokens `want_ids`."""
    n = len(want_ids)
    problems = []
    if tuple(states.shape) != (n, n_layers, hidden):
        problems.append(f"states of shape {list(states.shape)}, expected {[n, n_layers, hidden]}")
    if states.dtype != dtype:
        problems.append(f"states of dtype {states.dtype}, expected {dtype}")
    if ids is not None and not torch.equal(torch.as_tensor(ids).long(), want_ids.long()):
        problems.append("token ids differ from the token shard's")
    if dtype == torch.float8_e4m3fn and (scales is None or tuple(scales.shape) != (n, n_layers)):
        problems.append("fp8 states without their scales [tokens, layers]")
    if not problems:
        if scales is not None and not (torch.isfinite(scales).all() and (scales > 0).all()):
            problems.append("fp8 scales not finite and positive")
        else:
            peaks = row_peaks(states, scales)
            if not torch.isfinite(peaks).all():
                problems.append("states not finite")
            elif (peaks == 0).any():
                rows = torch.nonzero((peaks == 0).any(-1)).flatten()[:5].tolist()
                problems.append(f"all-zero rows {rows} (states never written)")
    if problems:
        raise StreamedStatesInvalid(f"{where}: {'; '.join(problems)}")


class ServedStates(StateSource):
    """The states of the token shards' samples, from the cache or the capture server (the
    `StateSource` of `stream` and `cached`)."""

    served = True

    def __init__(self, source: StreamSource, paths):
        self.source, self.paths = source, [str(p) for p in paths]
        self._shards: dict[int, TokenShard] = {}  # this process's (each worker's own)

    def layout(self, num_hidden_layers: int) -> ShardLayout:
        """The capture plan's layer ids (what the server streams, as a stored shard holds)."""
        return layout_of(self.paths, self.source.plan.layer_ids, num_hidden_layers)

    def prepare(self, table, log) -> None:
        """Connect to the capture server before the first step (its model loads here, not in
        the first step's data wait), unless every sample the run reads is cached."""
        if self.all_cached(table):
            log(f"draft.states {self.source.mode}: every sample is cached, no engine needed")
        else:
            engine = self.start_server(log)
            log(f"draft.states {self.source.mode}: states from the capture server: {engine}")

    def shard(self, s: int) -> TokenShard:
        if s not in self._shards:
            self._shards[s] = read_token_shard(self.paths[s])
        return self._shards[s]

    def where(self, s: int, j: int) -> str:
        shard = self.shard(s)
        return f"sample {shard.sample_ids[j]!r} (#{j}) of token shard {self.paths[s]}"

    def tokens(self, s: int, j: int):
        ids, mask = self.shard(s).sample(j)
        return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask.astype(np.uint8))

    def read_pack(self, table, pack, ranges) -> list[tuple]:
        """[(input_ids, loss_mask, states rows [lo, hi), scales rows or None)] per sample of
        `pack` (sample indices of `table`), `ranges` [(lo, hi)] per sample."""
        where = [(int(table.shard[i]), int(table.start[i])) for i in pack]
        refs = [(s, sample_index(self.shard(s), start)) for s, start in where]
        cache = self.source.cache
        got: dict[int, tuple] = {}
        if cache is not None:
            for k, (s, j) in enumerate(refs):
                if j in cache.cached(self.shard(s).shard_id):
                    got[k] = cache.read(self.shard(s), j)
        todo = [k for k in range(len(refs)) if k not in got]
        if todo:
            got |= self.request([refs[k] for k in todo], todo)
        plan = self.source.plan
        out = []
        for k, ((s, j), (lo, hi)) in enumerate(zip(refs, ranges)):
            ids, mask = self.tokens(s, j)
            states, scales, served_ids = got[k]
            check_sample(
                states,
                scales,
                served_ids,
                ids,
                self.source.storage_dtype,
                len(plan.layer_ids),
                plan.hidden_size,
                self.where(s, j),
            )
            hi = max(lo, hi)
            out.append((ids, mask, states[lo:hi], scales[lo:hi] if scales is not None else None))
        return out

    def request(self, refs, keys) -> dict[int, tuple]:
        """Ask the server for samples `refs` [(shard index, sample index)]; returns
        {key: (states, scales, input ids it captured)}."""
        source = self.source
        # Absolute paths: the server may run elsewhere (another directory, another node).
        request = {
            "samples": [[str(Path(self.paths[s]).resolve()), j] for s, j in refs],
            "scratch": source.scratch_dir,
            "cache": (
                {"dir": str(Path(source.cache_dir).resolve()), "budget_bytes": source.cache_bytes}
                if source.mode == "cached"
                else None
            ),
        }
        with EngineClient(source.server, source.server_module, log=lambda m: None) as client:
            answer = client.states(request)
        states, scales = from_wire(answer["states"]), from_wire(answer["scales"])
        ids = from_wire(answer["input_ids"])
        offsets = answer["offsets"]
        if len(offsets) != len(refs) + 1:
            got = max(len(offsets) - 1, 0)
            missing = self.where(*refs[min(got, len(refs) - 1)])
            raise StreamedStatesInvalid(
                f"the capture server answered {got} of {len(refs)} samples asked for; "
                f"{missing} is missing"
            )
        out = {}
        for k, a, b in zip(keys, offsets, offsets[1:]):
            out[k] = (states[a:b], scales[a:b] if scales is not None else None, ids[a:b])
        return out

    def padding(self, table, steps_rows: int):
        """(ids, mask, zero states [rows], zero scales or None) of a padding pack: no prefill."""
        i = int(table.train[0] if len(table.train) else table.heldout[0])
        s = int(table.shard[i])
        ids, mask = self.tokens(s, sample_index(self.shard(s), int(table.start[i])))
        plan = self.source.plan
        dtype = self.source.storage_dtype
        shape = (steps_rows, len(plan.layer_ids), plan.hidden_size)
        states = torch.zeros(shape, dtype=dtype)
        scales = torch.zeros(shape[:2]) if dtype == torch.float8_e4m3fn else None
        return ids[:1], mask[:1], states, scales

    def all_cached(self, table) -> bool:
        """Every sample the run reads (training and held-out) is in the cache."""
        cache = self.source.cache
        if cache is None:
            return False
        used = np.concatenate([table.train, table.heldout])
        for s in np.unique(table.shard[used]).tolist():
            shard, have = self.shard(s), cache.cached(self.shard(s).shard_id)
            for i in used[table.shard[used] == s].tolist():
                if sample_index(shard, int(table.start[i])) not in have:
                    return False
        return True

    def start_server(self, log) -> dict:
        """Connect once (starting the server and loading the model if none runs), so the
        load is not counted as the first step's data wait."""
        source = self.source
        with EngineClient(source.server, source.server_module, log=log) as client:
            return client.engine
