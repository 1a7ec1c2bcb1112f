"""A run's predicted memory per phase: the framework's own model (adapters/<framework>/memory.py, loaded
lazily by name) applied to the run's shape, plus the framework's stated calibration, and the entry a record
keeps next to its measurement."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapters import registry
from bench.plan import calibration
from bench.plan.physics import Terms, dtype_bytes
from bench.plan.run_shape import RunShape
from bench.run.spec import RunSpec

MiB = 2 ** 20
METHOD = ("bytes each phase adds over the post-import baseline on the busiest rank: the framework's memory model "
          "(adapters/<framework>/memory.py: parameter counts, dtypes, ZeRO partitioning, the tensors each phase "
          "keeps alive, the stand-in's saved activations) = physics, plus the framework's calibration offset "
          "(adapters/<framework>/memory_calibration.json, the fit of the run's precision and mmap threshold, none "
          "where no fit was measured under them; its batch share scaled by the run's tokens a micro-batch) = "
          "predicted; error = (predicted - measured) / measured")


@dataclass(frozen=True)
class PhasePrediction:
    physics: Terms
    calibration: float

    @property
    def predicted(self) -> float:
        return self.physics.device + self.calibration


def physics(spec: RunSpec, stage: str, device: str = "cpu") -> dict[str, Terms] | None:
    """Bytes each phase of `stage` adds over the post-import baseline on the busiest rank, from the
    framework's memory model alone; None for a framework without one."""
    model = registry.memory_model(spec.framework)
    if model is None:
        return None
    return model(RunShape.from_spec(spec, stage, device))


def calibration_for(spec: RunSpec, device: str) -> calibration.Calibration | None:
    """The framework's fit of the run's measurement setting (precision, mmap threshold) on `device`, or None."""
    return calibration.for_run(registry.package(spec.framework), device, spec.precision, spec.memory_mmap_threshold)


def predict_stage(spec: RunSpec, stage: str, device: str = "cpu",
                  calibrated: bool = True) -> dict[str, PhasePrediction] | None:
    terms = physics(spec, stage, device)
    if terms is None:
        return None
    cal = calibration_for(spec, device) if calibrated else None
    regime, value_bytes = regime_of(spec), dtype_bytes(spec.precision)
    return {phase: PhasePrediction(t, cal.offset(calibration.key(stage, phase, regime), device, value_bytes,
                                                 spec.model.name, micro_batch_tokens(spec)) if cal else 0.0)
            for phase, t in terms.items()}


def micro_batch_tokens(spec: RunSpec) -> int:
    """Tokens a micro-batch of `spec` carries, batch x (prompt + answer): what the calibration's batch share
    scales with."""
    return spec.batch * (spec.prompt_len + spec.answer_len)


def regime_of(spec: RunSpec) -> str:
    """The calibration regime of a run (bench.plan.calibration.regime), as its framework splits them."""
    return calibration.regime(spec.zero, spec.lora, registry.zero0_own_engine(spec.framework))


def record_entry(spec: RunSpec, stage: str, device: str, memory: dict[str, Any]) -> dict[str, Any] | None:
    """The prediction a stage record keeps beside its measured phases (bench.results.record's `memory`)."""
    predicted = predict_stage(spec, stage, device)
    if predicted is None:
        return None
    phases = {}
    measured_phases = memory.get("phases", {})
    for phase, p in predicted.items():
        measured = (measured_phases.get(phase) or {}).get("growth_over_baseline_bytes")
        entry = {"physics_bytes": {k: round(v) for k, v in p.physics.as_dict().items() if v},
                 "physics_total_bytes": round(p.physics.device), "calibration_bytes": round(p.calibration),
                 "predicted_bytes": round(p.predicted), "measured_growth_bytes": measured}
        if measured:
            entry["error"] = (p.predicted - measured) / measured
            entry["error_physics"] = (p.physics.device - measured) / measured
        phases[phase] = entry
    return {"method": METHOD, "unit": "bytes", "device": device, "calibration": calibration_source(spec, device),
            "phases": phases}


def calibration_source(spec: RunSpec, device: str) -> str:
    """Which fit a run's prediction took, in words: its setting and what it was fitted on, or why none."""
    cal = calibration_for(spec, device)
    if cal is None:
        return (f"none: no {spec.framework} calibration on {device} for "
                f"{calibration.describe_run_setting(spec.precision, spec.memory_mmap_threshold)} (physics alone)")
    return (f"the fit for {cal.setting.describe()} on {device}: {cal.fitted_on.get('runs')} runs of "
            f"{cal.fitted_on.get('source')} where {cal.fitted_on.get('selection')}")
