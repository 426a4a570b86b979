"""The draft's training data: samples of the extracted shards, packed by length into
sequences of about `max_tokens`, read by `DataLoader` workers.

- `SampleTable`: every sample of every shard (shard, first row, length), which of them are
  held out (`eagleflow.data.heldout`: the validation set, never trained on) and which are
  too long to train (longer than `max_sample_tokens`: counted and named, never cut).
- `PackPlan`: per epoch, a seeded permutation of the training samples packed first-fit into
  packs of at most `max_tokens` tokens, across all shards. A sample longer than `max_tokens`
  is a pack of its own and is trained in full. Global batch s (optimizer step s) is packs
  [s*B, (s+1)*B) of its epoch, B = `batch_packs`; the last batch of an epoch is padded with
  empty packs (no tokens, no gradient). The plan is a pure function of (sample lengths,
  max_tokens, B, seed, epoch): a run resumes at any step, at any world size.
- `RankSampler`: rank r of W takes packs j*W + r of each global batch for its micro-steps
  j = 0 .. B/W - 1, so W ranks x B/W micro-steps train the same global batch as one rank
  accumulating B packs. `HeldoutSampler`: the held-out samples packed once (validation),
  padded so that every rank runs as many forwards.
- `PackDataset`: item = one pack, read with `safe_open(...).get_slice(...)` on the
  memory-mapped shards (only the pack's rows). States stay as stored: bf16, or fp8 codes
  plus their scales, which cross to the device as they are and are dequantized there
  (`Batch.values`). Under sequence splitting (`eagleflow.train.sequence_parallel`) the
  dataset of slice `part` of `parts` reads only its slice's states (and the `ttt_steps`
  rows after it, whose final states are its targets); the samplers then count the ranks
  of one pack as one.

Alignment (the same as speculators' `shift_batch`): the draft's anchor t reads the aux
states of position t and token t+1, and is trained at TTT step k against the target's
distribution at position t+1+k (which predicts token t+2+k) where token t+1+k is
loss-masked and in the same sample. A sample's first token is no target: the loss-masked
tokens a sample trains are those of its rows 1..n-1 (`Batch.trained_tokens`).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch.utils.data import DataLoader, Dataset, Sampler

from eagleflow.data.heldout import excluder
from eagleflow.plan.settings import TrainConfig
from eagleflow.store.quant import SCALES_KEY, dequantize
from eagleflow.target.layers import CONVENTION
from eagleflow.train.sequence_parallel import slice_length

FP8_DTYPE = "F8_E4M3"
OPEN_PACKS = 8  # first fit over this many open packs: dense packs, the shuffled order kept


@dataclass
class ShardLayout:
    paths: list[str]
    layer_ids: list[int]  # as stored, vLLM convention
    final_id: int  # L = num_hidden_layers: the final pre-norm state
    aux_ids: list[int]  # the layer ids the draft's fc fuses, in stored order

    @property
    def final_index(self) -> int:
        return self.layer_ids.index(self.final_id)

    @property
    def aux_index(self) -> list[int]:
        return [self.layer_ids.index(i) for i in self.aux_ids]


def shard_metadata(path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    return {k: json.loads(v) if k in ("layer_ids", "sample_ids") else v for k, v in meta.items()}


def read_layout(paths, num_hidden_layers: int) -> ShardLayout:
    """Layer ids from every shard's metadata; they must agree and include L (final state)."""
    paths = [str(p) for p in paths]
    if not paths:
        raise ValueError("no shards given")
    layer_ids, storage = None, None
    for path in paths:
        with safe_open(path, framework="pt") as f:
            dtype = f.get_slice("hidden_states").get_dtype()
        if storage is None:
            storage = dtype
        elif dtype != storage:  # a pack may take samples of any two shards
            raise ValueError(
                f"{path}: hidden_states stored as {dtype}, {paths[0]}'s as {storage}: one run "
                "trains on shards of one storage dtype (extract them again with one "
                "capture.storage_dtype)"
            )
        meta = shard_metadata(path)
        convention = meta.get("layer_id_convention", "").strip('"')
        if convention != CONVENTION:
            raise ValueError(f"{path}: layer_id_convention {convention!r}, expected {CONVENTION!r}")
        ids = [int(i) for i in meta["layer_ids"]]
        if layer_ids is None:
            layer_ids = ids
        elif ids != layer_ids:
            raise ValueError(f"{path}: layer ids {ids} differ from {paths[0]}'s {layer_ids}")
    return layout_of(paths, layer_ids, num_hidden_layers)


def layout_of(paths, layer_ids, num_hidden_layers: int) -> ShardLayout:
    """The layout of states of `layer_ids` (stored, or streamed by a capture plan's ids)."""
    layer_ids = [int(i) for i in layer_ids]
    if num_hidden_layers not in layer_ids:
        raise ValueError(
            f"the shards hold layer ids {layer_ids}, without the final pre-norm state "
            f"(id {num_hidden_layers} = num_hidden_layers) the draft is trained against"
        )
    aux = [i for i in layer_ids if i != num_hidden_layers]
    if not aux:
        raise ValueError(f"the shards hold no aux layer besides the final state: {layer_ids}")
    return ShardLayout([str(p) for p in paths], layer_ids, num_hidden_layers, aux)


def shard_paths(paths) -> list[str]:
    return sorted(str(Path(p)) for p in paths)


# ---------------------------------------------------------------- samples and the split


@dataclass
class SampleTable:
    """Every sample of the shards, in shard order (numpy arrays, one entry per sample)."""

    shard: np.ndarray  # int32 index into layout.paths
    start: np.ndarray  # int64 first row in its shard
    length: np.ndarray  # int64 tokens
    train: np.ndarray  # int64 indices of the samples trained on
    heldout: np.ndarray  # int64 indices of the held-out samples (validation)
    cut: list[dict]  # samples not trained: {"shard", "sample_id", "tokens"}

    @property
    def longest_train(self) -> int:
        return int(self.length[self.train].max()) if len(self.train) else 0


def sample_table(paths, exclude=None, max_sample_tokens: int = 0) -> SampleTable:
    """Read each shard's offsets and sample ids. `exclude(sample_id)` true: held out;
    longer than `max_sample_tokens` (when > 0): not trained, and named in `cut` (a held-out
    one is not validated on either)."""
    shard, start, length, ids = [], [], [], []
    for s, path in enumerate(paths):
        with safe_open(str(path), framework="pt") as f:
            offsets = f.get_tensor("offsets").long().numpy()
            sample_ids = json.loads((f.metadata() or {}).get("sample_ids", "null"))
        n = len(offsets) - 1
        if sample_ids is None or len(sample_ids) != n:
            raise ValueError(
                f"{path}: metadata `sample_ids` missing or not one per sample; "
                "the held-out split cannot be applied"
            )
        shard.append(np.full(n, s, dtype=np.int32))
        start.append(offsets[:-1])
        length.append(np.diff(offsets))
        ids.extend(sample_ids)
    shard, start, length = (np.concatenate(a) for a in (shard, start, length))
    held = np.array([bool(exclude and exclude(i)) for i in ids], dtype=bool)
    too_long = (length > max_sample_tokens) if max_sample_tokens > 0 else np.zeros_like(held)
    cut = [
        {"shard": Path(paths[shard[i]]).name, "sample_id": ids[i], "tokens": int(length[i])}
        for i in np.flatnonzero(too_long & ~held)
    ]
    return SampleTable(
        shard,
        start,
        length,
        np.flatnonzero(~held & ~too_long),
        np.flatnonzero(held & ~too_long),  # validated within the same limit
        cut,
    )


# ---------------------------------------------------------------- packing and the plan


def pack_samples(samples: np.ndarray, lengths: np.ndarray, max_tokens: int):
    """Pack `samples` (in this order) into packs of at most `max_tokens` tokens: first fit
    over the last `OPEN_PACKS` open packs; a sample longer than `max_tokens` alone.
    Returns (members, bounds): pack p holds members[bounds[p]:bounds[p+1]]."""
    packs: list[list[int]] = []
    room: list[int] = []
    open_packs: list[int] = []
    for i, n in zip(samples.tolist(), lengths[samples].tolist()):
        if n >= max_tokens:
            packs.append([i])
            room.append(0)
            continue
        for p in open_packs:
            if room[p] >= n:
                packs[p].append(i)
                room[p] -= n
                if room[p] == 0:
                    open_packs.remove(p)
                break
        else:
            packs.append([i])
            room.append(max_tokens - n)
            open_packs.append(len(packs) - 1)
            if len(open_packs) > OPEN_PACKS:
                open_packs.pop(0)
    members = np.fromiter((i for p in packs for i in p), dtype=np.int64)
    bounds = np.zeros(len(packs) + 1, dtype=np.int64)
    bounds[1:] = np.cumsum([len(p) for p in packs])
    return members, bounds


class PackPlan:
    """The packs of every epoch and the optimizer steps they make (see the module doc)."""

    def __init__(self, table: SampleTable, max_tokens: int, batch_packs: int, seed: int):
        self.table, self.max_tokens = table, max_tokens
        self.batch_packs, self.seed = batch_packs, seed
        self._epoch: tuple[int, tuple] | None = None  # the last epoch packed (one is in use)
        self._counts: dict[int, int] = {}

    def epoch(self, e: int):
        """(members, bounds) of epoch e: a permutation seeded by (seed, e), then packed."""
        if self._epoch is None or self._epoch[0] != e:
            rng = np.random.default_rng([self.seed, e])
            order = self.table.train[rng.permutation(len(self.table.train))]
            self._epoch = (e, pack_samples(order, self.table.length, self.max_tokens))
            self._counts[e] = len(self._epoch[1][1]) - 1
        return self._epoch[1]

    def num_packs(self, e: int) -> int:
        if e not in self._counts:
            self.epoch(e)
        return self._counts[e]

    def steps_in(self, e: int) -> int:
        return -(-self.num_packs(e) // self.batch_packs)

    def epoch_starts(self, epochs: int) -> list[int]:
        """First step of each epoch, and the total number of steps last."""
        starts = [0]
        for e in range(epochs):
            starts.append(starts[-1] + self.steps_in(e))
        return starts

    def pack(self, e: int, p: int) -> tuple[int, ...]:
        """The sample indices of pack p of epoch e; () past the end (a padding pack)."""
        members, bounds = self.epoch(e)
        if p >= len(bounds) - 1:
            return ()
        return tuple(members[bounds[p] : bounds[p + 1]].tolist())


class RankSampler(Sampler):
    """This rank's packs for global steps [start, end): B/W per step (module doc)."""

    def __init__(self, plan: PackPlan, starts: list[int], start, end, rank, world):
        # world divides batch_packs: `eagleflow.plan.settings.check_world`
        self.plan, self.starts, self.start, self.end = plan, starts, start, end
        self.rank, self.world = rank, world
        self.micro_steps = plan.batch_packs // world

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, batch index within the epoch) of a global step."""
        e = int(np.searchsorted(self.starts, step, side="right")) - 1
        return e, step - self.starts[e]

    def __iter__(self):
        for step in range(self.start, self.end):
            e, b = self.locate(step)
            for j in range(self.micro_steps):
                yield self.plan.pack(e, b * self.plan.batch_packs + j * self.world + self.rank)

    def __len__(self):
        return (self.end - self.start) * self.micro_steps


class HeldoutSampler(Sampler):
    """The held-out samples packed once (in table order), padded to a multiple of the world
    size so every rank runs as many forwards; rank r takes packs r, r+W, ..."""

    def __init__(self, table: SampleTable, max_tokens: int, rank: int, world: int):
        members, bounds = pack_samples(table.heldout, table.length, max_tokens)
        packs = [tuple(members[a:b].tolist()) for a, b in zip(bounds[:-1], bounds[1:])]
        packs += [()] * (-len(packs) % world)
        self.packs = packs[rank::world]

    def __iter__(self):
        return iter(self.packs)

    def __len__(self):
        return len(self.packs)


# ---------------------------------------------------------------- batches


@dataclass
class Batch:
    """One pack, or one slice of n of its N anchors (n = N without sequence splitting).

    The rows of `states` are the slice's anchors, then up to `ttt_steps` rows after them
    (only their final states are read: the last anchors' targets)."""

    states: torch.Tensor  # [rows, n_aux + 1, H] as stored: aux states, then the final state
    scales: torch.Tensor  # [rows, n_aux + 1] float32 fp8 scales; [0] when not quantized
    tokens: torch.Tensor  # [steps, n] token read at step k (t+1+k), 0 where none
    target_index: torch.Tensor  # [steps, n] row of the final state the step-k target is from
    valid: torch.Tensor  # [steps, n] bool: step k at anchor t is trained on
    positions: torch.Tensor  # [n] position of token t+1 within its sample
    doc: torch.Tensor  # [N] sample index of every anchor of the pack
    step_tokens: torch.Tensor  # [steps] anchors trained on at step k in the whole pack
    samples: int = 0  # samples in the pack, counted by its first slice (0: padding, or not)
    key: int = 0  # the pack's identity (its samples' hash; 0: padding): its noise's seed

    def _map(self, fn) -> Batch:
        plain = ("samples", "key")
        tensors = {f.name: fn(getattr(self, f.name)) for f in fields(self) if f.name not in plain}
        return Batch(**tensors, samples=self.samples, key=self.key)

    def to(self, device, non_blocking: bool = False) -> Batch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:  # DataLoader(pin_memory=True) calls this
        return self._map(lambda t: t.pin_memory())

    def values(self, dtype=torch.float32):
        """(aux [n, n_aux*H], final [rows, H]) in `dtype`, dequantized where the batch is
        (on the device after `to`)."""
        if self.scales.numel():
            x = dequantize(self.states, self.scales, dtype)
        else:
            x = self.states.to(dtype)
        return x[: self.tokens.shape[1], :-1].flatten(1), x[:, -1]

    @property
    def trained_tokens(self) -> int:
        """Loss-masked target tokens of the pack (each sample's rows 1..n-1)."""
        return int(self.valid[0].sum())


def slice_rows(n: int, steps: int, part: int, parts: int) -> tuple[int, int, int]:
    """(first anchor, end of anchors, end of stored rows read) of slice `part` of an n-token
    pack, in the pack padded to `parts` equal slices (rows past n are padding)."""
    c = slice_length(n, parts)
    a, b = part * c, (part + 1) * c
    return a, b, max(a, min(b + steps, n))


def build_batch(
    ids,
    mask,
    hidden,
    starts,
    layout: ShardLayout,
    steps: int,
    scales=None,
    part=0,
    parts=1,
    in_vocab=None,
) -> Batch:
    """ids/mask [N] of the whole pack; starts: row where each sample begins; hidden
    [rows, n_layers, H] as stored (fp8: with `scales` [rows, n_layers]): the pack's rows
    [a, e) of `slice_rows` (all N rows in one part). `in_vocab` [V] bool (the draft's t2d):
    a step whose next token (the one its target predicts, in the sample) is outside the draft
    vocabulary is not trained on."""
    order = layout.aux_index + [layout.final_index]
    n = ids.shape[0]
    a, b, e = slice_rows(n, steps, part, parts)
    total = parts * slice_length(n, parts)  # the padded pack: padding anchors are a sample
    doc = torch.zeros(total, dtype=torch.long)
    for s in [*starts[1:], n]:
        doc[s:] += 1
    begin = torch.tensor([*starts, n], dtype=torch.long)[doc]
    positions = torch.arange(total) - begin + 1
    ids = F.pad(ids, (0, total - n))
    mask = F.pad(mask, (0, total - n))
    t = torch.arange(total)
    tokens, target_index, valid = [], [], []
    for k in range(steps):
        j = t + 1 + k
        inside = j < n
        jc = j.clamp(max=total - 1)
        same = inside & (doc[jc] == doc)
        tokens.append(torch.where(same, ids[jc], torch.zeros_like(ids)))
        target_index.append(jc)
        trained = same & mask[jc]
        if in_vocab is not None:  # the token at t+2+k, where the sample has one
            label = (t + 2 + k).clamp(max=total - 1)
            has_label = (t + 2 + k < n) & (doc[label] == doc)
            trained &= ~has_label | in_vocab[ids[label]]
        valid.append(trained)
    valid = torch.stack(valid)
    rows = max(b, e) - a  # anchors, then the rows only read for targets
    states = hidden[:, order]
    if states.shape[0] < rows:  # padding anchors: zero states
        states = torch.cat([states, states.new_zeros((rows - len(states), *states.shape[1:]))])
    if scales is not None:
        scales = F.pad(scales[:, order].float(), (0, 0, 0, rows - scales.shape[0]))
    return Batch(
        states,
        scales if scales is not None else torch.zeros(0),
        torch.stack(tokens)[:, a:b],
        (torch.stack(target_index)[:, a:b] - a).clamp(0, rows - 1),
        valid[:, a:b],
        positions[a:b],
        doc,
        valid.sum(1),
        samples=len(starts) if part == 0 else 0,
    )


class StateSource:
    """Where a pack's states come from (`draft.states`): the trainer's data never asks which.

    `StoredStates` reads the extracted shards; `eagleflow.train.states.ServedStates` asks the
    capture server (and its cache) for the states of the token shards' samples. Both give
    the same rows for the same samples, so the packs, their order and their batches are the
    same in every mode."""

    paths: list[str]  # the shards the samples are in (extracted, or token shards)
    served = False  # True: the states come from an engine (no sequence splitting there)

    def layout(self, num_hidden_layers: int) -> ShardLayout:
        """The layout of the states this source gives."""
        raise NotImplementedError

    def read_pack(self, table: SampleTable, pack, ranges) -> list[tuple]:
        """[(input_ids, loss_mask, states rows [lo, hi), fp8 scales of them or None)] per
        sample of `pack` (sample indices of `table`); `ranges` [(lo, hi)] per sample."""
        raise NotImplementedError

    def padding(self, table: SampleTable, rows: int) -> tuple:
        """(ids [1], mask [1], zero states [rows], zero scales or None) of a padding pack:
        nothing is trained on it, and nothing is read or prefilled for its states."""
        raise NotImplementedError

    def prepare(self, table: SampleTable, log) -> None:
        """Before the first step: whatever the source needs started (nothing, stored)."""


class StoredStates(StateSource):
    """The extracted shards on disk, read with `safe_open(...).get_slice(...)` on the
    memory-mapped files (only the rows asked for)."""

    def __init__(self, paths):
        self.paths = [str(p) for p in paths]
        self._files: dict[int, object] = {}  # open handles of this process (each worker's own)

    def layout(self, num_hidden_layers: int) -> ShardLayout:
        return read_layout(self.paths, num_hidden_layers)

    def _file(self, s: int):
        if s not in self._files:
            self._files[s] = safe_open(self.paths[s], framework="pt")
        return self._files[s]

    def read(self, table: SampleTable, i: int, lo: int = 0, hi: int | None = None):
        """Sample i as stored: (input_ids, loss_mask, hidden_states, fp8 scales or None); the
        states (and scales) of its rows [lo, hi) only (all by default)."""
        s = int(table.shard[i])
        f = self._file(s)
        a = int(table.start[i])
        n = int(table.length[i])
        hi = n if hi is None else hi
        hs = f.get_slice("hidden_states")
        scales = None
        rows = slice(a + lo, a + max(lo, hi))
        if hs.get_dtype() == FP8_DTYPE:
            if SCALES_KEY not in f.keys():
                raise ValueError(
                    f"{self.paths[s]}: hidden_states are stored as F8_E4M3 but the "
                    f"file has no {SCALES_KEY}; its states cannot be dequantized (extract it "
                    "again)"
                )
            scales = f.get_slice(SCALES_KEY)[rows]
        ids = f.get_slice("input_ids")[a : a + n]
        return ids, f.get_slice("loss_mask")[a : a + n], hs[rows], scales

    def read_pack(self, table: SampleTable, pack, ranges) -> list[tuple]:
        return [self.read(table, i, lo, hi) for i, (lo, hi) in zip(pack, ranges)]

    def padding(self, table: SampleTable, rows: int) -> tuple:
        i = int(table.train[0] if len(table.train) else table.heldout[0])
        ids, mask, hidden, scales = self.read(table, i, 0, 1)
        zeros = hidden.new_zeros((rows, *hidden.shape[1:]))
        if scales is not None:
            scales = scales.new_zeros((rows, *scales.shape[1:]))
        return ids[:1], mask[:1], zeros, scales


class PackDataset(Dataset):
    """Item = a pack (a tuple of sample indices of `table`) -> `Batch` of slice `part` of
    `parts` (the whole pack in one part); () is a padding pack: one row, nothing trained, so
    every rank runs the same forwards. `source`: where the states come from (`StateSource`;
    the stored shards of `layout` by default)."""

    def __init__(
        self, layout, table: SampleTable, steps: int, part=0, parts=1, in_vocab=None, source=None
    ):
        self.layout, self.table, self.steps = layout, table, steps
        self.part, self.parts, self.in_vocab = part, parts, in_vocab
        self.source = source if source is not None else StoredStates(layout.paths)

    def read(self, i: int, lo: int = 0, hi: int | None = None):
        """Sample i as its source gives it (`StateSource.read_pack`), rows [lo, hi)."""
        n = int(self.table.length[i])
        return self.source.read_pack(self.table, (i,), [(lo, n if hi is None else hi)])[0]

    def __getitem__(self, pack: tuple[int, ...]) -> Batch:
        if not pack:
            return self.padding()
        lengths = [int(self.table.length[i]) for i in pack]
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
        a, _, e = slice_rows(sum(lengths), self.steps, self.part, self.parts)
        # each sample's rows within the slice's [a, e)
        ranges = [(max(a - s, 0), min(e - s, n)) for s, n in zip(starts, lengths)]
        parts = self.source.read_pack(self.table, pack, ranges)
        batch = build_batch(
            torch.cat([p[0] for p in parts]).long(),
            torch.cat([p[1] for p in parts]).bool(),
            torch.cat([p[2] for p in parts]),
            starts,
            self.layout,
            self.steps,
            torch.cat([p[3] for p in parts]) if parts[0][3] is not None else None,
            self.part,
            self.parts,
            self.in_vocab,
        )
        batch.key = pack_key(pack)
        return batch

    def padding(self) -> Batch:
        a, _, e = slice_rows(1, self.steps, self.part, self.parts)
        # Zero states, the same from every source: nothing is trained on them.
        ids, mask, hidden, scales = self.source.padding(self.table, e)
        batch = build_batch(
            ids[:1].long(),
            mask[:1].bool(),
            hidden[a:e],
            [0],
            self.layout,
            self.steps,
            scales[a:e] if scales is not None else None,
            self.part,
            self.parts,
        )
        batch.samples = 0
        return batch


def pack_key(pack) -> int:
    """A pack's identity, from its sample indices (the same on every rank and in every run)."""
    return zlib.crc32(np.asarray(pack, dtype=np.int64).tobytes()) or 1


def data_loader(dataset, sampler, num_workers: int, prefetch_factor: int, pin: bool):
    """Workers read and build the packs ahead of the step; the pinned host copy lets the
    device copy run asynchronously. num_workers 0: the packs are read in this process (the
    held-out loader: a worker forked once threads run can deadlock before it runs any
    Python, docs/draft-training.md, "Data loading")."""
    return DataLoader(
        dataset,
        sampler=sampler,
        batch_size=None,
        num_workers=num_workers,
        prefetch_factor=prefetch_factor if num_workers else None,
        pin_memory=pin,
    )


# ---------------------------------------------------------------- the run's data


@dataclass
class TrainData:
    """What the run trains and validates on, and how many steps that makes."""

    layout: object  # ShardLayout
    table: object  # SampleTable (training, held-out and cut samples)
    plan: PackPlan
    epoch_starts: list[int]  # first step of each epoch, the epochs' total last
    total: int  # steps this run trains to (epochs, or max_steps when set)
    eval_table: object  # the table whose held-out samples are validated on
    source: StateSource  # where the states come from

    @classmethod
    def read(cls, source: StateSource, num_hidden_layers: int, cfg: TrainConfig, log):
        """The samples of `source`'s shards, split, packed and counted into steps."""
        layout = source.layout(num_hidden_layers)
        table = sample_table(layout.paths, excluder(cfg.heldout_modulus), cfg.max_sample_tokens)
        for c in table.cut:
            log(
                f"sample {c['sample_id']} of {c['shard']}: {c['tokens']} tokens, more than "
                f"draft.max_sample_tokens = {cfg.max_sample_tokens}: NOT trained"
            )
        if not len(table.train):
            raise ValueError(f"no training samples in {layout.paths} outside the held-out split")
        plan = PackPlan(table, cfg.max_tokens, cfg.batch_packs, cfg.seed)
        starts = plan.epoch_starts(cfg.epochs)
        total = min(starts[-1], cfg.max_steps) if cfg.max_steps else starts[-1]
        eval_table = table
        if cfg.eval_samples and len(table.heldout) > cfg.eval_samples:
            rng = np.random.default_rng([cfg.seed, 1 << 20])
            pick = rng.choice(len(table.heldout), cfg.eval_samples, replace=False)
            eval_table = replace(table, heldout=np.sort(table.heldout[pick]))
        log(
            f"{len(table.train)} training samples ({len(table.heldout)} held out, "
            f"{len(table.cut)} not trained) in {plan.num_packs(0)} packs of up to "
            f"{cfg.max_tokens} tokens; {cfg.epochs} epochs = {starts[-1]} steps of "
            f"{cfg.batch_packs} packs; training {total}"
        )
        return cls(layout, table, plan, starts, total, eval_table, source)

    def epoch_of(self, step: int) -> int:
        return int(np.searchsorted(self.epoch_starts, step, side="right")) - 1

    def loaders(self, cfg, start: int, end: int, rank: int, world: int, pin: bool, in_vocab):
        """(training loader, its sampler, validation loader) of this rank: the ranks of one
        sequence-parallel group read the same packs, each its own slice. With `mask_oov`,
        training skips positions whose next token is outside the draft vocabulary
        (`in_vocab`: t2d); validation never does (its acceptance counts every position)."""
        parts = cfg.sequence_parallel
        part, dp_rank, dp_world = rank % parts, rank // parts, world // parts
        steps, oov = cfg.ttt_steps, in_vocab if cfg.mask_oov else None
        source = self.source
        dataset = PackDataset(self.layout, self.table, steps, part, parts, oov, source)
        held_dataset = PackDataset(self.layout, self.table, steps, part, parts, None, source)
        sampler = RankSampler(self.plan, self.epoch_starts, start, end, dp_rank, dp_world)
        held = HeldoutSampler(self.eval_table, cfg.max_tokens, dp_rank, dp_world)
        return (
            data_loader(dataset, sampler, cfg.num_workers, cfg.prefetch_factor, pin),
            sampler,
            data_loader(held_dataset, held, 0, cfg.prefetch_factor, pin),  # no fork: see there
        )
