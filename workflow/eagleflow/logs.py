"""Job logs: everything a step prints, and the full traceback of any error, goes to its log.

A user error (`UserError`: bad data, a wrong setting) is a sentence saying what to change: it is
written to the log as that sentence alone, and the job exits with status 1. Tracebacks are for
bugs."""

from __future__ import annotations

import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path


class UserError(Exception):
    """An error the user fixes in their data or config; its message says how."""


@contextmanager
def redirect_to_log(path: str | Path):
    """Send stdout and stderr, at the file-descriptor level so that subprocesses (vLLM's
    engine and workers) write there too, to `path`; on error, log the traceback and re-raise."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "a", buffering=1) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        user_error = None
        try:
            yield
        except UserError as e:
            user_error = e
            sys.stderr.flush()
            log.write(f"error: {e}\n")
        except SystemExit as e:
            if e.code not in (None, 0) and not isinstance(e.code, int):
                sys.stderr.flush()
                log.write(f"error: {e.code}\n")  # a message, not a bug
            raise
        except BaseException:
            sys.stderr.flush()
            traceback.print_exc(file=log)
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    if user_error is not None:
        print(f"error: {user_error}", file=sys.stderr)  # also where the job was started
        raise SystemExit(1) from None
