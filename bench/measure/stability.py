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
    """Per-rank stability of one stage. Rules (all counted per trained role, the worst role decides):

    - calibration: the leading overflow skips from step 0 while the loss scale only falls from its initial
      value (each skip lowers it), as long as they are at most half of the observed steps; these are the
      dynamic scale finding its level and do not count against the run;
    - skip-storm: a run of `skip_storm_len` consecutive later skips, or later skips (at least two) making up
      `skip_rate_storm` or more of the later steps, or every observed step skipped;
    - diverged: the engine gave up, or the last step was non-finite;
    - recovered: any non-finite value or later skip short of a storm; stable: none.
    """

    stop_after_nonfinite: int
    skip_storm_len: int
    skip_rate_storm: float = 0.25
    first_nonfinite_step: int | None = None
    first_nonfinite_metric: str | None = None
    last_step_nonfinite: bool = False
    consecutive_nonfinite: int = 0
    skipped_steps: dict[str, list[int]] = field(default_factory=dict)
    loss_scale: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    aborted: str | None = None
    steps_seen: int = 0
    _scale_at: dict[str, dict[int, float]] = field(default_factory=dict)

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
                self._scale_at.setdefault(role, {})[step] = float(scale)
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

    def _calibration(self, role: str, steps: list[int]) -> int:
        scales = self._scale_at.get(role, {})
        calibration, previous = 0, None
        while calibration < len(steps) and steps[calibration] == calibration and calibration in scales:
            scale = scales[calibration]
            if previous is not None and scale >= previous:
                break
            previous = scale
            calibration += 1
        return calibration if 2 * calibration <= self.steps_seen else 0

    def _role(self, role: str, steps: list[int]) -> dict[str, Any]:
        calibration = self._calibration(role, steps)
        later = steps[calibration:]
        longest, run, previous = 0, 0, None
        for step in later:
            run = run + 1 if previous is not None and step == previous + 1 else 1
            longest, previous = max(longest, run), step
        later_steps = self.steps_seen - calibration
        rate = len(later) / later_steps if later_steps else 0.0
        storm = (longest >= self.skip_storm_len or (len(later) >= 2 and rate >= self.skip_rate_storm)
                 or (self.steps_seen > 0 and len(steps) == self.steps_seen))
        return {"calibration": calibration, "later": len(later), "longest": longest, "rate": rate, "storm": storm}

    def summary(self) -> dict[str, Any]:
        roles = {role: self._role(role, steps) for role, steps in self.skipped_steps.items()}
        if self.aborted or self.last_step_nonfinite:
            classification = "diverged"
        elif any(r["storm"] for r in roles.values()):
            classification = "skip-storm"
        elif self.first_nonfinite_step is not None or any(r["later"] for r in roles.values()):
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
            "calibration_skips": {role: r["calibration"] for role, r in roles.items()},
            "later_skip_rate": {role: r["rate"] for role, r in roles.items()},
            "longest_skip_run": max((r["longest"] for r in roles.values()), default=0),
            "loss_scale_trajectory": {role: [list(p) for p in t] for role, t in self.loss_scale.items()},
            "loss_scale_min": min(scales) if scales else None,
            "aborted": self.aborted,
            "steps_observed": self.steps_seen,
            "rules": (f"calibration: leading skips while the loss scale only falls, at most half the steps; "
                      f"skip-storm: {self.skip_storm_len} consecutive later skips, a later skip rate >= "
                      f"{self.skip_rate_storm} (>= 2 skips), or every step skipped"),
        }
