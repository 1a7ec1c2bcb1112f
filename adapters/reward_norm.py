"""reward.normalize: what PPO does to the reward model's score before each framework's own clipping.

Upstream, only trlx scales scores (scale_reward: "running" divides the clipped scores by the running std of
every score seen, "ref" by the first rollout's std, "ignored" leaves them; the mean is never subtracted);
DS-Chat and ColossalChat take the RM's score as it is. The common key turns the same three choices in every
adapter: none, running (trlx's algorithm; elsewhere a harness extension, its moments pooled over the ranks,
as trlx pools by scoring every rank's samples on rank 0) and zscore (a harness extension everywhere: minus
the mean, over the std of the RM stage's scores on held-out pairs, bench.run.reward_stats).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from bench.run.reward_stats import HeldoutStatistics, read_statistics
from bench.run.spec import RunSpec


class RunningMoments:
    """trlx's RunningMoments: running mean and std of every score seen (Chan's parallel update)."""

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.var = 1.0
        self.first_std: float | None = None

    def update(self, x: torch.Tensor) -> None:
        n, mean, var = x.numel(), float(x.mean()), float(x.var(unbiased=False)) if x.numel() > 1 else 0.0
        if self.first_std is None:
            self.first_std = max(float(x.std()) if n > 1 else 1.0, 1e-8)
        total = self.count + n
        delta = mean - self.mean
        m2 = self.var * self.count + var * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        self.count = total

    @property
    def std(self) -> float:
        return max((self.var * self.count / max(self.count - 1, 1)) ** 0.5, 1e-8)


def _all_ranks(scores: torch.Tensor) -> torch.Tensor:
    """Every rank's scores, concatenated (ranks score batches of one size)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return scores
    gathered = [torch.empty_like(scores) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, scores.contiguous())
    return torch.cat(gathered)


@dataclass
class RewardScaling:
    """The normalization one adapter applies to the RM's scores in make_experience."""

    mode: str  # none | zscore | running
    statistics: HeldoutStatistics | None = None  # zscore's
    moments: RunningMoments = field(default_factory=RunningMoments)  # running's

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        """This rank's scores, normalized (collective under `running`: every rank calls it each step)."""
        if self.mode == "zscore":
            return (scores - self.statistics.mean) / self.statistics.std
        if self.mode == "running":
            self.moments.update(_all_ranks(scores.float()))
            return scores / self.moments.std
        return scores

    def knob(self) -> dict[str, object]:
        """What the record's engine_knobs keeps: the mode, and the statistics it applies."""
        knob: dict[str, object] = {"mode": self.mode}
        if self.statistics is not None:
            knob.update(mean=self.statistics.mean, std=self.statistics.std, count=self.statistics.count,
                        check_mean=self.statistics.check_mean, check_std=self.statistics.check_std)
        return knob


def reward_scaling(spec: RunSpec, init: dict[str, str], upstream: str = "none") -> RewardScaling:
    """`reward.normalize`, or the framework's `upstream` mode where it is null; zscore reads the statistics
    the RM stage wrote beside init.rm."""
    mode = spec.reward.normalize or upstream
    if mode != "zscore":
        return RewardScaling(mode)
    if not init.get("rm"):
        raise FileNotFoundError("reward.normalize=zscore needs a trained reward model (init.rm, or the "
                                "prerequisite RM stage=ppo trains): its held-out scores give the statistics")
    return RewardScaling(mode, statistics=read_statistics(init["rm"]))
