"""Training batches for the draft, streamed from extracted shards (never the whole dataset).

A *pack* is a run of consecutive samples of one shard holding at most `max_tokens` tokens
(a longer sample is cut to its first `max_tokens`). Only a pack's rows are read, through
`safe_open(...).get_slice(...)` on the memory-mapped file. The order of packs is a seeded
permutation per epoch, and the p-th pack of the stream is a pure function of
(seed, p): training resumes at any step without replaying data, and rank r of W takes
stream positions step*W + r.

Alignment (the same as speculators' `shift_batch`): the draft's anchor t reads the aux
states of position t and token t+1, and is trained at TTT step k against the target's
distribution at position t+1+k (which predicts token t+2+k) where token t+1+k is
loss-masked and in the same sample.

Shards stored in fp8 (`capture.storage_dtype: float8_e4m3fn`) are dequantized as a pack is
read (`eagleflow.store.quant.read_states`); the batch is float32 either way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eagleflow.store.quant import read_states
from eagleflow.target.layers import CONVENTION


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
    layer_ids = None
    for path in paths:
        meta = shard_metadata(path)
        convention = meta.get("layer_id_convention", "").strip('"')
        if convention != CONVENTION:
            raise ValueError(f"{path}: layer_id_convention {convention!r}, expected {CONVENTION!r}")
        ids = [int(i) for i in meta["layer_ids"]]
        if layer_ids is None:
            layer_ids = ids
        elif ids != layer_ids:
            raise ValueError(f"{path}: layer ids {ids} differ from {paths[0]}'s {layer_ids}")
    if num_hidden_layers not in layer_ids:
        raise ValueError(
            f"the shards hold layer ids {layer_ids}, without the final pre-norm state "
            f"(id {num_hidden_layers} = num_hidden_layers) the draft is trained against"
        )
    aux = [i for i in layer_ids if i != num_hidden_layers]
    if not aux:
        raise ValueError(f"the shards hold no aux layer besides the final state: {layer_ids}")
    return ShardLayout(paths, layer_ids, num_hidden_layers, aux)


def make_packs(paths, max_tokens: int, exclude=None) -> list[tuple[int, int, int]]:
    """(shard index, first row, end row) of every pack, reading only each shard's offsets and
    sample ids. Samples for which `exclude(sample_id)` is true (the held-out split) are in no
    pack."""
    packs = []
    for s, path in enumerate(paths):
        with safe_open(str(path), framework="pt") as f:
            offsets = f.get_tensor("offsets").tolist()
            sample_ids = json.loads((f.metadata() or {}).get("sample_ids", "null"))
        if exclude is not None and (sample_ids is None or len(sample_ids) != len(offsets) - 1):
            raise ValueError(
                f"{path}: metadata `sample_ids` missing or not one per sample; "
                "the held-out split cannot be applied"
            )
        start = end = offsets[0]
        for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
            if exclude is not None and exclude(sample_ids[i]):
                if end > start:
                    packs.append((s, start, end))
                start = end = b
                continue
            if b - a >= max_tokens:  # a long sample alone, cut to max_tokens
                if end > start:
                    packs.append((s, start, end))
                packs.append((s, a, a + max_tokens))
                start = end = b
            elif b - start > max_tokens:
                packs.append((s, start, end))
                start, end = a, b
            else:
                end = b
        if end > start:
            packs.append((s, start, end))
    return packs


def pack_for(packs: list, seed: int, position: int):
    """The pack at `position` of the infinite seeded stream (a new permutation per epoch)."""
    epoch, i = divmod(position, len(packs))
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return packs[int(torch.randperm(len(packs), generator=g)[i])]


@dataclass
class Batch:
    aux: torch.Tensor  # [N, n_aux*H] float
    final: torch.Tensor  # [N, H] the target's final pre-norm state
    tokens: torch.Tensor  # [steps, N] token read at step k (t+1+k), 0 where none
    target_index: torch.Tensor  # [steps, N] row of `final` the step-k target comes from
    valid: torch.Tensor  # [steps, N] bool: step k at anchor t is trained on
    positions: torch.Tensor  # [N] position of token t+1 within its sample
    doc: torch.Tensor  # [N] sample index within the pack

    def to(self, device):
        return Batch(*(getattr(self, k).to(device) for k in self.__dataclass_fields__))


def build_batch(ids, mask, hidden, starts, layout: ShardLayout, steps: int) -> Batch:
    """ids/mask [N], hidden [N, n_layers, H], starts: row where each sample begins."""
    n = ids.shape[0]
    doc = torch.zeros(n, dtype=torch.long)
    for s in starts[1:]:
        doc[s:] += 1
    begin = torch.tensor(starts, dtype=torch.long)[doc]
    positions = torch.arange(n) - begin + 1
    aux = hidden[:, layout.aux_index].flatten(1).float()
    final = hidden[:, layout.final_index].float()
    t = torch.arange(n)
    tokens, target_index, valid = [], [], []
    for k in range(steps):
        j = t + 1 + k
        inside = j < n
        jc = j.clamp(max=n - 1)
        same = inside & (doc[jc] == doc)
        tokens.append(torch.where(same, ids[jc], torch.zeros_like(ids)))
        target_index.append(jc)
        valid.append(same & mask[jc])
    return Batch(
        aux,
        final,
        torch.stack(tokens),
        torch.stack(target_index),
        torch.stack(valid),
        positions,
        doc,
    )


def load_pack(layout: ShardLayout, pack, steps: int) -> Batch:
    s, a, b = pack
    with safe_open(layout.paths[s], framework="pt") as f:
        ids = f.get_slice("input_ids")[a:b].long()
        mask = f.get_slice("loss_mask")[a:b].bool()
        hidden = read_states(f, layout.paths[s], slice(a, b))
        offsets = f.get_tensor("offsets")
    starts = [int(o) - a for o in offsets.tolist() if a <= o < b]
    if not starts or starts[0] != 0:
        starts = [0] + starts
    return build_batch(ids, mask, hidden, starts, layout, steps)


def shard_paths(paths) -> list[str]:
    return sorted(str(Path(p)) for p in paths)
