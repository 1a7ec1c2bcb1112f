"""Per-framework calibration of the memory model: what the physics leaves unexplained, fitted from measured
runs and kept apart from it.

One term per framework, stage, phase and regime: the median, over the fitted runs, of measured minus
predicted growth (an offset in bytes). Regimes: `zero3` (parameters gathered block by block: the measured
heap fragmentation, scripts/engine_buffers.py), `lora` (many small trained tensors: a different allocator
pattern) and `full`. What an offset stands for on the CPU: allocator slack (glibc keeps freed heap that a
later phase reuses or that fragmentation pins), communication buffers the physics does not name, and
build-time transients. It is fitted on named runs (`fitted_on`), stored next to the framework's memory model
(adapters/<framework>/memory_calibration.json) and applied only on the device it was fitted on; the report
shows the error with and without it, on the runs it was fitted on and on the others.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

CALIBRATION_FILE = "memory_calibration.json"


@dataclass(frozen=True)
class Calibration:
    framework: str
    device: str
    offsets_bytes: dict[str, float]  # "stage/phase/regime" -> bytes added to the physics
    fitted_on: dict[str, Any] = field(default_factory=dict)  # what the fit read: source, selection, runs
    method: str = ("per stage, phase and regime (zero3, lora, full): median over the fitted runs of (measured - "
                   "physics) growth over the post-import baseline, busiest rank")

    def offset(self, key: str, device: str) -> float:
        return self.offsets_bytes.get(key, 0.0) if device == self.device else 0.0


def regime(zero: int, lora: int) -> str:
    return "zero3" if zero >= 3 else "lora" if lora else "full"


def key(stage: str, phase: str, regime_: str) -> str:
    return f"{stage}/{phase}/{regime_}"


@dataclass(frozen=True)
class Residual:
    key: str
    measured: float
    physics: float


def fit(framework: str, device: str, residuals: Iterable[Residual], fitted_on: dict[str, Any]) -> Calibration:
    by_phase: dict[str, list[float]] = {}
    for r in residuals:
        by_phase.setdefault(r.key, []).append(r.measured - r.physics)
    offsets = {phase: float(statistics.median(values)) for phase, values in sorted(by_phase.items())}
    return Calibration(framework=framework, device=device, offsets_bytes=offsets, fitted_on=fitted_on)


def path_for(framework_package: str) -> str:
    import adapters

    return os.path.join(os.path.dirname(adapters.__file__), framework_package, CALIBRATION_FILE)


def load(framework_package: str) -> Calibration | None:
    path = path_for(framework_package)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        data = json.load(f)
    return Calibration(**data)


def save(calibration: Calibration, framework_package: str) -> str:
    path = path_for(framework_package)
    with open(path, "w") as f:
        json.dump(asdict(calibration), f, indent=1, sort_keys=True)
        f.write("\n")
    return path
