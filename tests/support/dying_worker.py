"""A worker extension whose workers can be slowed down and told to die (tests of eagleflow's
engine watch)."""

import os
import signal
import threading
import time

from eagleflow.engine.fixed_worker import FixedWorker


class DyingWorker(FixedWorker):
    def slow_down(self, seconds: float) -> None:
        """Make every forward of the model take `seconds` longer."""
        model = self.model_runner.model
        forward = model.forward

        def slow(*args, **kwargs):
            time.sleep(seconds)
            return forward(*args, **kwargs)

        model.forward = slow

    def die_in(self, seconds: float) -> None:
        """SIGKILL this worker process `seconds` from now (returns at once)."""
        threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGKILL)).start()

    def ping(self) -> str:
        return "pong"
