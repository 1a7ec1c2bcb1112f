"""Numerical stability per step: non-finite values, overflow-skipped steps, the fp16 loss scale.

DeepSpeed reports overflow only in fp16 (its bf16 optimizer keeps no overflow flag), so every
precision also gets its own non-finite checks on losses, gradient norms, rewards, KL and values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

CLASSES = ("stable", "recovered", "skip-storm", "diverged")


def _finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


@dataclass
class StabilityTracker:
    stop_after_nonfinite: int
    skip_storm_len: int
    first_nonfinite_step: int | None = None
    first_nonfinite_metric: str | None = None
    last_step_nonfinite: bool = False
    consecutive_nonfinite: int = 0
    skipped_steps: dict[str, list[int]] = field(default_factory=dict)
    loss_scale: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    aborted: str | None = None
    steps_seen: int = 0

    def observe(
        self,
        step: int,
        values: dict[str, float | None],
        skipped: dict[str, bool],
        loss_scales: dict[str, float | None],
    ) -> bool:
        """Record one step; returns True when the stage should stop (persistently non-finite)."""
        self.steps_seen += 1
        bad = [name for name, value in values.items() if not _finite(value)]
        if bad and self.first_nonfinite_step is None:
            self.first_nonfinite_step = step
            self.first_nonfinite_metric = bad[0]
        self.last_step_nonfinite = bool(bad)
        self.consecutive_nonfinite = self.consecutive_nonfinite + 1 if bad else 0
        for role, was_skipped in skipped.items():
            steps = self.skipped_steps.setdefault(role, [])
            if was_skipped:
                steps.append(step)
        for role, scale in loss_scales.items():
            if scale is not None:
                trajectory = self.loss_scale.setdefault(role, [])
                if not trajectory or trajectory[-1][1] != scale:
                    trajectory.append((step, float(scale)))
        return self.consecutive_nonfinite >= self.stop_after_nonfinite

    def abort(self, reason: str, step: int) -> None:
        """The engine gave up (e.g. loss scale at its minimum): the run diverged at `step`."""
        self.aborted = reason
        if self.first_nonfinite_step is None:
            self.first_nonfinite_step = step
            self.first_nonfinite_metric = "loss_scale"

    def _runs(self, steps: list[int]) -> tuple[int, int]:
        """(calibration skips, longest later run): skips at the very start, while the dynamic scale
        comes down from its initial value, are normal calibration and are not counted as a storm."""
        calibration = 0
        while calibration < len(steps) and steps[calibration] == calibration:
            calibration += 1
        if calibration == self.steps_seen:  # never a good step: the whole run is one storm
            calibration = 0
        longest, run, previous = 0, 0, None
        for step in steps[calibration:]:
            run = run + 1 if previous is not None and step == previous + 1 else 1
            longest, previous = max(longest, run), step
        return calibration, longest

    def summary(self) -> dict[str, Any]:
        runs = {role: self._runs(steps) for role, steps in self.skipped_steps.items()}
        later_skips = sum(len(s) - runs[r][0] for r, s in self.skipped_steps.items())
        longest = max((run[1] for run in runs.values()), default=0)
        if self.aborted or self.last_step_nonfinite:
            classification = "diverged"
        elif longest >= self.skip_storm_len:
            classification = "skip-storm"
        elif self.first_nonfinite_step is not None or later_skips:
            classification = "recovered"
        else:
            classification = "stable"
        scales = [scale for trajectory in self.loss_scale.values() for _, scale in trajectory]
        return {
            "classification": classification,
            "first_nonfinite_step": self.first_nonfinite_step,
            "first_nonfinite_metric": self.first_nonfinite_metric,
            "overflow_skipped_steps": {role: len(s) for role, s in self.skipped_steps.items()},
            "overflow_skipped_at": self.skipped_steps,
            "calibration_skips": {role: run[0] for role, run in runs.items()},
            "longest_skip_run": longest,
            "loss_scale_trajectory": {role: [list(p) for p in t] for role, t in self.loss_scale.items()},
            "loss_scale_min": min(scales) if scales else None,
            "aborted": self.aborted,
            "steps_observed": self.steps_seen,
        }
