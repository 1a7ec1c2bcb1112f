"""What the engines did in a PPO run of each re-creation: the learning rate read back from the optimizers at
every step and the optimizer steps the optimizers themselves counted, against upstream's schedules and
buffer sizes worked by hand (tiny model, 4 steps, batch 4, grad_accum 1)."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.engine


def _cosine(t: float, total: float, floor: float = 0.0) -> float:
    return floor + (1 - floor) * (1 + math.cos(math.pi * t / total)) / 2


# per framework: the rate at each step's start over the base rate, the optimizer steps per step
EXPECTED = {
    # transformers' cosine, round(4 x 100 / 477) = 1 warm-up step of 4 (the rate at step 0 is 0)
    "dschat": ([0.0, 1.0, _cosine(1, 3), _cosine(2, 3)], 1),
    # 2 rollouts x 4 samples in minibatches of 4: 2 optimizer steps per episode, 8 in all, int(0.025 x 8) = 0
    # warm-up; each step starts at optimizer step 0, 2, 4, 6 of a cosine to 0.1 x lr
    "colossalai": ([_cosine(t, 8, 0.1) for t in (0, 2, 4, 6)], 2),
    # constant (eta_min = lr); 4 x 4 rollouts in minibatches of 4, 4 epochs: 16 optimizer steps
    "trlx": ([1.0] * 4, 16),
}


@pytest.mark.parametrize("framework", sorted(EXPECTED))
def test_the_engines_apply_upstream_s_schedule_and_step_count(run_bench, framework):
    record = run_bench(f"framework={framework}", "stage=ppo", "steps=4", "warmup_steps=1", "batch=4")
    assert record["status"] == "ok", record["error"]
    ppo = record["stages"]["ppo"]
    factors, per_step = EXPECTED[framework]
    lrs = record["config"]["model"]["lr"]
    roles = ("actor",) if framework == "trlx" else ("actor", "critic")
    for role in roles:
        read = [step[f"lr/{role}"] for step in ppo["steps"]]
        assert read == pytest.approx([f * lrs[role] for f in factors], rel=1e-6, abs=1e-12), role
    assert [step["optimizer_steps/actor"] for step in ppo["steps"]] == [per_step] * 4
    # the optimizers' own count: DeepSpeed's global_steps counts every step; a torch optimizer's `step` state only
    # those an fp16 overflow did not skip (coati's default precision is fp16), while coati's schedule moves anyway
    skipped = sum(step["skipped_steps/actor"] for step in ppo["steps"]) if framework == "colossalai" else 0
    assert ppo["engine_knobs"]["accumulation"]["optimizer_steps"]["actor"] == 4 * per_step - skipped
