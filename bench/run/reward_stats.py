"""The RM stage's score statistics on held-out pairs, which `reward.normalize=zscore` applies in PPO.

At the end of an RM stage the loop scores STAT_BATCHES held-out preference batches (chosen and rejected
sequences alike) on every data-parallel rank and pools them: their mean and std are the z-score's. A second,
disjoint held-out split is then z-scored with them and its mean and std kept beside (about 0 and 1 where the
statistics carry over to data they were not taken from). The worker writes them next to the stage's
checkpoint file, where the PPO stage that loads that checkpoint (init.rm) finds them.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass

STAT_BATCHES = 8  # held-out preference batches per split and data-parallel rank
STATS_FILE = "reward_statistics.json"


@dataclass(frozen=True)
class Moments:
    """Count, sum and sum of squares: what ranks add together before a mean and std are taken."""

    count: float
    total: float
    squares: float

    @classmethod
    def of(cls, values: list[float]) -> Moments:
        return cls(float(len(values)), float(sum(values)), float(sum(v * v for v in values)))

    @property
    def mean(self) -> float:
        return self.total / self.count

    @property
    def std(self) -> float:
        """The sample standard deviation (n - 1 in the denominator)."""
        if self.count < 2:
            raise ValueError(f"a standard deviation needs 2 or more scores, got {self.count:g}")
        return math.sqrt(max(self.squares - self.count * self.mean ** 2, 0.0) / (self.count - 1))


@dataclass(frozen=True)
class HeldoutStatistics:
    mean: float  # of the RM's end scores on the first held-out split
    std: float
    count: int  # scores pooled over every data-parallel rank
    check_mean: float  # the second split, z-scored with mean and std
    check_std: float
    data: str  # the held-out data, in words

    def zscore(self, score: float) -> float:
        return (score - self.mean) / self.std

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def heldout_statistics(fit: Moments, check: Moments, data: str) -> HeldoutStatistics:
    """The z-score's mean and std from `fit`, and `check` (a second split's raw-score moments) z-scored with
    them: a linear map, so its mean is (mean_check - mean) / std and its std std_check / std."""
    mean, std = fit.mean, fit.std
    if std == 0:
        raise ValueError("the reward model gives every held-out sequence the same score: no z-score exists")
    return HeldoutStatistics(mean=mean, std=std, count=int(fit.count), check_mean=(check.mean - mean) / std,
                             check_std=check.std / std, data=data)


def write_statistics(stats: HeldoutStatistics, checkpoint_file: str) -> None:
    with open(os.path.join(os.path.dirname(checkpoint_file), STATS_FILE), "w") as f:
        json.dump(stats.as_dict(), f, indent=1)


def read_statistics(checkpoint_file: str) -> HeldoutStatistics:
    """The statistics an RM stage wrote beside `checkpoint_file`; a clear error where there are none."""
    path = os.path.join(os.path.dirname(checkpoint_file), STATS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"reward.normalize=zscore needs the RM stage's held-out score statistics ({path}); the reward model "
            f"in {checkpoint_file} was saved without them (an RM stage of an older harness, or a checkpoint made "
            "elsewhere): train it again (delete a cached prerequisite RM) or choose reward.normalize=running|none")
    with open(path) as f:
        return HeldoutStatistics(**json.load(f))
