"""Soak runs: does a phase's per-step peak memory grow, how fast, and at which step would it cross a budget?

The fit is ordinary least squares of the per-step peak (max over ranks) against the step number, after
warm-up: from `warmup_steps` on, less the first tenth of the run, where allocator pools, caches and the
optimizer's lazily made states settle. A leak raises the peak of every phase after it, so the record also
names the phase it happens in: the one whose end keeps the most memory alive over the end of the phase
before it. A phase is `growing` when the fitted line rises across that window
by more than the larger of 4 MiB and 1 % of the phase's mean peak, else `flat`: smaller drifts are within
what the allocator moves between steps on its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

MIB = 2**20
SETTLE_FRACTION = 0.1
TOLERANCE_BYTES = 4 * MIB
TOLERANCE_SHARE = 0.01
MIN_POINTS = 10  # fewer fitted steps than this make no verdict
PER = 100  # slopes are given per 100 steps


def least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Slope and intercept of the least-squares line through (xs, ys)."""
    n = len(xs)
    if n < 2 or len(ys) != n:
        raise ValueError(f"a line needs at least 2 points of (x, y), got {n} x and {len(ys)} y")
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a line needs at least 2 distinct x values")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
    return slope, mean_y - slope * mean_x


def first_fitted_step(warmup_steps: int, steps: int) -> int:
    """The first step a soak fit uses: after warm-up and the settling tenth of the run."""
    return max(warmup_steps, math.ceil(SETTLE_FRACTION * steps))


def phase_trend(points: Sequence[tuple[int, float]], budget_bytes: float | None = None) -> dict[str, Any]:
    """Verdict for one phase from its (step, peak bytes) points, already cut to the fitted window."""
    if len(points) < MIN_POINTS:
        return {"verdict": "too few steps", "points": len(points), "min_points": MIN_POINTS}
    steps = [float(s) for s, _ in points]
    peaks = [float(b) for _, b in points]
    slope, intercept = least_squares(steps, peaks)
    first, last = steps[0], steps[-1]
    growth = slope * (last - first)
    tolerance = max(TOLERANCE_BYTES, TOLERANCE_SHARE * sum(peaks) / len(peaks))
    verdict = "growing" if growth > tolerance else "flat"
    trend: dict[str, Any] = {
        "verdict": verdict,
        "bytes_per_100_steps": slope * PER,
        "fitted_steps": [int(first), int(last)],
        "points": len(points),
        "fitted_growth_bytes": growth,
        "tolerance_bytes": tolerance,
        "fitted_last_bytes": intercept + slope * last,
    }
    if verdict == "growing" and budget_bytes is not None:
        trend["budget_crossed_at_step"] = crossing_step(slope, intercept, budget_bytes, int(last))
    return trend


def crossing_step(slope: float, intercept: float, budget_bytes: float, last_step: int) -> int:
    """The first step whose fitted peak exceeds the budget (the last step itself if it already does)."""
    if intercept + slope * last_step > budget_bytes:
        return last_step
    return math.floor((budget_bytes - intercept) / slope) + 1


def soak_trends(timeline: Sequence[dict[str, Any]], step_records: Sequence[dict[str, Any]], warmup_steps: int,
                steps: int, budget_bytes: float | None, budget_source: str) -> dict[str, Any]:
    """Per phase: the verdict, and the slopes of what may have grown with it over the same window --
    generated tokens per step, and on CUDA the allocator's slack (reserved - allocated)."""
    start = first_fitted_step(warmup_steps, steps)
    phases: dict[str, Any] = {}
    for phase in dict.fromkeys(entry["phase"] for entry in timeline):
        # steps whose phase started above its own floor have no peak of their own (memory tracker's schedule)
        entries = [e for e in timeline if e["phase"] == phase and e["step"] >= start and e["peak_bytes"] is not None]
        trend = phase_trend([(e["step"], e["peak_bytes"]) for e in entries], budget_bytes)
        if trend["verdict"] in ("growing", "flat"):
            with_it = {}
            slack = [(e["step"], e["allocator_slack_bytes"]) for e in entries
                     if e.get("allocator_slack_bytes") is not None]
            if len(slack) >= 2 and len({s for s, _ in slack}) >= 2:
                with_it["allocator_slack_bytes_per_100_steps"] = least_squares(*zip(*slack, strict=True))[0] * PER
            generated = [(r["step"], r["generated_tokens"]) for r in step_records
                         if r.get("generated_tokens") is not None and r["step"] >= start]
            if len({s for s, _ in generated}) >= 2:
                with_it["generated_tokens_per_100_steps"] = least_squares(*zip(*generated, strict=True))[0] * PER
            trend["with_it"] = with_it
            retained = [e["retained_bytes"] for e in entries if e.get("retained_bytes") is not None]
            if retained:
                trend["retained_bytes_per_100_steps"] = sum(retained) / len(retained) * PER
        phases[phase] = trend
    # A leak raises every later phase's peak too; the phase it happens in is the one that keeps memory alive.
    growing = [p for p, t in phases.items() if t["verdict"] == "growing"]
    retaining = {p: t["retained_bytes_per_100_steps"] for p, t in phases.items()
                 if t.get("retained_bytes_per_100_steps") is not None}
    grows_in = max(retaining, key=retaining.get) if growing and retaining else None
    return {
        "method": (f"least squares of each phase's per-step peak (max over ranks) against the step, over steps "
                   f">= {start} (after warm-up and the first tenth of the run); growing when the fitted rise "
                   f"over that window exceeds max({TOLERANCE_BYTES // MIB} MiB, "
                   f"{TOLERANCE_SHARE:.0%} of the mean peak)"),
        "budget_bytes": budget_bytes,
        "budget_source": budget_source,
        "phases": phases,
        "grows_in": grows_in,
        "grows_in_method": ("the phase whose end leaves the most memory alive over the one before it "
                            "(mean per step over the window); set only when some phase is growing"),
    }
