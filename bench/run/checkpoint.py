"""Checkpoints during a stage, synchronous or overlapped with training, and the resume from the last one.

Every `checkpoint.every` steps the adapter saves its trained models (weights and optimizer states)
through its framework's own mechanism into `<stage>/checkpoints/step-<K>.partial` (K = steps done);
each rank adds its random-number states. Only when every rank's writes are done does rank 0 add
`meta.json` and rename the directory to `step-<K>`: a directory without `.partial` is complete, and a
resume never loads a partial one. The previous complete checkpoint is then removed.

`checkpoint.async=true` keeps the framework's save code and only changes where its `torch.save` calls go:
each call snapshots the object's tensors into host memory and hands the copy to a background thread,
which writes while training goes on (no framework offers this on the CPU: DeepSpeed's fast checkpoint
engines need its async-I/O op, ColossalAI's `use_async` needs tensornvme, accelerate has none). The
stall a save costs is the time of its measured `checkpoint` phase: the framework's gathers and state
dicts plus, synchronously, the writes; asynchronously, the host copies, and any wait for the previous
save's writes still in flight.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import json
import os
import queue
import random
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

PARTIAL = ".partial"
STEP_DIR = re.compile(r"^step-(\d+)$")


def _snapshot(obj: Any) -> Any:
    """A copy of `obj` whose tensors live in host memory, detached from anything training changes next."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the mapping's type (OrderedDict, defaultdict)
        for key, value in obj.items():
            out[key] = _snapshot(value)
        return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(_snapshot(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_snapshot(v) for v in obj)
    return obj


class BackgroundWriter:
    """One thread writing queued saves in order. `wait()` blocks until the queue is empty and re-raises a
    write's error in the training thread; its return value is how long that took."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._error: BaseException | None = None
        self.write_s = 0.0
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                start = time.perf_counter()
                job()
                self.write_s += time.perf_counter() - start
            except BaseException as err:  # noqa: BLE001 -- handed to the training thread by wait()
                self._error = err
            finally:
                self._queue.task_done()

    def submit(self, job: Callable[[], None]) -> None:
        self._queue.put(job)

    def wait(self) -> float:
        start = time.perf_counter()
        self._queue.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"a background checkpoint write failed: {error}") from error
        return time.perf_counter() - start

    def close(self) -> None:
        self.wait()
        self._queue.put(None)
        self._thread.join()


@contextlib.contextmanager
def snapshot_saves(writer: BackgroundWriter) -> Iterator[None]:
    """Within: `torch.save(obj, path)` (what DeepSpeed, ColossalAI's checkpoint IO and accelerate call)
    copies obj's tensors to host memory and queues the write of the copy; a save to a buffer writes now."""
    original = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(f, (str, os.PathLike)):
            original(obj, f, *args, **kwargs)
            return
        copy, path = _snapshot(obj), os.fspath(f)
        writer.submit(lambda: original(copy, path, *args, **kwargs))

    torch.save = save
    try:
        yield
    finally:
        torch.save = original


def _directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def latest_complete(root: str) -> tuple[int, str] | None:
    """The complete checkpoint with the most steps done under `root`, as (steps done, directory)."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(root), "step-*")):
        match = STEP_DIR.match(os.path.basename(path))
        if match and os.path.isfile(os.path.join(path, "meta.json")):
            found.append((int(match.group(1)), path))
    return max(found) if found else None


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class Checkpointer:
    """Saves every `every` steps through `save(directory)` (the adapter's, collective); completes each save
    once all its writes are done, on every rank."""

    def __init__(self, root: str, every: int, background: bool, rank: int,
                 save: Callable[[str], None]) -> None:
        self.root, self.every, self.background, self.rank = root, every, background, rank
        self._save = save
        self._writer = BackgroundWriter() if background else None
        self._pending: tuple[int, str] | None = None
        self.saves: list[dict[str, Any]] = []

    @property
    def mode(self) -> str:
        return "async" if self.background else "sync"

    def due(self, steps_done: int) -> bool:
        return self.every > 0 and steps_done % self.every == 0

    def save(self, steps_done: int) -> None:
        """Inside the measured `checkpoint` phase: what this returns after is the stall."""
        self.finish()
        partial = os.path.join(self.root, f"step-{steps_done}{PARTIAL}")
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # a torn earlier try at the same step
            os.makedirs(partial)
        _barrier()
        with snapshot_saves(self._writer) if self._writer is not None else contextlib.nullcontext():
            self._save(partial)
            torch.save(rng_state(), os.path.join(partial, f"rng-rank{self.rank}.pt"))
        self.saves.append({"steps_done": steps_done, "mode": self.mode})
        self._pending = (steps_done, partial)
        if self._writer is None:
            self.finish()

    def finish(self) -> None:
        """Wait for the pending save's writes, then (rank 0) mark it complete and drop the one before."""
        if self._pending is None:
            return
        steps_done, partial = self._pending
        self._pending = None
        entry = next(s for s in reversed(self.saves) if s["steps_done"] == steps_done)
        if self._writer is not None:
            entry["waited_for_writes_s"] = self._writer.wait()
            entry["background_write_s"] = self._writer.write_s
            self._writer.write_s = 0.0
        _barrier()
        if self.rank == 0:
            entry["bytes_written"] = _directory_bytes(partial)
            with open(os.path.join(partial, "meta.json"), "w") as f:
                json.dump({"steps_done": steps_done, "mode": self.mode}, f)
            final = partial.removesuffix(PARTIAL)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(partial, final)
            for path in glob.glob(os.path.join(glob.escape(self.root), "step-*")):
                match = STEP_DIR.match(os.path.basename(path))
                if match and int(match.group(1)) < steps_done:
                    shutil.rmtree(path, ignore_errors=True)
        _barrier()

    def close(self) -> None:
        self.finish()
        if self._writer is not None:
            self._writer.close()
