"""reward.normalize and PPO's convergence step: the arithmetic worked by hand, the refusals, the tags."""

from __future__ import annotations

import math

import pytest
import torch

from adapters.reward_norm import RewardScaling, reward_scaling
from bench.results.record import convergence_step
from bench.run.config import compose
from bench.run.reward_stats import HeldoutStatistics, Moments, heldout_statistics, read_statistics
from bench.run.spec import SpecError, spec_from_config


def test_moments_pool_by_adding_and_give_the_sample_std() -> None:
    whole = Moments.of([1.0, 2.0, 3.0, 4.0])
    halves = [Moments.of([1.0, 2.0]), Moments.of([3.0, 4.0])]
    pooled = Moments(*(sum(getattr(m, f) for m in halves) for f in ("count", "total", "squares")))
    assert pooled == whole == Moments(4.0, 10.0, 30.0)
    # mean 2.5; squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5 over n - 1 = 3
    assert whole.mean == 2.5 and math.isclose(whole.std, math.sqrt(5 / 3))


def test_the_check_split_is_z_scored_with_the_first_splits_statistics() -> None:
    stats = heldout_statistics(Moments.of([1.0, 2.0, 3.0, 4.0]), Moments.of([2.5, 5.0]), "four scores")
    std = math.sqrt(5 / 3)  # 1.29099
    assert stats.mean == 2.5 and math.isclose(stats.std, std) and stats.count == 4
    # the check split's mean 3.75 -> (3.75 - 2.5) / 1.29099 = 0.96825; its std 1.76777 -> 1.36931
    assert math.isclose(stats.check_mean, 1.25 / std) and math.isclose(stats.check_mean, 0.96825, rel_tol=1e-5)
    assert math.isclose(stats.check_std, 1.36931, rel_tol=1e-5)
    with pytest.raises(ValueError, match="same score"):
        heldout_statistics(Moments.of([1.0, 1.0]), Moments.of([1.0, 2.0]), "flat")


def test_scalings_of_the_rm_score() -> None:
    stats = HeldoutStatistics(mean=2.0, std=2.0, count=64, check_mean=0.0, check_std=1.0, data="by hand")
    scores = torch.tensor([1.0, 3.0, 6.0])
    assert RewardScaling("zscore", statistics=stats)(scores).tolist() == [-0.5, 0.5, 2.0]
    assert RewardScaling("none")(scores) is scores
    # running: over the std of every score seen so far (one process: this rank's); [1, 3, 6]: mean 10/3,
    # squared deviations 5.444 + 0.111 + 7.111 = 12.667 over 2 -> std 2.5166
    running = RewardScaling("running")
    assert torch.allclose(running(scores), scores / math.sqrt(38 / 6))
    # a second batch joins the moments: [1, 3, 6, 2]: mean 3, squared deviations 4 + 0 + 9 + 1 = 14 over 3
    assert torch.allclose(running(torch.tensor([2.0])), torch.tensor([2.0]) / math.sqrt(14 / 3))


def test_null_keeps_each_frameworks_upstream_and_zscore_needs_the_rm_statistics(tmp_path) -> None:
    spec = spec_from_config(compose(["framework=trlx", "stage=ppo"]))
    assert reward_scaling(spec, {}, "running").mode == "running"
    zscore = spec_from_config(compose(["framework=trlx", "stage=ppo", "reward.normalize=zscore"]))
    with pytest.raises(FileNotFoundError, match="needs a trained reward model"):
        reward_scaling(zscore, {}, "running")
    checkpoint = tmp_path / "reward.pt"
    checkpoint.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="saved without them"):
        read_statistics(str(checkpoint))


@pytest.mark.parametrize("overrides, message", [
    (["stage=rm", "reward.normalize=zscore"], "stage=rm runs no PPO"),
    (["stage=ppo", "reward.normalize=whiten"], "choose one of: none, zscore, running"),
])
def test_normalize_refuses_what_it_cannot_mean(overrides: list[str], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        spec_from_config(compose(overrides))


@pytest.mark.parametrize("framework, mode, tagged", [
    ("dschat", "zscore", True), ("dschat", "running", True), ("dschat", "none", False),
    ("colossalai", "running", True), ("trlx", "running", False), ("trlx", "none", False), ("trlx", "zscore", True),
])
def test_normalizing_beyond_upstream_is_a_tagged_harness_extension(framework: str, mode: str, tagged: bool) -> None:
    from adapters import registry

    spec = spec_from_config(compose([f"framework={framework}", "stage=ppo", f"reward.normalize={mode}"]))
    knobs = [e["knob"] for e in registry.options_class(framework).harness_extensions(spec)]
    assert (f"reward.normalize={mode}" in knobs) == tagged


def test_convergence_is_the_first_window_to_cover_90_percent_of_the_rise() -> None:
    shares = [0.5] * 4 + [0.6, 0.7, 0.8, 0.9] + [0.9] * 4
    # start 0.5, final 0.9, target 0.86; trailing 4-step means from step 3: 0.5, 0.525, 0.575, 0.65, 0.75,
    # 0.825, 0.875 (step 9)
    assert convergence_step(shares, 4) == 9
    assert convergence_step(shares, 4, fraction=0.5) == 7  # target 0.7: 0.75 at step 7
    assert convergence_step([0.6] * 6 + [0.5] * 6, 4) is None  # fell: nothing to converge to
    assert convergence_step(shares[:7], 4) is None  # fewer than two windows
    assert convergence_step([*shares[:-1], None], 4) is None
