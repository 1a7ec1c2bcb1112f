"""The memory model against the measurements: predicted and measured growth per framework, split by how far
each figure is from what the calibration was fitted on, the out-of-sample splits first."""

from __future__ import annotations

import statistics
from typing import Any

from adapters import registry
from bench.plan import calibration
from bench.plan.accuracy import SPLITS, Accuracy, Comparison, comparisons, in_selection
from bench.plan.calibrate import splits
from bench.report.tables import Table

MIB = 2.0 ** 20
TOLERANCE = 0.15


def _accuracy_row(framework: str, split: str, members: list[Comparison]) -> list[str]:
    acc = Accuracy.of(members, TOLERANCE)
    worst = acc.worst
    return [framework, split, str(acc.runs), f"{acc.mae_physics:.1%}", f"{acc.mae:.1%}",
            f"{worst.error:+.1%} ({worst.stage} {worst.phase}, {worst.label})", f"{acc.within}/{acc.runs}"]


def left_out(unreadable: dict[str, str]) -> str:
    """What the accuracy could not count: successful runs whose configuration no longer reads as a run."""
    if not unreadable:
        return ""
    run, why = next(iter(sorted(unreadable.items())))
    return (f" Left out: {len(unreadable)} successful run(s) whose configuration no longer reads as a run "
            f"specification (first: {run}, {why}).")


def prediction_table(records: dict[str, dict[str, Any]]) -> list[Table]:
    unreadable: dict[str, str] = {}
    rows = comparisons(records, unreadable)
    if not rows:
        return []
    by_split: dict[str, dict[str, list[Comparison]]] = {}
    used: list[calibration.Calibration] = []
    for framework in sorted({r.framework for r in rows}):
        fits = calibration.load_all(registry.package(framework))
        by_fit: dict[int | None, list[Comparison]] = {}  # the framework's rows by the fit of their setting
        fit_of: dict[tuple[str, str, int | None], int | None] = {}
        for r in rows:
            if r.framework == framework:
                setting = ((records[r.run].get("environment") or {}).get("device") or "cpu", r.precision,
                           r.mmap_threshold)
                if setting not in fit_of:
                    fit = calibration.for_run(registry.package(framework), *setting)
                    fit_of[setting] = None if fit is None else fits.index(fit)
                by_fit.setdefault(fit_of[setting], []).append(r)
        label = framework if len(by_fit) == 1 else None
        for index, mine in sorted(by_fit.items(), key=lambda item: -1 if item[0] is None else item[0]):
            cal = None if index is None else fits[index]
            name = label or (f"{framework} ({cal.setting.describe()})" if cal else f"{framework} (no fit)")
            if cal is None:
                by_split[name] = {"no calibration": mine}
                continue
            used.append(cal)
            chosen = {r.run for r in mine if in_selection(records[r.run].get("config") or {},
                                                          cal.fitted_on.get("selection") or {})}
            by_split[name] = splits(mine, cal, chosen, framework, cal.device)
    summary, detail = [], []
    for split in (*SPLITS, "no calibration"):
        for framework, parts in by_split.items():
            if split in parts:
                summary.append(_accuracy_row(framework, split, parts[split]))
    for framework, parts in by_split.items():
        for split, members in parts.items():
            groups: dict[tuple[str, str], list[Comparison]] = {}
            for m in members:
                groups.setdefault((m.stage, m.phase), []).append(m)
            for (stage, phase), group in sorted(groups.items()):
                acc = Accuracy.of(group, TOLERANCE)
                detail.append([framework, split, stage, phase, str(acc.runs),
                               f"{statistics.median(m.measured for m in group) / MIB:,.0f}",
                               f"{statistics.median(m.predicted for m in group) / MIB:,.0f}",
                               f"{acc.mae_physics:.1%}", f"{acc.mae:.1%}",
                               f"{acc.worst.error:+.1%} ({acc.worst.label})", f"{acc.within}/{acc.runs}"])
    sources = "; ".join(f"{c.framework}, {c.setting.describe()}: {c.fitted_on.get('source')} where "
                        f"{c.fitted_on.get('selection')} ({c.fitted_on.get('runs')} runs)" for c in used)
    method = ("Growth over the post-import baseline on the busiest rank, MiB: measured, and predicted by each "
              "framework's memory model (adapters/<framework>/memory.py, physics) plus its calibration offset "
              "(adapters/<framework>/memory_calibration.json: the fit of the run's measurement setting, its "
              "precision and mmap threshold, none where no fit was measured under them; its batch share scaled by "
              "the run's tokens a micro-batch), the current model applied to every record's "
              "configuration. MAE = mean |predicted - measured| / measured, before (physics) and after calibration; "
              f"within = figures within {TOLERANCE:.0%}. Splits, furthest from the fit first: cross-validated "
              "offsets (each fitted configuration predicted by offsets fitted without it; the physics and the "
              "offsets' form were tuned on these same runs, so this is not out of sample), other model (a model the "
              "physics and the fit never saw: out of sample), same configuration at other seeds (the fitted code "
              "path again: close to in-sample), configuration not fitted, and fitted (the runs the calibration was "
              "fitted on). The offsets are cross-validated over the records under this report's folder alone; "
              "bench.plan.calibrate prints the stored calibration's own figures over every folder it was fitted on. "
              f"Calibration fitted on: {sources or 'none'}.{left_out(unreadable)}")
    return [Table("prediction_accuracy", "Memory model accuracy, furthest from the fit first", method,
                  ["framework", "split", "figures", "MAE physics", "MAE calibrated", "worst (its run)", "within"],
                  summary),
            Table("prediction", "Memory model: predicted vs measured, per phase and split",
                  "The accuracy table's figures per stage and phase (same method and splits).",
                  ["framework", "split", "stage", "phase", "figures", "measured MiB", "predicted MiB", "MAE physics",
                   "MAE calibrated", "worst (its run)", "within"], detail)]
