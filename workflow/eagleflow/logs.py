"""Job logs: everything a step prints, and the full traceback of any error, goes to its log."""

from __future__ import annotations

import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path


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
        try:
            yield
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
