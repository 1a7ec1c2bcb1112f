"""DS-Chat's learning-rate schedule: transformers' `get_scheduler(--lr_scheduler_type, optimizer,
--num_warmup_steps, num_training_steps)`, handed to `deepspeed.initialize`, which steps it after every optimizer
step (step-1/2 main.py; rlhf_engine.py `_init_actor` / `_init_critic` for the actor and the critic).

Every upstream script passes `--lr_scheduler_type cosine`; steps 1 and 2 pass `--num_warmup_steps 0`, the step-3
scripts 100. The training length is the stage's optimizer steps (step 3: `num_total_iters`, prompt batches x
ppo_epochs / GAS; here steps x ppo_epochs). A run of 10 PPO steps cannot warm up over 100, so the step-3
default keeps upstream's share instead: 100 of the 477 steps of its published OPT-1.3b step-3 log
(training_log_output/actor_opt-1.3b_critic_opt-350m_globalBatchSize64.log).
"""

from __future__ import annotations

from typing import Any

import torch

#: --num_warmup_steps 100 over the 477 optimizer steps of upstream's published step-3 run
STEP3_WARMUP_SHARE = 100 / 477


def warmup_steps(stage: str, configured: int | None, total: int) -> int:
    """The stage's warm-up steps: `configured` where set; else steps 1/2's 0, step 3's share of `total`."""
    if configured is not None:
        return configured
    return round(STEP3_WARMUP_SHARE * total) if stage == "ppo" else 0


def build_scheduler(optimizer: torch.optim.Optimizer, kind: str, warmup: int, total: int) -> Any:
    from transformers import get_scheduler

    return get_scheduler(name=kind, optimizer=optimizer, num_warmup_steps=warmup, num_training_steps=total)
