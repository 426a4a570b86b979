"""One chunk's rows, placed: each of its requests' captured rows in the chunk's request order
and by position, checked against the sample's tokens, ready to write into the shard file.

The common case copies nothing: a chunk whose requests were each prefilled whole in one forward,
in the chunk's order (chunked prefill off, or prompts within the forward's budget), has its rows
back to back in that forward's host tensor already, so the chunk is a view of it, and a view of
page-aligned memory goes to disk without another copy (`eagleflow.store.quant.states_to_host`).
Any other case (a prompt split over forwards, requests out of order or across forwards, a decode
step scheduled past a prompt) is copied into new tensors, as the placement demands.
"""

from __future__ import annotations

import torch


def place_rows(
    requests: list[str], lengths: list[int], pieces: list[list[tuple]], token_bytes: bytes
) -> tuple[list[torch.Tensor], bool]:
    """`pieces[i]`: what the forwards captured for `requests[i]`, in forward order, each a tuple
    (positions, input_ids, *state columns) with the columns' rows first. Returns the chunk's
    state columns ([sum(lengths), ...] each) and whether they are views of the captured
    tensors (nothing copied). Raises when positions do not cover a prompt exactly once or the
    engine's input ids differ from the sample's tokens (`token_bytes`, int64)."""
    placed = [
        _in_order(rid, length, parts) for rid, length, parts in zip(requests, lengths, pieces)
    ]
    input_ids = torch.cat([ids for ids, _ in placed])
    expected = torch.frombuffer(bytearray(token_bytes), dtype=torch.int64)
    if not torch.equal(input_ids, expected):
        if len(input_ids) == len(expected):
            bad = int((input_ids != expected).nonzero()[0])
        else:
            bad = min(len(input_ids), len(expected))
        starts = torch.cumsum(torch.tensor([0, *lengths]), 0)
        rid = requests[int(torch.searchsorted(starts, bad, right=True)) - 1]
        raise RuntimeError(f"request {rid}: the engine's input ids differ from the sample's tokens")
    by_column = list(zip(*(states for _, states in placed)))
    views = [_adjacent_view(col) for col in by_column]
    if all(v is not None for v in views):
        return views, True
    return [torch.cat(col) for col in by_column], False


def _in_order(rid: str, length: int, parts: list[tuple]) -> tuple:
    """(input_ids, state columns) of one request, ordered by position 0..length-1."""
    pos, ids, *states = [torch.cat(x) for x in zip(*parts)] if len(parts) > 1 else parts[0]
    want = torch.arange(length, dtype=pos.dtype)
    if torch.equal(pos, want):
        return ids, states
    keep = pos < length  # drop any decode step scheduled past the prompt
    order = torch.argsort(pos[keep])
    pos, ids = pos[keep][order], ids[keep][order]
    if not torch.equal(pos, want):
        raise RuntimeError(
            f"request {rid}: captured positions do not cover 0..{length - 1} exactly once "
            f"(got {len(pos)} rows; prefix caching must be off)"
        )
    return ids, [s[keep][order] for s in states]


def _adjacent_view(tensors: tuple) -> torch.Tensor | None:
    """One view spanning `tensors` where they lie back to back in one storage, in order
    (contiguous rows of the same shape); None otherwise."""
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for t in tensors:
        if (
            not t.is_contiguous()
            or t.shape[1:] != first.shape[1:]
            or t.dtype != first.dtype
            or t.untyped_storage().data_ptr() != storage
            or t.storage_offset() != offset
        ):
            return None
        offset += t.numel()
    n = sum(len(t) for t in tensors)
    return first.as_strided((n, *first.shape[1:]), first.stride(), first.storage_offset())
