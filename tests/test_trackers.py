"""Trackers measure for real: an allocation shows up in the phase's peak, and only in that phase."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.trackers.phases import PhaseTracker
from bench.trackers.stability import StabilityTracker

MIB = 1024 * 1024


def test_cpu_phase_peak_catches_a_short_allocation_and_resets():
    tracker = PhaseTracker(torch.device("cpu"))
    with tracker.phase("alloc", 0) as sample:
        block = np.ones(256 * MIB, dtype=np.uint8)  # touched pages: really resident
        sample["tokens"] = int(block[::4096].sum() > 0)
        del block
    with tracker.phase("idle", 0):
        pass
    alloc, idle = tracker.samples
    assert alloc["peak_bytes"] - alloc["end_bytes"] > 200 * MIB, alloc
    assert alloc["peak_bytes"] - idle["peak_bytes"] > 200 * MIB, (alloc, idle)
    assert alloc["time_s"] > 0 and alloc["tokens"] == 1
    assert "VmHWM" in tracker.memory.method or "psutil" in tracker.memory.method


def _observe(tracker: StabilityTracker, steps: int, nonfinite_at=(), skipped_at=()):
    for step in range(steps):
        loss = float("nan") if step in nonfinite_at else 1.0
        tracker.observe(step, {"loss/actor": loss}, {"actor": step in skipped_at}, {"actor": 2.0 ** (16 - step)})


def test_stability_classes():
    def classify(**kwargs) -> dict:
        tracker = StabilityTracker(stop_after_nonfinite=5, skip_storm_len=4)
        _observe(tracker, **kwargs)
        return tracker.summary()

    assert classify(steps=10)["classification"] == "stable"
    calibration = classify(steps=10, skipped_at=(0, 1, 2))
    assert calibration["classification"] == "stable" and calibration["calibration_skips"]["actor"] == 3
    assert classify(steps=10, skipped_at=(5,))["classification"] == "recovered"
    storm = classify(steps=12, skipped_at=(3, 4, 5, 6, 7))
    assert storm["classification"] == "skip-storm" and storm["longest_skip_run"] == 5
    diverged = classify(steps=10, nonfinite_at=(7, 8, 9))
    assert diverged["classification"] == "diverged"
    assert (diverged["first_nonfinite_step"], diverged["first_nonfinite_metric"]) == (7, "loss/actor")
    assert classify(steps=10, nonfinite_at=(3,))["classification"] == "recovered"
    assert diverged["loss_scale_min"] == 2.0 ** 7


def test_persistent_nonfinite_asks_to_stop():
    tracker = StabilityTracker(stop_after_nonfinite=3, skip_storm_len=4)
    stops = [tracker.observe(s, {"loss": float("inf")}, {}, {}) for s in range(3)]
    assert stops == [False, False, True]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the CUDA allocator path")
def test_cuda_phase_peak_reads_allocator_high_water_marks():
    tracker = PhaseTracker(torch.device("cuda", 0))
    with tracker.phase("alloc", 0):
        block = torch.ones(256 * MIB, dtype=torch.uint8, device="cuda")
        del block
    with tracker.phase("idle", 0):
        pass
    alloc, idle = tracker.samples
    assert alloc["allocated_peak_bytes"] - idle["allocated_peak_bytes"] >= 256 * MIB
    assert alloc["reserved_peak_bytes"] >= alloc["allocated_peak_bytes"]
    assert alloc["host_peak_bytes"] > 0 and "torch.cuda" in tracker.memory.method
