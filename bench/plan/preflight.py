"""`preflight=on|shrink`: before a run is launched, its predicted per-rank peak against the device.

The prediction is the framework's memory model (bench.plan.predict, calibrated) for every phase of every
stage the run has, plus what a rank holds before any model exists: on the host the interpreter, torch,
transformers and the engine libraries: the framework's `runtime_bytes`, fitted with its memory calibration
from the curated records (the median of rank 0's post-import baseline) and used only on the device it was
measured on. Without records from the device (no GPU runs are curated yet) the runtime is not counted, and the
verdict says so. The budget is `memory_budget_gb` per rank if set,
else the GPU's memory, else host RAM shared by the ranks; a run fits under SAFETY of it. `on` refuses a run
that does not fit; `shrink` halves the micro-batch until it fits and refuses only if batch 1 does not.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from bench.plan.cluster import SAFETY
from bench.plan.predict import predict_stage
from bench.run.spec import RunSpec

GiB = 2 ** 30


def runtime_bytes(spec: RunSpec, device: str) -> tuple[float, str]:
    """What a rank holds before any model exists on `device`, and where the figure comes from: the fit of the
    run's own setting, else the device's first fit (the baseline is taken before any model or tensor exists, so
    the precision and the mmap threshold do not set it), said so."""
    from adapters import registry
    from bench.plan import calibration

    on_device = [c for c in calibration.load_all(registry.package(spec.framework))
                 if c.device == device and c.runtime_bytes is not None]
    own = [c for c in on_device if c.setting is not None
           and c.setting.matches(spec.precision, spec.memory_mmap_threshold)]
    fitted = min(own, key=lambda c: len(c.setting.precisions)) if own else on_device[0] if on_device else None
    if fitted is None:
        return 0.0, f"not counted: no {spec.framework} records on {device} to measure it from"
    setting = "" if own else f", measured under {fitted.setting.describe()}"
    return fitted.runtime_bytes, (f"median post-import baseline of {fitted.fitted_on.get('runs')} {spec.framework} "
                                  f"runs on {device} ({fitted.fitted_on.get('source')}{setting})")


class PreflightRefusal(Exception):
    """The run is predicted not to fit; nothing was launched. The message has the numbers."""


@dataclass(frozen=True)
class Verdict:
    stage: str
    phase: str
    predicted_bytes: float  # runtime + the phase's predicted growth
    budget_bytes: float
    budget_source: str
    batch: int

    @property
    def limit_bytes(self) -> float:
        return SAFETY * self.budget_bytes

    @property
    def fits(self) -> bool:
        return self.predicted_bytes <= self.limit_bytes

    def as_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "phase": self.phase, "predicted_peak_bytes": round(self.predicted_bytes),
                "budget_bytes": round(self.budget_bytes), "budget_source": self.budget_source,
                "limit_bytes": round(self.limit_bytes), "batch": self.batch, "fits": self.fits}

    def describe(self) -> str:
        return (f"{self.stage} {self.phase} is predicted to peak at {self.predicted_bytes / GiB:.2f} GiB per rank "
                f"at batch {self.batch}; the limit is {self.limit_bytes / GiB:.2f} GiB ({SAFETY:.0%} of "
                f"{self.budget_source})")


def resolve_device(spec: RunSpec) -> str:
    if spec.launcher.device != "auto":
        return spec.launcher.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def budget(spec: RunSpec, device: str) -> tuple[float, str]:
    if spec.memory_budget_gb is not None:
        return spec.memory_budget_gb * GiB, f"memory_budget_gb={spec.memory_budget_gb:g} per rank"
    if device == "cuda":
        import torch

        props = torch.cuda.get_device_properties(0)
        return float(props.total_memory), f"{props.name} memory"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host / spec.launcher.nproc, f"host RAM / {spec.launcher.nproc} rank(s)"


def worst(spec: RunSpec, device: str, total: float, source: str) -> Verdict | None:
    """The stage and phase predicted to hold most, or None for a framework without a memory model."""
    found = None
    runtime, _ = runtime_bytes(spec, device)
    for stage in spec.stages:
        predicted = predict_stage(spec, stage, device)
        if predicted is None:
            return None
        for phase, p in predicted.items():
            verdict = Verdict(stage, phase, runtime + p.predicted, total, source, spec.batch)
            if found is None or verdict.predicted_bytes > found.predicted_bytes:
                found = verdict
    return found


def preflight(spec: RunSpec, mode: str, device: str) -> tuple[RunSpec, dict[str, Any] | None]:
    """(the spec to run, what preflight found) or PreflightRefusal. `shrink` returns a spec with a smaller
    batch when that is what fits (and, with global_batch stated, as much more gradient accumulation)."""
    if mode == "off":
        return spec, None
    total, source = budget(spec, device)
    verdict = worst(spec, device, total, source)
    if verdict is None:
        return spec, {"mode": mode, "skipped": f"{spec.framework} has no memory model"}
    first = verdict
    # with a stated global_batch the accumulation doubles as the micro-batch halves, so the global batch holds
    while not verdict.fits and mode == "shrink" and spec.batch > 1 and (spec.global_batch is None
                                                                         or spec.batch % 2 == 0):
        spec = dataclasses.replace(spec, batch=spec.batch // 2,
                                   grad_accum=spec.grad_accum * (1 if spec.global_batch is None else 2))
        verdict = worst(spec, device, total, source)
    runtime, runtime_source = runtime_bytes(spec, device)
    found = {"mode": mode, "device": device, "asked_batch": first.batch, "asked": first.as_dict(),
             "run_batch": spec.batch, "run_grad_accum": spec.grad_accum, "verdict": verdict.as_dict(), "safety": SAFETY,
             "runtime_bytes": runtime, "runtime_source": runtime_source}
    if not verdict.fits:
        hint = "" if mode == "shrink" else "; preflight=shrink halves the batch until it fits"
        shrunk = f" (still at batch {spec.batch} after halving)" if spec.batch != first.batch else ""
        raise PreflightRefusal(f"preflight={mode}: {verdict.describe()}{shrunk}{hint}")
    return spec, found
