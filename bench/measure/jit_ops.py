"""Seconds this process spends in torch's JIT extension loader: compiled ops built or loaded at run time
(DeepSpeed's shm_comm, cpu_adam and fused_adam on the CPU). One figure of a run's fixed cost.

torch offers no hook for it, so `install` wraps `torch.utils.cpp_extension.load` with a timer that passes
every argument through unchanged. DeepSpeed imports `load` inside its op builder's `jit_load`, at call time,
so installing before the engines are imported catches every load.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch.utils.cpp_extension

_seconds = [0.0]


def install(on_load: Callable[[str], None] | None = None) -> None:
    """Time every later JIT extension load in this process (idempotent); `on_load` is told each op's name
    before it loads (a first load compiles for one to two minutes: the progress feed says so)."""
    load = torch.utils.cpp_extension.load
    if getattr(load, "_bench_timed", False):
        return

    @functools.wraps(load)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if on_load is not None:
            on_load(str(kwargs.get("name", args[0] if args else "?")))
        start = time.perf_counter()
        try:
            return load(*args, **kwargs)
        finally:
            _seconds[0] += time.perf_counter() - start

    timed._bench_timed = True  # type: ignore[attr-defined]
    torch.utils.cpp_extension.load = timed


def seconds() -> float:
    """Seconds spent in JIT extension loads since `install`."""
    return _seconds[0]
