"""A trainer's own `train()` run in a thread, handing control back to the harness at named seams.

TRL's trainers own their loops (PPOTrainer.train is one inline loop; SFT, RM and GRPO run HF Trainer's). The
harness's step loop calls one phase at a time, so the trainer runs unchanged in a second thread of the same
process and pauses at seams: the wrapped calls that delimit a phase (adapters/hf_trl/seams.py) and trainer
callbacks. A harness phase lets the trainer run until the seam that ends it; only one of the two threads runs
at a time, so the phase's memory and time are the trainer's. The thread also times each of the trainer's steps
itself (between two step seams, less the time it was paused): the figure the phases must add up to.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any


class Stopped(BaseException):  # noqa: N818 -- not an error: the harness ended the stage before the trainer did
    """Raised in the trainer's thread at its next seam once the harness closes the stage."""


class LoopDriver:
    def __init__(self, train: Callable[[], Any], step_seams: tuple[str, ...]) -> None:
        self._train = train
        self._step_seams = step_seams  # seams that end one of the trainer's steps (and begin the next)
        self._thread = threading.Thread(target=self._run, name="trainer-loop", daemon=True)
        self._reached: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._go = threading.Semaphore(0)
        self._stop = False
        self._last_boundary: float | None = None
        self._paused = 0.0
        self.step_seconds: list[float] = []  # the trainer's own steps, timed in its thread less its pauses
        self.finished = False

    def _run(self) -> None:
        try:
            self._train()
            self._reached.put(("finished", None))
        except Stopped:
            self._reached.put(("stopped", None))
        except BaseException as err:  # handed to the harness's thread, which raises it as its own
            self._reached.put(("error", err))

    def seam(self, name: str, payload: Any = None) -> None:
        """Called by the trainer (in its thread): report `name`, wait until the harness lets it go on."""
        if threading.current_thread() is not self._thread:
            return  # the trainer's code called from the harness's thread (evaluation): nothing to hand over
        now = time.perf_counter()
        if name in self._step_seams:
            if self._last_boundary is not None:
                self.step_seconds.append(now - self._last_boundary - self._paused)
            self._last_boundary, self._paused = now, 0.0
        self._reached.put((name, payload))
        self._go.acquire()
        self._paused += time.perf_counter() - now
        if self._stop:
            raise Stopped

    def advance(self, until: str) -> Any:
        """Let the trainer run until it reaches the seam `until` (passing others); returns that seam's payload."""
        if self.finished:
            raise RuntimeError(f"the trainer's loop has ended; it cannot reach {until!r}")
        if self._thread.is_alive():
            self._go.release()
        else:
            self._thread.start()
        while True:
            name, payload = self._reached.get()
            if name in ("finished", "stopped", "error"):
                self.finished = True
                if name == "error":
                    raise payload
                raise RuntimeError(f"the trainer's loop ended before reaching {until!r}")
            if name == until:
                return payload
            self._go.release()

    def finish(self) -> None:
        """Let the trainer run to its end (its on_train_end), raising what it raised."""
        if self.finished or not self._thread.is_alive():
            return
        self._go.release()
        while True:
            name, payload = self._reached.get()
            if name == "error":
                self.finished = True
                raise payload
            if name in ("finished", "stopped"):
                self.finished = True
                self._thread.join()
                return
            self._go.release()

    def stop(self) -> None:
        """End the trainer's thread at its next seam (a stage the harness ended early)."""
        if self.finished or not self._thread.is_alive():
            return
        self._stop = True
        self._go.release()
        self._thread.join()
        self.finished = True
