"""Each framework's learning-rate schedule as its adapter builds it, read back from the optimizer at the first
step, the warm-up's end and the last step, against values worked by hand from upstream's formulas."""

from __future__ import annotations

import math

import pytest
import torch

from adapters.colossalai import schedule as coati
from adapters.dschat import schedule as dschat
from adapters.trlx import schedule as trlx


def _rates(scheduler_of, steps: int, lr: float = 1.0) -> list[float]:
    """The rate each of `steps` optimizer steps applies: read before the step, the scheduler stepped after it."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = scheduler_of(optimizer)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_dschat_step3_warms_up_over_upstream_share_then_follows_the_cosine():
    # 100 warm-up steps of 477 in upstream's published step-3 run: 10 steps warm up over round(2.096) = 2
    warmup = dschat.warmup_steps("ppo", None, 10)
    assert warmup == 2
    rates = _rates(lambda opt: dschat.build_scheduler(opt, "cosine", warmup, 10), 10)
    assert rates[0] == 0.0  # transformers' warm-up starts at 0: the first step does not move the weights
    assert rates[1] == pytest.approx(0.5)
    assert rates[2] == pytest.approx(1.0)  # warm-up's end
    assert rates[9] == pytest.approx(0.5 * (1 + math.cos(math.pi * 7 / 8)))  # 0.0380602
    assert rates[9] == pytest.approx(0.0380602, abs=1e-7)


def test_dschat_steps_1_and_2_start_at_the_full_rate_and_a_set_warmup_wins():
    assert dschat.warmup_steps("sft", None, 20) == 0 and dschat.warmup_steps("rm", None, 30) == 0
    assert dschat.warmup_steps("ppo", 5, 10) == 5
    rates = _rates(lambda opt: dschat.build_scheduler(opt, "cosine", 0, 20), 20)
    assert rates[0] == 1.0
    assert rates[10] == pytest.approx(0.5)  # half way: (1 + cos(pi / 2)) / 2
    assert rates[19] == pytest.approx(0.5 * (1 + math.cos(math.pi * 19 / 20)))  # 0.0061558


def test_coati_warms_up_linearly_then_anneals_to_a_tenth_of_the_rate():
    assert coati.warmup_steps(None, 40) == 1 and coati.warmup_steps(None, 10) == 0  # int(0.025 x steps)
    rates = _rates(lambda opt: coati.build_scheduler(opt, 4, 10), 10)
    assert rates[0] == pytest.approx(0.25)  # (step + 1) / warmup
    assert rates[3] == pytest.approx(1.0)  # the warm-up's last step
    assert rates[4] == pytest.approx(1.0)  # the cosine's first
    # step 9: 5 of 6 cosine steps: 0.1 + 0.9 x (1 + cos(5 pi / 6)) / 2 = 0.1 + 0.9 x 0.0669873
    assert rates[9] == pytest.approx(0.1602886, abs=1e-7)


def test_coati_s_critic_anneals_to_a_tenth_of_the_actor_s_rate():
    """train_ppo.py: both schedulers take eta_min = 0.1 x args.lr (the actor's); a critic at half the actor's
    rate anneals to 0.2 of its own: at the cosine's end (step 4 of 4 without warm-up) 0.1 x 2 / 1 = 0.2."""
    assert coati.floor_share(lr=1e-3, scripts_lr=2e-3) == pytest.approx(0.2)
    rates = _rates(lambda opt: coati.build_scheduler(opt, 0, 4, coati.floor_share(1e-3, 2e-3)), 5)
    # 0.2 + 0.8 x (1 + cos(pi t / 4)) / 2 for t = 0..4
    assert rates == pytest.approx([1.0, 0.8828427, 0.6, 0.3171573, 0.2], abs=1e-7)


def test_coati_without_warmup_starts_at_the_full_rate():
    rates = _rates(lambda opt: coati.build_scheduler(opt, 0, 4), 4)
    # 0.1 + 0.9 x (1 + cos(pi t / 4)) / 2 for t = 0..3
    assert rates == pytest.approx([1.0, 0.8681981, 0.55, 0.2318019], abs=1e-7)


def test_the_installed_coati_scheduler_departs_from_its_cosine_the_declared_defect():
    """colossalai 0.5.0's CosineAnnealingWarmupLR under this torch: the first cosine rate is the chainable
    formula's ratio (1 + cos 0) / (1 + cos(-pi / 4)) applied to the rate's distance from eta_min. If this fails,
    colossalai or torch changed: revisit schedule.UPSTREAM_DEFECT and the closed form the adapter applies."""
    from colossalai.nn.lr_scheduler import CosineAnnealingWarmupLR

    rates = _rates(lambda opt: CosineAnnealingWarmupLR(opt, total_steps=4, warmup_steps=0, eta_min=0.1), 4)
    assert rates[0] == pytest.approx(0.1 + 0.9 * 2 / (1 + math.cos(math.pi / 4)))  # 1.1544156, above the base rate
    assert rates[0] == pytest.approx(1.1544156, abs=1e-7)


def test_trlx_ppo_and_sft_rate_is_constant_as_its_configs_set_eta_min_to_it():
    rates = _rates(lambda opt: trlx.build_scheduler("ppo", opt, 3e-5, 1e12, None, 0, 10), 10, lr=3e-5)
    assert rates == [3e-5] * 10
    # the HH example: T_max 10000, eta_min 8e-6 = lr
    rates = _rates(lambda opt: trlx.build_scheduler("sft", opt, 8e-6, 10000, None, 0, 10), 10, lr=8e-6)
    assert rates == pytest.approx([8e-6] * 10)


def test_trlx_rm_decays_linearly_to_zero_as_hf_trainer_does():
    rates = _rates(lambda opt: trlx.build_scheduler("rm", opt, 1.0, 1e12, None, 0, 30), 30)
    assert rates[0] == 1.0
    assert rates[15] == pytest.approx(0.5)
    assert rates[29] == pytest.approx(1 / 30)
