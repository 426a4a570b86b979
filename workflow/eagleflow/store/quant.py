"""Storage dtypes of hidden states (`capture.storage_dtype`), fp8 quantization, and reading
states back from a shard or chunk in either layout.

- `bfloat16` (the default): `hidden_states` [T, n_layers, H] unquantized, in the engine's
  dtype (`extract.dtype`), as eagleflow has always stored them.
- `float8_e4m3fn`: `hidden_states` [T, n_layers, H] as `F8_E4M3` plus `hidden_scales`
  [T, n_layers] as `F32`, one scale per (token, layer) since layers differ in magnitude by
  orders: scale = amax(|x|) / 448 (the largest e4m3 value), q = x / scale, and the value is
  `hidden_states * hidden_scales[..., None]`. About half the bytes of bf16 (H + 4 bytes per
  token and layer instead of 2 H).

Torch-free at import (`bytes_per_token` is used by the cheap checks that run on every
invocation); the tensor functions import torch.
"""

from __future__ import annotations

from eagleflow.store.direct_io import AlignedPool, aligned_empty
from eagleflow.store.dtypes import itemsize

DEFAULT_STORAGE = "bfloat16"
FP8 = "float8_e4m3fn"
STORAGE_DTYPES = (DEFAULT_STORAGE, FP8)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn value
SCALE_DTYPE = "float32"
# Floor of a scale: an all-zero row gets this scale (its values stay 0, which verification
# reports), and no scale is subnormal.
MIN_SCALE = 2.0**-120

SCALES_KEY = "hidden_scales"


class StorageError(ValueError):
    pass


def check_storage_dtype(name: str) -> str:
    if name not in STORAGE_DTYPES:
        raise StorageError(
            f"capture.storage_dtype: {name!r} is not a storage dtype; use one of {STORAGE_DTYPES}"
        )
    return name


def is_fp8(storage_dtype: str) -> bool:
    return check_storage_dtype(storage_dtype) == FP8


def bytes_per_token(n_layers: int, hidden_size: int, engine_dtype: str, storage_dtype: str) -> int:
    """Bytes of stored states per token: the hidden states and, in fp8, one F32 scale per layer."""
    if is_fp8(storage_dtype):
        return n_layers * (hidden_size * itemsize(FP8) + itemsize(SCALE_DTYPE))
    return n_layers * hidden_size * itemsize(engine_dtype)


def quantize(x):
    """x [..., H] (any float dtype, any device) -> (q [..., H] float8_e4m3fn, scales [...] f32),
    computed in float32 on x's device."""
    import torch

    # The amax is exact in x's own dtype (it is one of x's values), so it is taken there, and a
    # float32 copy (a copy even when x is float32: x is the caller's) is then divided and
    # clamped in place, which saves two passes on every forward.
    scales = x.abs().amax(dim=-1).float().div_(FP8_MAX).clamp_min_(MIN_SCALE)
    # Clamped: amax / (amax / 448) may round a hair above 448, and a cast that does not
    # saturate would turn it into NaN.
    q = x.to(torch.float32, copy=True).div_(scales.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scales


def states_to_host(aux, n: int, fp8: bool) -> tuple:
    """One forward's aux states (one [>= n, hidden] tensor per layer id, on the device) as host
    tensors of its first `n` tokens: ([n, n_layers, hidden],) in the engine's dtype, or in fp8
    (codes as uint8 [n, n_layers, hidden], scales float32 [n, n_layers]). One device->host
    copy per tensor; in fp8 quantized on the device first, so half the bytes cross. The states
    land in page-aligned memory, from which whole rows go to disk with no further copy
    (`eagleflow.store.direct_io`)."""
    import torch

    if fp8:
        # Layer by layer (float32 scratch of one layer at a time); fp8 codes moved as bytes
        # (uint8: every backend stacks and indexes those).
        quantized = [quantize(a[:n]) for a in aux]
        return (
            _stack_to_host([q.view(torch.uint8) for q, _ in quantized]),
            torch.stack([s for _, s in quantized], dim=1).to("cpu"),
        )
    return (_stack_to_host([a[:n] for a in aux]),)


_host_pool = AlignedPool()  # this process's page-aligned buffers for the forwards' states


def _stack_to_host(layers):
    """[n, hidden] per layer -> [n, n_layers, hidden] in page-aligned host memory of its own
    (never aliasing the runner's buffers, on the CPU either)."""
    import torch

    (n, hidden), first = layers[0].shape, layers[0]
    shape = (n, len(layers), hidden)
    if first.device.type == "cpu":
        out = aligned_empty(shape, first.dtype, _host_pool)
        return torch.stack(layers, dim=1, out=out)
    stacked = torch.stack(layers, dim=1)  # on the device, then one copy across
    if first.device.type == "cuda":
        # Pinned memory from torch's caching host allocator: reused from forward to forward (no
        # new pages each time) and copied into at the link's full speed; its blocks are
        # cudaHostAlloc's, page-aligned, so rows go to disk direct (where one is not, the
        # writer copies through its own aligned buffer: `benchmarks/gpu_check.py` reports it).
        out = torch.empty(shape, dtype=first.dtype, pin_memory=True)
    else:
        out = aligned_empty(shape, first.dtype, _host_pool)
    return out.copy_(stacked)


def row_peaks(states, scales=None):
    """The largest |value| of each row: states [..., H] -> [...] float32, NaN for a row holding
    a NaN, inf for one holding an inf, 0 for an all-zero row. One pass over the stored bytes,
    without a float32 copy of the states (verification runs it over every shard).

    fp8 states (float8_e4m3fn or their uint8 codes) need their `scales` [...]: the peak is
    then the dequantized one. e4m3fn codes are sign and magnitude, and the magnitude's 7 bits
    order like the values they encode (0x7F, the largest, is NaN), so the largest magnitude
    code of a row is its peak's code."""
    import torch

    if scales is None:
        # max(amax, -amin): two reductions that read the bytes as they are, 3x cheaper here than
        # abs() (a full-size temporary) then amax. NaN propagates through both (and maximum).
        return torch.maximum(states.amax(dim=-1), states.amin(dim=-1).neg()).float()
    codes = states.view(torch.uint8)
    peak_codes = (codes & 0x7F).amax(dim=-1)
    return peak_codes.view(torch.float8_e4m3fn).float() * scales.float()


def dequantize(q, scales, dtype=None):
    """The stored value `q * scales[..., None]` (float32 unless `dtype` is given)."""
    import torch

    out = q.float() * scales.float().unsqueeze(-1)
    return out if dtype is None or dtype == torch.float32 else out.to(dtype)


def read_states(f, path, rows: slice | None = None, dtype=None):
    """`hidden_states[rows]` of an open `safe_open` handle as values: fp8 dequantized (float32
    unless `dtype` is given), other dtypes as stored (converted when `dtype` is given).

    An fp8 file without its scales is refused with a message naming it: its values cannot be
    recovered, and reading the raw fp8 codes as states would train on garbage."""
    hs = f.get_slice("hidden_states")
    rows = rows if rows is not None else slice(None)
    if hs.get_dtype() != "F8_E4M3":
        states = hs[rows]
        return states if dtype is None else states.to(dtype)
    if SCALES_KEY not in f.keys():
        raise StorageError(
            f"{path}: hidden_states are stored as F8_E4M3 but the file has no {SCALES_KEY}; "
            "its states cannot be dequantized (a damaged or foreign file: extract it again)"
        )
    return dequantize(hs[rows], f.get_slice(SCALES_KEY)[rows], dtype)


class ShardStates:
    """The states of an open shard, read (and dequantized) only where indexed, `states[a:b]`:
    a reader that samples a few rows never holds the whole shard, in float32 or otherwise."""

    def __init__(self, f, path, dtype=None):
        self.f, self.path, self.dtype = f, path, dtype

    def __getitem__(self, rows: slice):
        return read_states(self.f, self.path, rows, self.dtype)
