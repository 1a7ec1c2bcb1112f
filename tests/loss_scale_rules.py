"""A loss-scale trajectory against the skip flags of the same run: two counters an fp16 engine keeps apart (its
scaler's current scale, and whether each optimizer step was skipped on an overflow)."""

from __future__ import annotations

from typing import Any


def assert_scale_halves_only_on_skipped_steps(stability: dict[str, Any], role: str, initial: float) -> None:
    """The scale starts at `initial` (halved once if step 0 overflowed), and every later change is a halving at a
    step the engine skipped: dynamic loss scaling backs off by 2 on an overflow (after its hysteresis) and grows
    only after a window of clean steps far longer than these runs."""
    trajectory = stability["loss_scale_trajectory"][role]
    skipped = set(stability["overflow_skipped_at"].get(role, []))
    (step0, first), *changes = trajectory
    assert step0 == 0 and (first == initial or (first == initial / 2 and 0 in skipped)), (trajectory, skipped)
    previous = first
    for step, scale in changes:
        assert scale == previous / 2 and step in skipped, (trajectory, sorted(skipped))
        previous = scale
