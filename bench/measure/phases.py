"""One context manager per phase that measures both peak memory and wall time on this rank."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

import torch

from bench.measure.memory import MemoryTracker


class PhaseTracker:
    """Records one sample per (phase, step): time_s, peak/end bytes, and the work the caller adds."""

    def __init__(self, device: torch.device, release_every: int = 4) -> None:
        self.device = device
        self.memory = MemoryTracker(device, release_every)
        self.samples: list[dict[str, Any]] = []
        self.current_phase: str | None = None
        # told each phase's name and step as it starts (the progress feed, the rank's stall watchdog)
        self.on_phase: Callable[[str, int | None], None] | None = None

    @property
    def time_method(self) -> str:
        sync = " after torch.cuda.synchronize()" if self.device.type == "cuda" else ""
        return f"time.perf_counter() around each phase{sync}, per rank"

    @contextmanager
    def phase(self, name: str, step: int | None = None) -> Iterator[dict[str, Any]]:
        """Yields the sample dict; the caller adds `tokens`, `samples` and `flops` of the work done."""
        if self.current_phase is not None:
            raise RuntimeError(f"phase {name!r} started inside phase {self.current_phase!r}")
        sample: dict[str, Any] = {"phase": name, "step": step}
        self.current_phase = name
        if self.on_phase is not None:
            self.on_phase(name, step)
        sample["heap_trimmed"] = self.memory.start(name)
        start = time.perf_counter()
        yield sample
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        sample["time_s"] = time.perf_counter() - start
        sample.update(asdict(self.memory.stop()))
        self.samples.append(sample)
        self.current_phase = None
