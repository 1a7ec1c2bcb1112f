"""Soak-run arithmetic: the least-squares fit, the flat / growing rule and the budget projection, by hand."""

from __future__ import annotations

import pytest

from bench.measure.trend import MIB, crossing_step, first_fitted_step, least_squares, phase_trend, soak_trends


def test_least_squares_by_hand():
    assert least_squares([0, 1, 2], [10, 12, 14]) == pytest.approx((2.0, 10.0))
    # mean x 1.5, mean y 2.5; sum dx*dy = 2.25 - 0.25 - 0.25 + 2.25 = 4; sum dx^2 = 5 -> slope 0.8, intercept 1.3
    assert least_squares([0, 1, 2, 3], [1, 3, 2, 4]) == pytest.approx((0.8, 1.3))
    with pytest.raises(ValueError, match="2 distinct x"):
        least_squares([3, 3], [1, 2])


def test_the_fit_starts_after_warm_up_and_the_first_tenth():
    assert first_fitted_step(2, 100) == 10
    assert first_fitted_step(20, 100) == 20
    assert first_fitted_step(0, 5) == 1


def test_a_planted_mib_per_step_is_growing_and_crosses_the_budget_where_the_line_says():
    points = [(step, 500 * MIB + step * MIB) for step in range(10, 30)]  # 20 points, 1 MiB per step
    trend = phase_trend(points, budget_bytes=600 * MIB)
    assert trend["verdict"] == "growing"
    assert trend["bytes_per_100_steps"] == pytest.approx(100 * MIB)
    assert trend["fitted_growth_bytes"] == pytest.approx(19 * MIB)  # steps 10 -> 29
    assert trend["tolerance_bytes"] == pytest.approx(0.01 * 519.5 * MIB)  # 1 % of the mean peak > 4 MiB
    # fitted peak = 500 MiB + step MiB: step 100 reaches 600 MiB exactly, step 101 exceeds it
    assert trend["budget_crossed_at_step"] == 101


def test_noise_and_a_drift_under_the_tolerance_are_flat():
    noisy = [(step, 500 * MIB + (2 * MIB if step % 2 else 0)) for step in range(10, 30)]
    assert phase_trend(noisy)["verdict"] == "flat"
    drift = [(step, 500 * MIB + step * MIB // 10) for step in range(10, 30)]  # 1.9 MiB over the window
    trend = phase_trend(drift, budget_bytes=600 * MIB)
    assert trend["verdict"] == "flat" and "budget_crossed_at_step" not in trend
    assert phase_trend(drift[:9])["verdict"] == "too few steps"


def test_crossing_step_is_the_last_step_when_the_budget_is_already_exceeded():
    assert crossing_step(slope=1.0, intercept=0.0, budget_bytes=10.0, last_step=20) == 20
    assert crossing_step(slope=2.0, intercept=0.0, budget_bytes=10.0, last_step=3) == 6  # 2 x 6 = 12 > 10


def test_soak_trends_fit_each_phase_over_the_window_with_what_grew_with_it():
    timeline = []
    for step in range(30):
        timeline.append({"phase": "generation", "step": step, "peak_bytes": 300 * MIB, "retained_bytes": 0})
        timeline.append({"phase": "training", "step": step, "peak_bytes": 400 * MIB + 2 * step * MIB,
                         "allocator_slack_bytes": step * MIB // 2, "retained_bytes": 2 * MIB})
    steps = [{"step": s, "generated_tokens": 100 + 3 * s} for s in range(30)]
    # warm-up 5, 30 steps: the fit starts at step max(5, 3) = 5 -> 25 points per phase
    out = soak_trends(timeline, steps, warmup_steps=5, steps=30, budget_bytes=1000 * MIB, budget_source="test")
    generation, training = out["phases"]["generation"], out["phases"]["training"]
    assert generation["verdict"] == "flat" and generation["fitted_steps"] == [5, 29]
    assert training["verdict"] == "growing" and training["bytes_per_100_steps"] == pytest.approx(200 * MIB)
    assert training["budget_crossed_at_step"] == 301  # 400 + 2 x 300 = 1000 MiB, exceeded at step 301
    assert training["with_it"] == pytest.approx({"allocator_slack_bytes_per_100_steps": 50 * MIB,
                                                 "generated_tokens_per_100_steps": 300.0})
    assert training["retained_bytes_per_100_steps"] == pytest.approx(200 * MIB)
    assert out["grows_in"] == "training"
    assert out["budget_source"] == "test" and "steps >= 5" in out["method"]
    flat = soak_trends([e for e in timeline if e["phase"] == "generation"], steps, 5, 30, None, "none")
    assert flat["grows_in"] is None and "budget_crossed_at_step" not in flat["phases"]["generation"]
