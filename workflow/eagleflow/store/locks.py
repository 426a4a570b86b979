"""Folder locks and durable renames shared by the stages (docs/security.md).

- `work_lock`: one process at a time in a folder (the trainer's work folder); a second one
  stops with a sentence naming the folder and the holder's pid.
- `held_by_another`: whether a job holds a lock file now (the integrity check leaves the
  shards of running jobs alone: `eagleflow.store.integrity`).
- `fsync_dir`: a rename is durable once its folder is fsynced.

The kernel drops every lock when its holder dies, so a crash leaves nothing that blocks the
rerun. `work_lock` is a POSIX record lock (`lockf`), which forked children (the DataLoader's
workers) do not inherit: it ends with the process that took it. The shard locks are `flock`s
(`eagleflow.extract.shard.shard_lock`).
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path


class FolderInUse(RuntimeError):
    """Another live process holds the folder's lock."""


def fsync_dir(path) -> None:
    """Make the renames and removals in folder `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def work_lock(folder, what: str, name: str = ".lock"):
    """Hold `<folder>/<name>` while the block runs; FolderInUse, naming `what`, the folder and
    the holder's pid, when another process holds it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # EACCES or EAGAIN: held
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise FolderInUse(
                f"{what} {folder} is in use by another process (pid {holder}, lock {path}); "
                "wait for it to end, or give this run a folder of its own"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)


def held_by_another(lock_file) -> bool:
    """Whether another process holds an exclusive `flock` on `lock_file` now (False when the
    file does not exist: no job ever took it, or it finished and was cleaned)."""
    try:
        fd = os.open(lock_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops the shared lock at once
    return False
