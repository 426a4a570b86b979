"""Writing and reading the states without the page cache (`O_DIRECT`), with the page cache
as the fallback where a filesystem refuses it.

Why: the states are written once and not read again by the job that writes them except by its
verification read, so caching them buys nothing and costs a page per 4 KiB, twice (filled on
write, again on read). On a virtual machine that returns freed memory to its host, every new
page also faults on the host, which costs CPU on a core the engine's forward is using
(docs/measurements/extract-throughput.md).

`O_DIRECT` wants the file offset, the length and the memory address aligned to the device's
block: `ALIGN` (4 KiB, or the page size where pages are larger) covers every filesystem the
workflow meets. A range to write is split: its whole aligned pages go direct, and the partial
pages at either end go through the page cache. The direct part is written from the caller's
memory where it lies on a page boundary together with the file offset (the capture worker's
rows, in `aligned_empty` memory, into a shard file whose states start on a page), and is
otherwise copied through a reused aligned buffer first. So every byte is written by exactly one
path, and two chunks that share a page at their boundary both write it through the cache. A
filesystem that refuses `O_DIRECT` (tmpfs on older kernels, some FUSE mounts: `EINVAL`, at open
or at the first transfer) gets everything through the page cache, with one warning per process.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import sys
import threading

ALIGN = max(4096, mmap.PAGESIZE)
BOUNCE_BYTES = 64 << 20  # the aligned buffer direct writes are copied through, per thread

log = logging.getLogger(__name__)
_refused: set[int] = set()  # st_dev of filesystems that refused O_DIRECT in this process
_local = threading.local()


def round_down(n: int) -> int:
    return n - n % ALIGN


def round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def aligned_buffer(n_bytes: int) -> mmap.mmap:
    """Anonymous memory of at least `n_bytes`, starting on a page (so ALIGN-aligned)."""
    return mmap.mmap(-1, max(round_up(n_bytes), ALIGN))


def aligned_empty(shape, dtype, pool: AlignedPool | None = None):
    """An uninitialized torch tensor of `shape` and `dtype` whose memory starts on a page: a
    mapping reused from `pool` where one is free, else a new one."""
    import torch

    n_bytes = dtype.itemsize
    for d in shape:
        n_bytes *= d
    buffer = pool.take(n_bytes) if pool is not None else aligned_buffer(n_bytes)
    raw = torch.frombuffer(buffer, dtype=torch.uint8)
    return raw[:n_bytes].view(dtype).reshape(shape)


class AlignedPool:
    """Page-aligned mappings handed out again once nothing refers to them.

    Why: a new mapping faults in every page on first touch, and on a virtual machine that
    returns freed memory to its host each of those faults is paid on the host too (the fresh
    page cost in docs/measurements/extract-throughput.md). The capture worker takes one buffer
    per forward, on the forward's own thread; reused, those pages are touched once per process.

    A buffer is free when only the pool holds it: a tensor made with `torch.frombuffer` (and
    every view of it) holds a reference to its mapping until the last view is gone, whichever
    thread drops it. The pool keeps at most `max_buffers` (its high-water mark of buffers in use
    at once, each as large as the request that made it); past that it hands out mappings
    it does not keep."""

    def __init__(self, max_buffers: int = 16):
        self.max_buffers = max_buffers
        self._buffers: list[mmap.mmap] = []
        self.reused = 0  # takes served from a free buffer (tests, benchmarks)
        # The count of a buffer only the pool's list holds, as `_refs` sees it (the interpreter
        # decides how many references the call itself adds).
        self._idle_refs = _refs([aligned_buffer(ALIGN)], 0)

    def take(self, n_bytes: int) -> mmap.mmap:
        size = max(round_up(n_bytes), ALIGN)
        free = [i for i in range(len(self._buffers)) if _refs(self._buffers, i) <= self._idle_refs]
        fits = [i for i in free if len(self._buffers[i]) >= size]
        if fits:
            self.reused += 1
            return self._buffers[min(fits, key=lambda i: len(self._buffers[i]))]
        buffer = aligned_buffer(size)
        if len(self._buffers) < self.max_buffers:
            self._buffers.append(buffer)
        elif free:  # replace a free buffer too small for this size
            self._buffers[free[0]] = buffer
        return buffer


def _refs(buffers: list, i: int) -> int:
    return sys.getrefcount(buffers[i])


def address(data: memoryview) -> int:
    """Where `data`'s first byte lies in memory."""
    import numpy as np

    return np.frombuffer(data, dtype=np.uint8).ctypes.data if len(data) else 0


def _bounce() -> memoryview:
    if getattr(_local, "bounce", None) is None:
        _local.bounce = memoryview(aligned_buffer(BOUNCE_BYTES))
    return _local.bounce


def _open_direct(path, flags: int) -> int | None:
    """An O_DIRECT descriptor of `path`, or None where its filesystem refuses one."""
    if not hasattr(os, "O_DIRECT"):
        return None
    dev = os.stat(path).st_dev
    if dev in _refused:
        return None
    try:
        return os.open(path, flags | os.O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        _refuse(path, dev)
        return None


def _refuse(path, dev: int) -> None:
    if dev not in _refused:
        _refused.add(dev)
        log.warning(
            "%s: its filesystem refuses O_DIRECT; states go through the page cache there", path
        )


class _DirectFile:
    """One file open twice: through the page cache (`fd`) and, where the filesystem allows,
    with O_DIRECT (`direct_fd`, None where refused or not asked for)."""

    def __init__(self, path, flags: int, direct: bool):
        self.path = path
        self.fd = os.open(path, flags)
        self.direct_fd = _open_direct(path, flags) if direct else None

    def _give_up_direct(self) -> None:
        """The filesystem refused a direct transfer (some FUSE and network mounts open
        fine): this file, and later ones on its filesystem, through the page cache."""
        _refuse(self.path, os.fstat(self.fd).st_dev)
        os.close(self.direct_fd)
        self.direct_fd = None

    def close(self) -> None:
        os.close(self.fd)
        if self.direct_fd is not None:
            os.close(self.direct_fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DirectWriter(_DirectFile):
    """Writes byte ranges into an existing file (`write`), then `close()` flushes them to disk
    (fdatasync: the data and the size-independent metadata, such as blocks allocated in a
    sparse file). `direct_bytes` counts what went around the page cache, `bounced_bytes` the
    part of it that had to be copied to an aligned buffer first."""

    def __init__(self, path, direct: bool = True):
        super().__init__(path, os.O_WRONLY, direct)
        self.direct_bytes = 0
        self.bounced_bytes = 0

    def write(self, data: memoryview, offset: int) -> None:
        """Write `data` (bytes-like, any address) at `offset`."""
        data = memoryview(data).cast("B")
        end = offset + len(data)
        a, b = round_up(offset), round_down(end)
        if self.direct_fd is None or b <= a:
            _pwrite_all(self.fd, data, offset)
            return
        _pwrite_all(self.fd, data[: a - offset], offset)
        self._write_direct(data[a - offset : b - offset], a)
        _pwrite_all(self.fd, data[b - offset :], b)

    def write_cached(self, data: memoryview, offset: int) -> None:
        """Write `data` through the page cache: for pieces other writers share pages with."""
        _pwrite_all(self.fd, memoryview(data).cast("B"), offset)

    def _write_direct(self, data: memoryview, offset: int) -> None:
        if address(data) % ALIGN == 0:
            try:
                _pwrite_all(self.direct_fd, data, offset)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._give_up_direct()
                _pwrite_all(self.fd, data, offset)
            else:
                self.direct_bytes += len(data)
            return
        bounce = _bounce()
        done = 0
        while done < len(data):
            n = min(len(bounce), len(data) - done)
            bounce[:n] = data[done : done + n]
            try:
                _pwrite_all(self.direct_fd, bounce[:n], offset + done)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._give_up_direct()  # this range's rest and all later ones cached
                _pwrite_all(self.fd, data[done:], offset + done)
                return
            done += n
            self.direct_bytes += n
            self.bounced_bytes += n

    def close(self, sync: bool = True) -> None:
        try:
            if sync:
                os.fdatasync(self.fd)
        finally:
            super().close()

    def __exit__(self, *exc) -> None:
        self.close(sync=exc[0] is None)


class DirectReader(_DirectFile):
    """Reads byte ranges of a file of at most `max_bytes` each (`read`), direct where the
    filesystem allows: the aligned pages around the range are read into one reused buffer and
    the range is returned as a view into it, valid until the next `read`."""

    def __init__(self, path, max_bytes: int, direct: bool = True):
        super().__init__(path, os.O_RDONLY, direct)
        self.buffer = memoryview(aligned_buffer(max_bytes + 2 * ALIGN))

    def read(self, offset: int, length: int) -> memoryview:
        """`length` bytes at `offset`; fewer where the file ends first."""
        if self.direct_fd is not None:
            a, b = round_down(offset), round_up(offset + length)
            try:
                got = _pread_into(self.direct_fd, self.buffer[: b - a], a, direct=True)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._give_up_direct()
            else:
                return self.buffer[offset - a : max(offset - a, min(got, offset - a + length))]
        got = _pread_into(self.fd, self.buffer[:length], offset)
        return self.buffer[:got]


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _pread_into(fd: int, buf: memoryview, offset: int, direct: bool = False) -> int:
    """Fill `buf` from `offset`; the bytes read (fewer only at the end of the file)."""
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        got += n
        # A short direct read is the end of the file: asking again from an unaligned offset
        # would be refused rather than answered with 0.
        if n == 0 or (direct and got < len(buf)):
            break
    return got
