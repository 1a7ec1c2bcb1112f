"""Predicted against measured: the memory model applied to the configuration of every measured run.

Used by `bench.report` (the predicted-vs-measured table) and `python -m bench.plan.calibrate` (which fits the
per-framework offsets on a named selection of runs). The model applied is the current one, to each record's
configuration; a record's own `memory.prediction` keeps what was predicted when it ran.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from bench.plan import calibration
from bench.plan.physics import dtype_bytes
from bench.plan.predict import micro_batch_tokens, predict_stage, regime_of
from bench.results.collect import cell_config, cell_id
from bench.run.spec import SpecError, spec_from_config


@dataclass(frozen=True)
class Comparison:
    run: str
    framework: str
    stage: str
    phase: str
    model: str
    seed: int
    regime: str
    value_bytes: int  # the width of the run's values: the calibration scales with it
    cell: str  # the configuration without its seed: runs that differ only in the seed share it
    label: str  # the configuration in a few words
    measured: float
    physics: float
    predicted: float
    tokens: int  # a micro-batch's: the calibration's batch share scales with them
    batch_pair: str  # the configuration apart from its micro-batch: runs sharing it pair for the batch share
    precision: str = "bf16"  # with mmap_threshold, the measurement setting: which fit applies to the run
    mmap_threshold: int | None = None  # memory_mmap_threshold the ranks ran under (None: glibc's own)

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured

    @property
    def error_physics(self) -> float:
        return (self.physics - self.measured) / self.measured

    @property
    def key(self) -> str:
        return calibration.key(self.stage, self.phase, self.regime)


def _cell(record: dict[str, Any], stage: str) -> str:
    """The report's cell (the whole configuration minus seed and bookkeeping, prerequisite paths as "given")."""
    return cell_id(cell_config(record, stage))


def _batch_pair(record: dict[str, Any], stage: str) -> str:
    """The cell apart from the micro-batch's size (batch, the global batch it sets, prompt and answer lengths)."""
    config = cell_config(record, stage)
    return cell_id({k: v for k, v in config.items() if k not in MICRO_BATCH_KEYS})


MICRO_BATCH_KEYS = ("batch", "global_batch", "prompt_len", "answer_len")


def _label(spec: Any) -> str:
    lora = f" LoRA {spec.lora}" if spec.lora else ""
    return (f"{spec.model.name} ZeRO-{spec.zero}{lora} {spec.precision} {spec.launcher.nproc} rank(s) "
            f"seed {spec.seed}")


def in_selection(config: Mapping[str, Any], selection: Mapping[str, Any]) -> bool:
    """Whether a run's configuration matches a calibration's selection (dotted keys: model.name, seed, ...; a
    list value matches any of its items: model.name=[glm-base,llama-base])."""
    for key, wanted in selection.items():
        value: Any = config
        for part in key.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if value not in wanted if isinstance(wanted, list) else value != wanted:
            return False
    return True


def comparisons(records: Mapping[str, dict[str, Any]], unreadable: dict[str, str] | None = None
                ) -> list[Comparison]:
    """One entry per measured phase of every successful stage of a run that is not a forced failure and
    whose framework has a memory model. Phases without a host or device figure (an unmeasured, bounded
    run of the memory tracker) and the `imports` phase (the baseline itself) are left out. A successful run whose
    configuration no longer reads as a run specification is left out too, and named with why in `unreadable`
    (where given) so that the caller says how many."""
    out = []
    for run, record in sorted(records.items()):
        config = record.get("config") or {}
        if record.get("status") != "ok" or "forced-failure" in (config.get("tags") or []):
            continue
        try:
            spec = spec_from_config({**config, "init": {}})
        except (SpecError, KeyError, TypeError) as err:
            if unreadable is not None:
                unreadable[run] = f"{type(err).__name__}: {err}"
            continue
        device = (record.get("environment") or {}).get("device") or "cpu"
        for stage, result in record.get("stages", {}).items():
            if result.get("status") != "ok":
                continue
            predicted = predict_stage(spec, stage, device)
            if predicted is None:
                continue
            for phase, entry in (result.get("memory") or {}).get("phases", {}).items():
                measured = entry.get("growth_over_baseline_bytes")
                if phase == "imports" or not measured or phase not in predicted:
                    continue
                p = predicted[phase]
                out.append(Comparison(run, spec.framework, stage, phase, spec.model.name, spec.seed,
                                      regime_of(spec), dtype_bytes(spec.precision), _cell(record, stage),
                                      _label(spec), measured, p.physics.device, p.predicted,
                                      micro_batch_tokens(spec), _batch_pair(record, stage), spec.precision,
                                      spec.memory_mmap_threshold))
    return out


@dataclass(frozen=True)
class Accuracy:
    runs: int
    mae_physics: float
    mae: float
    worst: Comparison
    within: int  # runs within the tolerance

    @classmethod
    def of(cls, rows: Iterable[Comparison], tolerance: float) -> Accuracy | None:
        rows = list(rows)
        if not rows:
            return None
        worst = max(rows, key=lambda c: abs(c.error))
        return cls(runs=len(rows), mae_physics=statistics.mean(abs(c.error_physics) for c in rows),
                   mae=statistics.mean(abs(c.error) for c in rows), worst=worst,
                   within=sum(abs(c.error) <= tolerance for c in rows))


# How far a figure is from what the calibration was fitted on, furthest first: each fitted configuration predicted
# by offsets fitted without it (cross-validated offsets; the physics and the offsets' form were tuned on these same
# records, so this is not out of sample), a model the physics and the fit never saw (out of sample), the fitted
# configurations at other seeds (the same code path again: close to in-sample), configurations outside the
# selection, and the fitted runs themselves.
LEAVE_ONE_OUT, OTHER_MODEL, OTHER_SEEDS, OTHER_CONFIG, FITTED = (
    "cross-validated offsets (physics tuned on these runs)", "other model (out of sample)",
    "same configuration, other seeds", "configuration not fitted", "fitted")
SPLITS = (LEAVE_ONE_OUT, OTHER_MODEL, OTHER_SEEDS, OTHER_CONFIG, FITTED)


def split_of(comparison: Comparison, chosen: set[str], chosen_cells: set[str], chosen_models: set[str]) -> str:
    """Which split a figure falls in (not LEAVE_ONE_OUT: that one re-predicts the fitted configurations)."""
    if comparison.run in chosen:
        return FITTED
    if comparison.model not in chosen_models:
        return OTHER_MODEL
    return OTHER_SEEDS if comparison.cell in chosen_cells else OTHER_CONFIG

