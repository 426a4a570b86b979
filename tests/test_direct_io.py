"""Direct I/O of the states (eagleflow.store.direct_io): every byte lands where it was meant to
whichever path it takes, the states leave the page cache untouched where the filesystem allows
O_DIRECT, and a filesystem that refuses it gets everything through the page cache."""

import ctypes
import errno
import logging
import mmap
import os
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from eagleflow.extract.shard import chunk_targets, finish_shard, prepare_shard_file
from eagleflow.store import direct_io
from eagleflow.store.chunks import ShardChunks
from eagleflow.store.direct_io import ALIGN, DirectReader, DirectWriter
from eagleflow.store.verify import Expected, verify_shard
from support.synthetic import FP, PLAN, make_token_shards

SIZE = 7 * ALIGN + 123
# (offset, length): inside one page, across a boundary, whole pages, a page-aligned start,
# an unaligned start spanning pages, up to the end of the file. No two share a page that
# either writes whole.
RANGES = [
    (5, 100),
    (ALIGN - 7, 20),
    (ALIGN + 13, 2 * ALIGN + 1),
    (4 * ALIGN, ALIGN),
    (5 * ALIGN + 1, 2 * ALIGN + 122),
]


@pytest.fixture(autouse=True)
def fresh_refusals(monkeypatch):
    """Each test starts with no filesystem marked as refusing O_DIRECT."""
    monkeypatch.setattr(direct_io, "_refused", set())


def sparse_file(path: Path, size: int = SIZE) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def write_ranges(path: Path, direct: bool) -> tuple[bytearray, int]:
    want = bytearray(SIZE)
    g = torch.Generator().manual_seed(0)
    with DirectWriter(path, direct=direct) as w:
        for offset, length in RANGES:
            data = torch.randint(0, 256, (length,), dtype=torch.uint8, generator=g).numpy()
            w.write(memoryview(data), offset)
            want[offset : offset + length] = data.tobytes()
    return want, w.direct_bytes


def on_tmpfs(path: Path) -> bool:
    """Whether `path` lies on tmpfs, where every file is page cache (O_DIRECT or not)."""
    best, fstype = "", ""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        mount_point, fs = fields[4], fields[fields.index("-") + 1]
        if str(path.resolve()).startswith(mount_point) and len(mount_point) > len(best):
            best, fstype = mount_point, fs
    return fstype == "tmpfs"


def resident(path: Path, lo: int, hi: int) -> int:
    """Pages of `path`'s bytes lo..hi (page-aligned) in the page cache, by mincore(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, hi - lo, mmap.PROT_READ, mmap.MAP_SHARED, fd, lo)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        vec = ctypes.create_string_buffer((hi - lo + page - 1) // page)
        assert libc.mincore(addr, hi - lo, vec) == 0, os.strerror(ctypes.get_errno())
        libc.munmap(addr, hi - lo)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "cached"])
def test_writes_at_any_offset_land_exactly(tmp_path, direct):
    path = sparse_file(tmp_path / "f")
    want, direct_bytes = write_ranges(path, direct)
    assert path.read_bytes() == bytes(want)
    if not direct:
        assert direct_bytes == 0


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "cached"])
def test_reads_return_exactly_the_range_and_stop_at_the_end(tmp_path, direct):
    path = sparse_file(tmp_path / "f")
    want, _ = write_ranges(path, direct=False)
    with DirectReader(path, 3 * ALIGN, direct=direct) as r:
        for offset, length in [*RANGES, (0, 3 * ALIGN), (SIZE - 10, 50), (SIZE + ALIGN, 10)]:
            got = r.read(offset, length)
            assert bytes(got) == bytes(want[offset : offset + length]), (offset, length)


def test_whole_pages_go_around_the_page_cache(tmp_path):
    if on_tmpfs(tmp_path):
        pytest.skip(f"{tmp_path} is on tmpfs: its files are page cache whichever way written")
    path = sparse_file(tmp_path / "f")
    want, direct_bytes = write_ranges(path, direct=True)
    # Every whole page inside a range went direct; the partial pages at its ends did not.
    direct_pages = [
        (direct_io.round_up(o), direct_io.round_down(o + n))
        for o, n in RANGES
        if direct_io.round_down(o + n) > direct_io.round_up(o)
    ]
    assert direct_bytes == sum(b - a for a, b in direct_pages) >= 3 * ALIGN
    assert [resident(path, a, b) for a, b in direct_pages] == [0] * len(direct_pages)
    with DirectReader(path, SIZE) as r:
        assert bytes(r.read(0, SIZE)) == bytes(want)
    assert [resident(path, a, b) for a, b in direct_pages] == [0] * len(direct_pages)


def test_page_aligned_memory_goes_to_disk_without_a_copy(tmp_path):
    path = sparse_file(tmp_path / "f")
    data = direct_io.aligned_empty((3 * ALIGN,), torch.uint8)
    data.copy_(torch.randint(0, 256, (3 * ALIGN,), dtype=torch.uint8))
    with DirectWriter(path) as w:
        if w.direct_fd is None:
            pytest.skip(f"{tmp_path}: its filesystem refuses O_DIRECT")
        w.write(memoryview(data.numpy()), ALIGN)  # aligned memory, aligned offset: no copy
        assert (w.direct_bytes, w.bounced_bytes) == (3 * ALIGN, 0)
        w.write(memoryview(data.numpy())[1 : 1 + ALIGN + 2], 5 * ALIGN - 1)  # misaligned: a copy
        assert (w.direct_bytes, w.bounced_bytes) == (4 * ALIGN, ALIGN)
    got = path.read_bytes()
    assert got[ALIGN : 4 * ALIGN] == data.numpy().tobytes()
    assert got[5 * ALIGN - 1 : 6 * ALIGN + 1] == data.numpy().tobytes()[1 : 1 + ALIGN + 2]


def test_the_pool_hands_a_buffer_out_again_only_once_its_last_view_is_gone():
    pool = direct_io.AlignedPool()
    first = direct_io.aligned_empty((2 * ALIGN + 5,), torch.uint8, pool)
    first_ptr, with_writer = first.data_ptr(), [first[ALIGN:]]  # a chunk's view, queued
    del first
    second = direct_io.aligned_empty((ALIGN,), torch.uint8, pool)
    assert second.data_ptr() != first_ptr and pool.reused == 0
    writer = threading.Thread(target=with_writer.clear)  # the writer drops the last view
    writer.start()
    writer.join(timeout=60)
    assert not writer.is_alive()
    third = direct_io.aligned_empty((ALIGN,), torch.uint8, pool)  # smaller: the first fits
    assert (third.data_ptr(), pool.reused) == (first_ptr, 1)
    del second, third
    again = [direct_io.aligned_empty((ALIGN,), torch.uint8, pool) for _ in range(2)]
    assert pool.reused == 3 and len(pool._buffers) == 2
    assert all(t.data_ptr() % ALIGN == 0 for t in again)


def test_the_pool_keeps_at_most_its_bound_and_replaces_a_free_buffer_too_small():
    pool = direct_io.AlignedPool(max_buffers=2)
    held = [direct_io.aligned_empty((ALIGN,), torch.uint8, pool) for _ in range(3)]
    assert len(pool._buffers) == 2  # the third was handed out unkept
    del held[0]
    big = direct_io.aligned_empty((4 * ALIGN,), torch.uint8, pool)  # replaces the free small one
    assert pool.reused == 0 and sorted(len(b) for b in pool._buffers) == [ALIGN, 4 * ALIGN]
    ptr = big.data_ptr()
    del big
    assert direct_io.aligned_empty((3 * ALIGN,), torch.uint8, pool).data_ptr() == ptr


def test_a_filesystem_refusing_o_direct_at_open_gets_everything_cached(
    tmp_path, monkeypatch, caplog
):
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    path = sparse_file(tmp_path / "f")
    with caplog.at_level(logging.WARNING, logger=direct_io.__name__):
        want, direct_bytes = write_ranges(path, direct=True)
        with DirectReader(path, SIZE) as r:
            assert bytes(r.read(0, SIZE)) == bytes(want)
    assert direct_bytes == 0 and path.read_bytes() == bytes(want)
    # Named once, with the path and what happens instead.
    (warning,) = [r.getMessage() for r in caplog.records]
    assert str(path) in warning and "page cache" in warning


@pytest.fixture
def direct_fds(monkeypatch):
    """The descriptors opened with O_DIRECT during the test."""
    real_open, fds = os.open, set()

    def tracking_open(path, flags, *args):
        fd = real_open(path, flags, *args)
        if flags & os.O_DIRECT:
            fds.add(fd)
        return fd

    monkeypatch.setattr(os, "open", tracking_open)
    return fds


def refuse_direct(monkeypatch, name: str, direct_fds: set) -> None:
    """`os.<name>` answers EINVAL on the O_DIRECT descriptors, as some filesystems do."""
    real = getattr(os, name)

    def refusing(fd, *args):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, *args)

    monkeypatch.setattr(os, name, refusing)


def test_a_filesystem_refusing_the_first_direct_transfer_falls_back_without_loss(
    tmp_path, monkeypatch, direct_fds
):
    refuse_direct(monkeypatch, "pwrite", direct_fds)
    path = sparse_file(tmp_path / "f")
    want, direct_bytes = write_ranges(path, direct=True)
    assert direct_fds, "no O_DIRECT descriptor was asked for"
    assert direct_bytes == 0 and path.read_bytes() == bytes(want)


def test_a_shards_states_are_written_and_verified_around_the_page_cache(tokenizer, tmp_path):
    """The real path: chunks committed into a shard file, verified, and the states' pages
    never enter the page cache (the small tensors and the chunks' edge pages may)."""
    if on_tmpfs(tmp_path):
        pytest.skip(f"{tmp_path} is on tmpfs: its files are page cache whichever way written")
    shard = make_token_shards(tokenizer, n=8, size=8)[0]
    plan = replace(PLAN, hidden_size=1024)  # 8 KiB rows: each 64-token chunk is 128 pages
    out = tmp_path / f"{shard.shard_id}.safetensors"
    chunks = ShardChunks.plan(shard, FP, out, 64)
    shard_file = prepare_shard_file(chunks, plan, "bfloat16")
    g = torch.Generator().manual_seed(0)
    for i in range(len(chunks.ranges)):
        lo, hi = chunks.token_range(i)
        (target,) = chunk_targets(chunks, plan, shard_file, i).values()
        target.commit(torch.randn(hi - lo, 4, 1024, generator=g).bfloat16(), None)
    finish_shard(chunks, out)
    a, b = shard_file.spans["hidden_states"]
    lo, hi = direct_io.round_up(a), direct_io.round_down(b)
    assert hi - lo >= 100 * ALIGN
    assert resident(out, lo, hi) <= 2 * len(chunks.ranges)  # at most the chunks' edge pages
    record = {"bytes": out.stat().st_size, "fingerprint": FP, "shard_id": shard.shard_id}
    result = verify_shard(out, shard, record, Expected.of(plan, "bfloat16"))
    assert result["ok"], result["problems"]
    assert resident(out, lo, hi) <= 2 * len(chunks.ranges)


def test_a_filesystem_refusing_the_first_direct_read_falls_back(tmp_path, monkeypatch, direct_fds):
    path = sparse_file(tmp_path / "f")
    want, _ = write_ranges(path, direct=False)
    refuse_direct(monkeypatch, "preadv", direct_fds)
    with DirectReader(path, SIZE) as r:
        assert direct_fds, "no O_DIRECT descriptor was asked for"
        assert bytes(r.read(ALIGN + 13, 2 * ALIGN)) == bytes(want[ALIGN + 13 : 3 * ALIGN + 13])
        assert r.direct_fd is None
        assert bytes(r.read(0, SIZE)) == bytes(want)
