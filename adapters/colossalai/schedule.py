"""ColossalChat's learning-rate schedule: colossalai's `CosineAnnealingWarmupLR(total_steps, warmup_steps,
eta_min=0.1 * lr)`, boosted with its optimizer and stepped right after it (train_sft.py, train_rm.py,
train_ppo.py; coati's trainers call `scheduler.step()` after every optimizer step, skipped or not).

SFT and RM span their optimizer steps. PPO's total is `num_episodes`, which train_ppo.sh makes its optimizer
steps (a buffer of 2 x 4 samples, train_batch_size 4, accumulation_steps 2: one optimizer step per episode);
here the PPO stage's optimizer steps, so the cosine ends with the run at any grad_accum. Without
`--warmup_steps` every script warms up over int(0.025 x its total) steps, as `warmup_steps: null` does here.

The schedule is applied in its closed form (`cosine_warmup_factor`): the class as installed departs from it
(UPSTREAM_DEFECT). Its cosine stage is torch's chainable CosineAnnealingLR, which colossalai's WarmupScheduler
asks for a rate outside torch's own initial step; torch 2.13 tells that step by a flag (`_is_initial`), no longer
by `last_epoch == 0`, so the first cosine rate is scaled by 2 / (1 + cos(pi / T)) and every later one follows
from it: 1.15 x the base rate at step 0 of a 4-step run without warm-up. (colossalai 0.5.0 asks for torch <=
2.5.1; the harness runs it beside torch 2.13, as scripts/setup.sh says.)
"""

from __future__ import annotations

import math

import torch

WARMUP_SHARE = 0.025  # train_sft.py / train_rm.py / train_ppo.py when --warmup_steps is not given
ETA_MIN_SHARE = 0.1  # eta_min=0.1 * args.lr: the actor's rate, for the critic's schedule too (train_ppo.py)

UPSTREAM_DEFECT = {
    "id": "colossalai-0.5.0-cosine-warmup-lr-torch-2.13",
    "where": "colossalai/nn/lr_scheduler/delayed.py WarmupScheduler.get_lr, calling torch's chainable "
             "CosineAnnealingLR.get_lr outside that scheduler's initial step",
    "effect": "the cosine stage starts above the base rate (x 2 / (1 + cos(pi / T)), T its length) and never "
              "follows the cosine: 1.15 x lr at step 0 of 4 without warm-up, 1.3 x lr at step 1 of 4 after 1",
    "handling": "the adapter applies the schedule CosineAnnealingWarmupLR's docstring states, in closed form "
                "(linear warm-up, cosine to 0.1 x lr)",
}


def warmup_steps(configured: int | None, total: int) -> int:
    return configured if configured is not None else int(WARMUP_SHARE * total)


def floor_share(lr: float, scripts_lr: float) -> float:
    """eta_min over the optimizer's own base rate. Every script sets eta_min = 0.1 x args.lr, the rate of its
    main model: train_ppo.py gives the critic's scheduler (base rate --critic_lr) the actor's floor too."""
    return ETA_MIN_SHARE * scripts_lr / lr


def cosine_warmup_factor(step: int, warmup: int, total: int, floor: float = ETA_MIN_SHARE) -> float:
    """The rate at optimizer step `step` (0-based) over the base rate: (step + 1) / warmup during the warm-up,
    then a cosine from 1 at `warmup` to `floor` (eta_min over the base rate) at `total` (and back up after it, as
    torch's cosine)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2


def build_scheduler(optimizer: torch.optim.Optimizer, warmup: int, total: int, floor: float = ETA_MIN_SHARE
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: cosine_warmup_factor(step, warmup, total, floor))
