"""Soak runs on the tiny model: a planted leak is found in its phase at its slope; a clean run stays flat."""

from __future__ import annotations

import pytest

from bench.measure.trend import MIB

pytestmark = pytest.mark.engine
TORCH_ADAMW = "framework.optimizer=torch_adamw"  # no JIT build; the optimizer is not what these tests measure


def test_a_planted_leak_is_found_growing_in_its_phase_at_its_slope(run_bench):
    record = run_bench(TORCH_ADAMW, "steps=30", "warmup_steps=2", "soak=true", "debug.leak_mib_per_step=4",
                       "debug.leak_phase=experience")  # the prerequisite RM of test_dschat's runs, cached
    ppo = record["stages"]["ppo"]
    assert ppo["status"] == "ok", ppo["error"]
    trend = ppo["memory"]["trend"]
    assert trend["grows_in"] == "experience", trend
    experience = trend["phases"]["experience"]
    assert experience["verdict"] == "growing"
    assert experience["fitted_steps"] == [3, 29]  # from max(warmup 2, a tenth of 30 steps) on
    assert experience["bytes_per_100_steps"] == pytest.approx(400 * MIB, rel=0.2)
    assert experience["retained_bytes_per_100_steps"] == pytest.approx(400 * MIB, rel=0.2)
    # the leak sits from the experience phase on: generation's peak (before it in a step) grows too, but keeps
    # nothing alive of its own
    assert trend["phases"]["generation"]["retained_bytes_per_100_steps"] < 100 * MIB
    assert experience["budget_crossed_at_step"] > 30
    assert "host RAM" in trend["budget_source"]


@pytest.mark.slow
def test_three_hundred_ppo_steps_are_flat_in_every_phase(run_bench):
    record = run_bench(TORCH_ADAMW, "steps=300", "warmup_steps=5", "soak=true")
    ppo = record["stages"]["ppo"]
    assert ppo["status"] == "ok", ppo["error"]
    trend = ppo["memory"]["trend"]
    assert {phase: t["verdict"] for phase, t in trend["phases"].items()} == {
        "generation": "flat", "experience": "flat", "training": "flat"}, trend
    assert trend["grows_in"] is None
