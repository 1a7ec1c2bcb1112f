"""Trlx's learning-rate schedules.

SFT and PPO: `setup_scheduler` builds `get_scheduler_class(config.scheduler.name)(opt, **kwargs)` and prepares it
with the accelerator; `learn` steps it after every `opt.step()`. Every default config and the HH example use
`cosine_annealing` (torch's CosineAnnealingLR) with `eta_min` equal to the learning rate (default_ppo_config:
T_max 1e12, default_sft_config the same, ppo_hh.py T_max 10000): a constant rate, whatever T_max says.
RM: the example trains with HF's Trainer, whose default schedule is linear decay to 0 after `warmup_steps` (100
in train_reward_model_gptj.py, more than this stage's steps: `rm_warmup_steps` defaults to 0, a declared
deviation).
"""

from __future__ import annotations

from typing import Any

import torch


def build_scheduler(stage: str, optimizer: torch.optim.Optimizer, lr: float, t_max: float, eta_min: float | None,
                    rm_warmup: int, total: int) -> Any:
    if stage == "rm":
        from transformers import get_scheduler

        return get_scheduler("linear", optimizer, num_warmup_steps=rm_warmup, num_training_steps=total)
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=t_max, eta_min=lr if eta_min is None
                                                      else eta_min)
