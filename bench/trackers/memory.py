"""Peak memory per phase, per rank.

CPU: the kernel's RSS high-water mark, reset before each phase (`/proc/self/clear_refs` = 5) and read
after it (`VmHWM`). It catches spikes shorter than any sampling interval. Where the reset is refused
(hardened containers) it falls back to sampling RSS every 5 ms, which under-reads short spikes.

CUDA: `torch.cuda` max allocated and max reserved after a reset per phase, plus NVML's view of this
process at the end of the phase, plus the host RSS high-water mark (offloaded state lives there).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import threading
from dataclasses import dataclass

import psutil
import torch

CLEAR_REFS = "/proc/self/clear_refs"
STATUS = "/proc/self/status"


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


def _release_freed_memory() -> None:
    """Return freed heap to the OS so one phase's garbage does not raise the next phase's floor."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


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
    peak_bytes: int  # the figure peaks are compared on: host RSS peak on CPU, reserved on CUDA
    end_bytes: int
    host_peak_bytes: int
    allocated_peak_bytes: int | None = None
    reserved_peak_bytes: int | None = None
    nvml_process_bytes: int | None = None


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

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host = _HostPeak()
        self._nvml = _nvml_handle(device) if device.type == "cuda" else None

    @property
    def method(self) -> str:
        if self.device.type == "cuda":
            nvml = "; NVML process memory at phase end" if self._nvml else "; NVML unavailable"
            return (
                "torch.cuda max_memory_reserved (peak_bytes) and max_memory_allocated after "
                f"reset_peak_memory_stats per phase{nvml}; host: {self._host.method}"
            )
        return self._host.method

    def current_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_reserved(self.device)
        return psutil.Process().memory_info().rss

    def start(self) -> None:
        _release_freed_memory()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._host.start()

    def stop(self) -> MemoryReading:
        host_peak, host_end = self._host.stop()
        if self.device.type != "cuda":
            return MemoryReading(peak_bytes=host_peak, end_bytes=host_end, host_peak_bytes=host_peak)
        torch.cuda.synchronize(self.device)
        reserved = torch.cuda.max_memory_reserved(self.device)
        return MemoryReading(
            peak_bytes=reserved,
            end_bytes=torch.cuda.memory_reserved(self.device),
            host_peak_bytes=host_peak,
            allocated_peak_bytes=torch.cuda.max_memory_allocated(self.device),
            reserved_peak_bytes=reserved,
            nvml_process_bytes=_nvml_process_bytes(self._nvml),
        )


def _nvml_handle(device: torch.device):
    try:
        import pynvml

        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # NVML is optional: missing library, driver or permissions
        return None


def _nvml_process_bytes(handle) -> int | None:
    if handle is None:
        return None
    import pynvml

    try:
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid():
                return int(proc.usedGpuMemory)
    except pynvml.NVMLError:
        return None
    return None
