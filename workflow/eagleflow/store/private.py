"""Private places on a shared machine (docs/security.md): folders and files that only this
user can have written, checked before anything in them is believed.

- `private_dir`: a folder made with mode 0700, then `lstat`-checked: a directory (not a
  symlink), owned by this uid, mode 0700. Anything else stops the run with one sentence.
- `engine_dir`: a `.engine/` folder (lock, key, spec and address files of an engine server),
  made 0700; one that exists must be this uid's and writable by nobody else (then it is
  made 0700 too).
- `read_private`: a file of such a folder, owned by this uid, writable by nobody else and, for
  a key, readable by nobody else; opened without following a symlink.
- `write_private`: written under an unpredictable temporary name opened
  `O_CREAT | O_EXCL | O_NOFOLLOW` (a planted name or link makes it fail, never redirects
  it), fsynced, then renamed over the final name.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path


class UnsafePath(RuntimeError):
    """A folder or file another user could have written."""


def _why_not_private(st: os.stat_result, exact_mode: int | None) -> str | None:
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
    mode = stat.S_IMODE(st.st_mode)
    if exact_mode is not None and mode != exact_mode:
        return f"its mode is {mode:04o}, not {exact_mode:04o}"
    if mode & 0o022:
        return f"its mode {mode:04o} lets others write to it"
    return None


def private_dir(path) -> Path:
    """`path`, a folder of this uid's with mode 0700, made if missing; UnsafePath if it is
    anything else."""
    path = Path(path)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        why = "it is a symlink" if stat.S_ISLNK(st.st_mode) else "it is not a folder"
    else:
        why = _why_not_private(st, 0o700)
    if why:
        raise UnsafePath(
            f"eagleflow will not use {path}: {why}; remove it (another user may have made it) "
            "or point XDG_RUNTIME_DIR at a private folder"
        )
    return path


def engine_dir(path, create: bool = True) -> Path:
    """A `.engine/` folder: made 0700 (its parents as usual); one that exists must be owned by
    this uid and writable by nobody else, or UnsafePath."""
    path = Path(path)
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    st = os.lstat(path)
    why = "it is a symlink" if stat.S_ISLNK(st.st_mode) else _why_not_private(st, None)
    if why:
        raise UnsafePath(
            f"eagleflow will not use the engine files in {path}: {why}; remove the folder "
            "(or `chmod 700` it if it is yours) and rerun"
        )
    if create and stat.S_IMODE(st.st_mode) != 0o700:  # one of an earlier version: 0755
        os.chmod(path, 0o700)
    return path


def read_private(path, secret: bool = False) -> str:
    """The text of `path`, a file of a private folder (`engine_dir`): owned by this uid and
    writable by nobody else (`secret`: mode 0600 or stricter), or UnsafePath. Its folder is
    checked too. FileNotFoundError when missing."""
    path = Path(path)
    engine_dir(path.parent, create=False)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd) as f:
        st = os.fstat(fd)
        why = _why_not_private(st, None)
        if why is None and not stat.S_ISREG(st.st_mode):
            why = "it is not a plain file"
        if why is None and secret and stat.S_IMODE(st.st_mode) & 0o077:
            why = f"its mode is {stat.S_IMODE(st.st_mode):04o}, not 0600"
        if why:
            raise UnsafePath(f"eagleflow will not read {path}: {why}")
        return f.read()


def write_private(path, text: str, mode: int = 0o600) -> None:
    """Write `text` to `path` atomically: an unpredictable temporary name beside it, opened
    `O_CREAT | O_EXCL | O_NOFOLLOW`, fsynced, renamed into place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
