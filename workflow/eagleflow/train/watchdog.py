"""A rank that stops making progress fails, instead of holding its allocation until the time
limit.

The trainer names each wait before it enters it (`Watchdog.waiting`): the training loader's
next pack, a step's forward, backward and gradient all-reduce, a validation, a checkpoint. A
daemon thread looks at the current wait every second; one that lasts longer than its limit
ends the process with exit code 1, after writing which rank waited for what and for how long,
and every thread's stack (`faulthandler`). torchrun then fails the job by rank, the rule fails,
and its rerun (Snakemake's `retries`, a SLURM requeue, a user) resumes from the last
checkpoint as after any crash. A rank stuck inside C code that holds the GIL cannot run that
thread: faulthandler's own timer (no GIL needed) then dumps the stacks and exits a little
later.

The limit is `draft.stall_timeout` seconds, or, where that is 0, the larger of
`STALL_FLOOR_S` and `STALL_STEP_FACTOR` times the slowest step so far (the waits before the
first step is measured get the floor). Start the watchdog after the training loader has
forked its workers: a thread running while a process forks is what the trainer avoids
(docs/draft-training.md, "Data loading").
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import sys
import threading
import time
from contextlib import contextmanager

# A checkpoint of the Kimi-K2.5 draft (about 1B parameters, AdamW state: 12 GB over the ranks)
# and a first step that compiles flex attention each take minutes at most.
STALL_FLOOR_S = 600.0
STALL_STEP_FACTOR = 20.0
# faulthandler's timer fires this long after the named limit (only if the thread could not).
BACKSTOP_S = 60.0


class Watchdog:
    """One per rank. `waiting(what)` around every wait; `step_took(seconds)` after each step
    (sizes the automatic limit); `close()` at the end."""

    def __init__(self, rank: int, timeout_s: float = 0.0, out=None):
        self.rank, self.timeout_s = rank, float(timeout_s)
        self.out = out if out is not None else sys.stderr
        self.stacks_out = with_fileno(self.out)  # faulthandler writes to a file descriptor
        self.slowest_step_s = 0.0
        self._current: tuple[str, float] | None = None  # (what, since): one attribute, atomic
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
        self._thread.start()

    @property
    def limit_s(self) -> float:
        if self.timeout_s > 0:
            return self.timeout_s
        return max(STALL_FLOOR_S, STALL_STEP_FACTOR * self.slowest_step_s)

    def step_took(self, seconds: float) -> None:
        self.slowest_step_s = max(self.slowest_step_s, seconds)

    @contextmanager
    def waiting(self, what: str):
        """Watch this wait; an enclosing wait starts afresh when it ends (progress was made)."""
        outer = self._current
        self._arm(what)
        try:
            yield
        finally:
            if outer is None:
                self._current = None
                faulthandler.cancel_dump_traceback_later()
            else:
                self._arm(outer[0])

    def beat(self) -> None:
        """Progress inside the current wait (a validation's next pack): its clock restarts."""
        if self._current is not None:
            self._arm(self._current[0])

    def close(self) -> None:
        self._closed.set()
        self._current = None
        faulthandler.cancel_dump_traceback_later()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)  # it wakes at least once a second

    def _arm(self, what: str) -> None:
        self._current = (what, time.monotonic())
        limit = self.limit_s + BACKSTOP_S
        faulthandler.dump_traceback_later(limit, exit=True, file=self.stacks_out)

    def _watch(self) -> None:
        while not self._closed.wait(min(1.0, self.limit_s / 10)):
            current = self._current
            if current is None:
                continue
            what, since = current
            waited = time.monotonic() - since
            if waited > self.limit_s:
                self._fail(what, waited)

    def _fail(self, what: str, waited: float) -> None:
        limit = (
            f"draft.stall_timeout = {self.timeout_s:g} s"
            if self.timeout_s > 0
            else f"the automatic limit of {self.limit_s:.0f} s (draft.stall_timeout = 0: the "
            f"larger of {STALL_FLOOR_S:.0f} s and {STALL_STEP_FACTOR:g} x the slowest step, "
            f"{self.slowest_step_s:.1f} s)"
        )
        message = (
            f"eagleflow.train: rank {self.rank} (pid {os.getpid()}) stalled: it waited "
            f"{waited:.0f} s for {what}, beyond {limit}. Every thread's stack follows. The job "
            "fails so that its rerun resumes from the last checkpoint; if the wait was "
            "legitimate, raise draft.stall_timeout."
        )
        try:
            print(message, file=self.out, flush=True)
            faulthandler.dump_traceback(file=self.stacks_out, all_threads=True)
            self.stacks_out.flush()
            for worker in multiprocessing.active_children():  # the data workers: none left
                worker.kill()
        finally:
            os._exit(1)


def with_fileno(stream):
    """`stream`, or the process's own stderr where `stream` has no file descriptor (pytest's
    captured sys.stderr)."""
    try:
        stream.fileno()
        return stream
    except (AttributeError, ValueError, OSError):
        return sys.__stderr__
