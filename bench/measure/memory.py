"""Peak memory per phase, per rank.

CPU: the kernel's RSS high-water mark, reset before each phase (`/proc/self/clear_refs` = 5) and read
after it (`VmHWM`). It catches spikes shorter than any sampling interval. Where the reset is refused
(hardened containers) it falls back to sampling RSS every 5 ms, which under-reads short spikes. Before a
phase, garbage is collected and, where it would set the phase's floor, the heap malloc keeps free is handed
back to the kernel -- on a schedule, since the pages handed back are faulted in again by the next larger
phase (MemoryTracker.start says when, and what a run without the release records).

CUDA: phases are compared on `torch.cuda.max_memory_allocated` after a reset per phase (tensors alive).
`max_memory_reserved` is kept as its own figure: the caching allocator never returns what it holds, so a
reserved peak after a reset reads the largest earlier phase, not this one; reserved minus allocated is
allocator slack. NVML is read once per stage for what neither counts (CUDA context, communication
buffers). Plus the host RSS high-water mark per phase (offloaded state lives there).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import torch

CLEAR_REFS = "/proc/self/clear_refs"
# A phase starting less than this above its own last peak counts as starting from its own floor: what a steady
# loop's freed heap varies by, not another phase's garbage (the reading is then at most this much high).
FLOOR_SLACK_BYTES = 4 * 1024 * 1024
STATUS = "/proc/self/status"
# Which runs count as starting from a phase's own floor on the host (MemoryTracker.start), stamped on every record:
# 1 (records without the stamp): also a run after another phase, untrimmed, where resident memory lay below the
# phase's own last peak -- it ratcheted on that phase's freed heap; 2: never a run on another phase's freed heap.
# Host peaks measured under different rules are not alike (bench.plan.calibrate refuses to pool them).
FLOOR_RULE = 2


def _proc_status_bytes(key: str) -> int:
    with open(STATUS) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not found in {STATUS}")


def _clear_refs_writable() -> bool:
    try:
        with open(CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def trim_heap() -> None:
    """Hand the heap malloc holds free back to the kernel (glibc's malloc_trim, which also releases free pages
    in the middle of the heap)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@contextlib.contextmanager
def long_lived_frozen() -> Iterator[None]:
    """For the steps: the objects alive after init (models, engines, libraries) set aside from the garbage
    collector (gc.freeze), so that the collection before each phase walks only what the steps made, not the
    ~470,000 objects a glm-base DS-Chat rank holds after init; those are alive for the whole stage anyway.
    Python's own automatic collections skip them too, which makes those cheaper than in an unmeasured run; in
    a training loop full collections are rare (few objects outlive a step)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_live_bytes() -> int | None:
    """Bytes malloc has handed out and not had back (glibc mallinfo2: uordblks in its arenas + hblkhd mmapped):
    the host's live allocations, torch's CPU tensors among them -- what RSS shows minus memory freed but still
    cached by the allocator. None off glibc (or before 2.33)."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


class _RssSampler:
    def __init__(self, interval_s: float = 0.005) -> None:
        self._interval = interval_s
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self.peak = 0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.peak = self._proc.memory_info().rss
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return max(self.peak, self._proc.memory_info().rss)


@dataclass
class MemoryReading:
    # the figure phases are compared on: host RSS peak on CPU, allocated peak on CUDA; on the CPU None where the
    # phase started above its own floor without the heap released (see MemoryTracker.start)
    peak_bytes: int | None
    end_bytes: int  # at the phase's end, on the same scale as peak_bytes
    host_peak_bytes: int | None  # None as peak_bytes
    allocated_peak_bytes: int | None = None
    reserved_peak_bytes: int | None = None
    # live allocations at the phase's end (CUDA: allocated; CPU: malloc's, see malloc_live_bytes): what the
    # phase left alive, free of the allocator's caching; soak runs use it to find the phase a leak is in
    live_end_bytes: int | None = None
    # the host reading of a phase whose floor was an earlier phase's freed heap: at least the phase's peak
    peak_upper_bound_bytes: int | None = None


class _HostPeak:
    """The host RSS high-water mark of this process between start() and stop()."""

    def __init__(self) -> None:
        self.exact = _clear_refs_writable()
        self._sampler = None if self.exact else _RssSampler()

    @property
    def method(self) -> str:
        if self.exact:
            return "host RSS high-water mark (/proc/self/clear_refs reset + VmHWM), exact"
        return "host RSS sampled every 5 ms with psutil (clear_refs not writable; under-reads short spikes)"

    def start(self) -> None:
        if self._sampler is None:
            with open(CLEAR_REFS, "w") as f:
                f.write("5")
        else:
            self._sampler.start()

    def stop(self) -> tuple[int, int]:
        end = psutil.Process().memory_info().rss
        peak = _proc_status_bytes("VmHWM") if self._sampler is None else self._sampler.stop()
        return max(peak, end), end


class MemoryTracker:
    """Measures one rank's peak memory per phase; phases must not nest."""

    def __init__(self, device: torch.device, release_every: int = 4) -> None:
        if release_every < 1:
            raise ValueError(f"release_every={release_every} must be a whole number >= 1")
        self.device = device
        self.release_every = release_every
        self._host = _HostPeak()
        self._last_host_peak: dict[str, int] = {}  # per phase: its host peak the last time its floor was its own
        self._measured: dict[str, int] = {}  # per phase: runs with its own floor so far
        self._unmeasured_run: dict[str, int] = {}  # per phase: runs without it since the last one with it
        self._phase = ""
        self._floor_own = True

    @property
    def method(self) -> str:
        release = ("; before each phase gc.collect() (objects alive after init frozen) and, where another phase "
                   "ran last or resident memory is over 4 MiB above the phase's own last peak, malloc_trim(0) (the "
                   "sample's heap_trimmed) on the "
                   f"phase's first two runs and so that at least one run in every {self.release_every} starts from "
                   "its own floor (memory_release_every); a run left above it records no host peak "
                   "(peak_upper_bound_bytes instead)")
        return self._method + release

    @property
    def _method(self) -> str:
        if self.device.type == "cuda":
            return (
                "torch.cuda max_memory_allocated after reset_peak_memory_stats per phase (peak_bytes; tensors "
                "alive), max_memory_reserved alongside (allocator slack included; never below what the cache "
                f"already holds); NVML once per stage for memory outside the allocator; host: {self._host.method}"
            )
        return self._host.method

    def current_bytes(self) -> int:
        """Now, on the scale phases are compared on: allocated bytes on CUDA, resident bytes on the CPU."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return psutil.Process().memory_info().rss

    def start(self, phase: str) -> bool:
        """Prepares to measure `phase`; returns whether the freed heap was handed back to the kernel first.

        Garbage first: unreachable cycles are collected, so that tensors only they hold do not count. Then the
        heap malloc keeps free after earlier phases: where another phase ran last, or what is resident now is
        above this phase's own peak the last time it was measured (by more than FLOOR_SLACK_BYTES; or it has
        not run yet), that heap would set this phase's floor. Another phase's freed heap counts however low it
        lies: its holes need not fit this phase's allocations, which then come from fresh pages on top of it,
        and each such run measured would raise the reference the next is compared with (trlx's PPO generation
        at llama-base, ZeRO-3, rank 0's RSS: 1,540 -> 1,624 -> 1,681 -> 1,712 MiB over four runs after
        experience, 1,192-1,526 in the trimmed ones). Handing
        it back (malloc_trim) costs what the next larger phase spends faulting the same pages in again -- PPO's
        generation after training, every step: about 2 us a page, ~1 GiB a step at glm-base -- so it is done
        where the phase has not yet run twice from its own floor (the warm-up step and the first measured one)
        and so that at least one run in every `release_every` does. A run started above its floor without the
        release measures nothing of its own on the host: its reading is kept as an upper bound only
        (MemoryReading.peak_upper_bound_bytes); the phases after it in that step are left above their floors
        too, and are released on their own schedule.
        Where the same phase ran last and the floor is below its last peak nothing is trimmed: the phase's
        allocations reuse the heap it freed itself before asking the kernel for more (SFT's training step after
        training step)."""
        gc.collect()
        last = self._last_host_peak.get(phase)
        needed = (last is None or self._phase != phase
                  or psutil.Process().memory_info().rss > last + FLOOR_SLACK_BYTES)
        trimmed = needed and (self._measured.get(phase, 0) < 2
                              or self._unmeasured_run.get(phase, 0) >= self.release_every - 1)
        if trimmed:
            trim_heap()
        self._floor_own = trimmed or not needed
        if self._floor_own:
            self._measured[phase] = self._measured.get(phase, 0) + 1
            self._unmeasured_run[phase] = 0
        else:
            self._unmeasured_run[phase] = self._unmeasured_run.get(phase, 0) + 1
        self._phase = phase
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._host.start()
        return trimmed

    def stop(self) -> MemoryReading:
        host_peak, host_end = self._host.stop()
        bound = None
        if self._floor_own:
            self._last_host_peak[self._phase] = host_peak
        else:  # the floor was an earlier phase's freed heap: not this phase's figure
            host_peak, bound = None, host_peak
        if self.device.type != "cuda":
            return MemoryReading(peak_bytes=host_peak, end_bytes=host_end, host_peak_bytes=host_peak,
                                 live_end_bytes=malloc_live_bytes(), peak_upper_bound_bytes=bound)
        torch.cuda.synchronize(self.device)
        allocated = torch.cuda.max_memory_allocated(self.device)
        end = torch.cuda.memory_allocated(self.device)
        return MemoryReading(
            peak_bytes=allocated,
            end_bytes=end,
            live_end_bytes=end,
            host_peak_bytes=host_peak,
            allocated_peak_bytes=allocated,
            reserved_peak_bytes=torch.cuda.max_memory_reserved(self.device),
            peak_upper_bound_bytes=bound,
        )

    def outside_allocator(self) -> dict[str, Any]:
        """NVML's figure for this process on this GPU, and what the caching allocator does not hold of it
        (CUDA context, communication buffers, other libraries' allocations). Read once, at a stage's end."""
        if self.device.type != "cuda":
            return {"not_available": "not a CUDA device"}
        used = nvml_process_bytes(self.device)
        if isinstance(used, str):
            return {"not_available": used}
        reserved = torch.cuda.memory_reserved(self.device)
        return {"nvml_process_bytes": used, "reserved_bytes": reserved, "outside_allocator_bytes": used - reserved}


def nvml_process_bytes(device: torch.device) -> int | str:
    """GPU memory NVML reports for this process on `device`, or why it is not available. The handle is
    looked up by the device's UUID: NVML numbers GPUs by the host's order and ignores CUDA_VISIBLE_DEVICES.
    A container that sees host PIDs has no entry for its own PID, and under MIG `usedGpuMemory` is None:
    both read as "not available", never as a crash."""
    try:
        import pynvml
    except ImportError:
        return "pynvml not installed (pip install rlhf-bench[gpu])"
    try:
        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
        processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception as err:  # noqa: BLE001 -- NVML is optional: missing driver library, permissions, old API
        return f"NVML query failed: {type(err).__name__}: {err}"
    entry = next((p for p in processes if p.pid == os.getpid()), None)
    if entry is None:
        return f"no NVML process entry for PID {os.getpid()} (a container sees host PIDs)"
    if entry.usedGpuMemory is None:
        return "NVML reports no per-process memory (usedGpuMemory is None, e.g. under MIG)"
    return int(entry.usedGpuMemory)
