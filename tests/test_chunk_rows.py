"""Placing one chunk's rows (eagleflow.capture.chunk_rows) from what the forwards captured:
views of the forward's page-aligned host tensor when its requests were prefilled whole and in
order (nothing copied, straight to disk), copies in every other case, and a clear error when
positions or input ids do not match the samples."""

import pytest
import torch

from eagleflow.capture.chunk_rows import place_rows
from eagleflow.store import quant
from eagleflow.store.direct_io import ALIGN, address
from eagleflow.store.quant import FP8, dequantize, states_to_host

LAYERS, HIDDEN = 4, 1024  # a row of bf16 states is 8 KiB: rows start on pages


def forward(lengths, positions=None, seed=0, fp8=False):
    """What one forward of requests of `lengths` (prefilled whole, or at `positions`) leaves
    for the writer: per request (positions, input_ids, *state columns), and the token ids."""
    positions = positions or [torch.arange(n) for n in lengths]
    n = sum(len(p) for p in positions)
    g = torch.Generator().manual_seed(seed)
    aux = [torch.randn(n + 3, HIDDEN, generator=g).bfloat16() for _ in range(LAYERS)]
    cols = states_to_host(aux, n, fp8)
    ids = torch.randint(0, 1000, (n,), generator=g)
    pieces, a = [], 0
    for pos in positions:
        b = a + len(pos)
        pieces.append((pos, ids[a:b], *(c[a:b] for c in cols)))
        a = b
    return pieces, cols, aux


def token_bytes(pieces_in_order):
    return torch.cat([p[1] for p in pieces_in_order]).numpy().tobytes()


def test_states_land_in_page_aligned_memory_in_both_storage_dtypes():
    aux = [torch.randn(40, HIDDEN).bfloat16() for _ in range(LAYERS)]
    (states,) = states_to_host(aux, 37, fp8=False)
    assert address(memoryview(states.view(torch.uint8).numpy())) % ALIGN == 0
    assert torch.equal(states, torch.stack([a[:37] for a in aux], dim=1))
    codes, scales = states_to_host(aux, 37, fp8=True)
    assert address(memoryview(codes.numpy())) % ALIGN == 0
    assert codes.dtype == torch.uint8 and tuple(scales.shape) == (37, LAYERS)
    value = dequantize(codes.view(torch.float8_e4m3fn), scales, torch.float32)
    want = torch.stack([a[:37] for a in aux], dim=1).float()
    assert (value - want).norm() / want.norm() < 0.05, FP8


def test_a_forwards_host_memory_is_reused_once_its_rows_are_written():
    aux = [torch.randn(40, HIDDEN).bfloat16() for _ in range(LAYERS)]
    (states,) = states_to_host(aux, 37, fp8=False)
    rows, ptr = states[3:9], states.data_ptr()  # a chunk's view, still with the writer
    del states
    (busy,) = states_to_host(aux, 37, fp8=False)
    assert busy.data_ptr() != ptr
    del rows, busy
    reused = quant._host_pool.reused
    (again,) = states_to_host(aux, 30, fp8=False)
    assert quant._host_pool.reused == reused + 1
    assert torch.equal(again, torch.stack([a[:30] for a in aux], dim=1))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_requests_prefilled_whole_and_in_order_are_a_view_of_the_forward(fp8):
    lengths = [5, 9, 3]
    pieces, cols, _ = forward(lengths, fp8=fp8)
    placed, in_place = place_rows(
        ["a", "b", "c"], lengths, [[p] for p in pieces], token_bytes(pieces)
    )
    assert in_place
    for got, captured in zip(placed, cols):
        assert torch.equal(got, captured) and got.data_ptr() == captured.data_ptr()
    # Rows start on pages, so a chunk starting anywhere in the forward goes to disk directly.
    placed, in_place = place_rows(
        ["b", "c"], lengths[1:], [[p] for p in pieces[1:]], token_bytes(pieces[1:])
    )
    assert in_place and address(memoryview(placed[0].view(torch.uint8).numpy())) % ALIGN == 0
    assert torch.equal(placed[0], cols[0][5:])


def test_requests_out_of_order_are_copied_into_the_chunks_order():
    lengths = [5, 9, 3]
    pieces, cols, _ = forward(lengths)
    order = [2, 0, 1]
    chunk = [pieces[i] for i in order]
    (states,), in_place = place_rows(
        ["c", "a", "b"], [lengths[i] for i in order], [[p] for p in chunk], token_bytes(chunk)
    )
    assert not in_place
    assert torch.equal(states, torch.cat([cols[0][14:17], cols[0][0:5], cols[0][5:14]]))


def test_a_prompt_split_over_forwards_and_a_decode_step_past_it_are_placed_by_position():
    # Request "a" (6 tokens): positions 3..5 and one decode step (6) in the first forward,
    # 0..2 in the second; request "b" (2 tokens) whole in the second.
    first, cols1, _ = forward([4], positions=[torch.tensor([3, 4, 5, 6])], seed=1)
    second, cols2, _ = forward([3, 2], seed=2)
    ids_a = torch.cat([second[0][1], first[0][1][:3]])
    (states,), in_place = place_rows(
        ["a", "b"],
        [6, 2],
        [[first[0], second[0]], [second[1]]],
        torch.cat([ids_a, second[1][1]]).numpy().tobytes(),
    )
    assert not in_place
    assert torch.equal(states, torch.cat([cols2[0][0:3], cols1[0][0:3], cols2[0][3:5]]))


def test_positions_that_do_not_cover_the_prompt_name_the_request():
    pieces, _, _ = forward([4], positions=[torch.tensor([0, 1, 3, 4])])
    with pytest.raises(RuntimeError, match=r"request r7: captured positions do not cover 0\.\.4"):
        place_rows(["r7"], [5], [pieces], token_bytes(pieces))


def test_input_ids_that_differ_from_the_samples_name_the_request():
    lengths = [5, 9]
    pieces, _, _ = forward(lengths)
    tokens = token_bytes(pieces)
    wrong = bytearray(tokens)
    wrong[8 * 7] ^= 1  # the 8th token: inside request "b"
    with pytest.raises(RuntimeError, match="request b: the engine's input ids differ"):
        place_rows(["a", "b"], lengths, [[p] for p in pieces], bytes(wrong))
