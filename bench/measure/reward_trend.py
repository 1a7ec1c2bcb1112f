"""Did PPO's reward move, or only wobble? The change from the first to the last window of steps, set against
its own noise.

change = mean of the last `window` rewards - mean of the first `window`; its standard error is
sqrt(s_first^2 / n + s_last^2 / n) with s the sample standard deviation of the steps in each window (the steps
of a window taken as independent draws around its mean). The change is a trend only when it exceeds
TREND_SE standard errors; with one step per window there is no spread to estimate, and no verdict.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

TREND_SE = 2.0


def _sample_variance(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / (len(values) - 1)


def reward_trend(curve: Sequence[float | None], window: int) -> dict[str, Any] | None:
    """{change, change_se, verdict: rose | fell | within noise | no noise estimate}; None where a window lacks
    a reward (a step that measured none) or the curve is shorter than two windows."""
    first, last = list(curve[:window]), list(curve[-window:])
    if window < 1 or len(curve) < 2 * window or any(v is None for v in first + last):
        return None
    change = sum(last) / window - sum(first) / window
    if window < 2:
        return {"change": change, "change_se": None, "verdict": "no noise estimate"}
    se = math.sqrt(_sample_variance(first) / window + _sample_variance(last) / window)
    verdict = "within noise" if abs(change) <= TREND_SE * se else "rose" if change > 0 else "fell"
    return {"change": change, "change_se": se, "verdict": verdict}
