"""The memory model against the measurements: predicted and measured growth per framework, stage and phase."""

from __future__ import annotations

import statistics
from typing import Any

from adapters import registry
from bench.plan import calibration
from bench.plan.accuracy import Accuracy, comparisons, fitted
from bench.report.tables import Table

MIB = 2.0 ** 20
TOLERANCE = 0.15


def prediction_table(records: dict[str, dict[str, Any]]) -> list[Table]:
    rows = comparisons(records)
    if not rows:
        return []
    cals = {f: calibration.load(registry.package(f)) for f in {r.framework for r in rows}}
    groups: dict[tuple[str, str, str, bool], list] = {}
    for r in rows:
        groups.setdefault((r.framework, r.stage, r.phase, fitted(r, records, cals)), []).append(r)
    body = []
    for (framework, stage, phase, was_fitted), members in sorted(groups.items()):
        acc = Accuracy.of(members, TOLERANCE)
        worst = acc.worst
        body.append([framework, stage, phase, "fitted" if was_fitted else "held out", str(acc.runs),
                     f"{statistics.median(m.measured for m in members) / MIB:,.0f}",
                     f"{statistics.median(m.predicted for m in members) / MIB:,.0f}",
                     f"{acc.mae_physics:.1%}", f"{acc.mae:.1%}", f"{worst.error:+.1%} ({worst.label})",
                     f"{acc.within}/{acc.runs}"])
    overall = Accuracy.of(rows, TOLERANCE)
    unfitted = [r for r in rows if not fitted(r, records, cals)]
    per_model = "; ".join(
        f"{model}: {acc.runs} figures, MAE {acc.mae:.1%}, worst {acc.worst.error:+.1%}, {acc.within} within"
        for model in sorted({r.model for r in unfitted})
        if (acc := Accuracy.of([r for r in unfitted if r.model == model], TOLERANCE)) is not None)
    sources = "; ".join(f"{f}: {c.fitted_on.get('source')} where {c.fitted_on.get('selection')} "
                        f"({c.fitted_on.get('runs')} runs)" for f, c in sorted(cals.items()) if c)
    caption = ("Growth over the post-import baseline on the busiest rank, MiB: measured, and predicted by each "
               "framework's memory model (adapters/<framework>/memory.py, physics) plus its calibration offset "
               "(adapters/<framework>/memory_calibration.json); the current model applied to every record's "
               "configuration (a record's own memory.prediction keeps what was predicted when it ran). MAE = mean "
               f"|predicted - measured| / measured, before (physics) and after calibration; within = runs within "
               f"{TOLERANCE:.0%}. 'fitted' rows are the runs the calibration was fitted on, 'held out' the others. "
               f"Calibration fitted on: {sources or 'none'}. Over all {overall.runs} phase figures: MAE "
               f"{overall.mae:.1%} calibrated ({overall.mae_physics:.1%} physics), {overall.within} within "
               f"{TOLERANCE:.0%}, worst {overall.worst.error:+.1%}. Held out, per model: {per_model}.")
    return [Table("prediction", "Memory model: predicted vs measured, per phase", caption,
                  ["framework", "stage", "phase", "calibration", "runs", "measured MiB", "predicted MiB",
                   "MAE physics", "MAE calibrated", "worst (its run)", "within"], body)]
