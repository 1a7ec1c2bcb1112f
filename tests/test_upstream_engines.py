"""What the engines did in a PPO run of each re-creation: the learning rate read back from the optimizers at
every step and the optimizer steps the optimizers themselves counted, against upstream's schedules and
buffer sizes worked by hand (tiny model, 4 steps, batch 4, grad_accum 1)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.engine


def _cosine(t: float, total: float, floor: float = 0.0) -> float:
    return floor + (1 - floor) * (1 + math.cos(math.pi * t / total)) / 2


# per framework: the rate at each step's start over the role's base rate (given the roles' rates), the optimizer
# steps per step
EXPECTED = {
    # transformers' cosine, round(4 x 100 / 477) = 1 warm-up step of 4 (the rate at step 0 is 0)
    "dschat": (lambda lrs, role: [0.0, 1.0, _cosine(1, 3), _cosine(2, 3)], 1),
    # 2 rollouts x 4 samples in minibatches of 4: 2 optimizer steps per episode, 8 in all, int(0.025 x 8) = 0
    # warm-up; each step starts at optimizer step 0, 2, 4, 6 of a cosine to eta_min = 0.1 x the actor's lr, the
    # critic's too (train_ppo.py: eta_min=0.1 * args.lr for both schedulers)
    "colossalai": (lambda lrs, role: [_cosine(t, 8, 0.1 * lrs["actor"] / lrs[role]) for t in (0, 2, 4, 6)], 2),
    # constant (eta_min = lr); 4 x 4 rollouts in minibatches of 4, 4 epochs: 16 optimizer steps
    "trlx": (lambda lrs, role: [1.0] * 4, 16),
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
        assert read == pytest.approx([f * lrs[role] for f in factors(lrs, role)], rel=1e-6, abs=1e-12), role
    assert [step["optimizer_steps/actor"] for step in ppo["steps"]] == [per_step] * 4
    # the passes over each step's rollouts the record states: trlx's ppo_epochs 4, DS-Chat's 1, coati's
    # num_update_steps 1 (train_ppo.sh)
    assert ppo["update_passes"] == {"dschat": 1, "colossalai": 1, "trlx": 4}[framework]
    # the optimizers' own count: DeepSpeed's global_steps counts every step; a torch optimizer's `step` state only
    # those an fp16 overflow did not skip (coati's default precision is fp16), while coati's schedule moves anyway
    skipped = sum(step["skipped_steps/actor"] for step in ppo["steps"]) if framework == "colossalai" else 0
    assert ppo["engine_knobs"]["accumulation"]["optimizer_steps"]["actor"] == 4 * per_step - skipped


CRITIC_PROBE = r"""
import json, os, socket
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(port))
import torch
from adapters import registry
from adapters.base import RankContext
from bench.run.config import compose
from bench.run.data import SyntheticData
from bench.run.spec import spec_from_config
spec = spec_from_config(compose(["framework=colossalai", "stage=ppo", "batch=4", "init.sft_prerequisite=false"]))
adapter = registry.adapter_class("colossalai")(spec, RankContext(0, 1, 0, torch.device("cpu")))
adapter.setup("ppo", {})
adapter.set_reward_scaling({})
seen = []
adapter.models["critic"].register_forward_pre_hook(lambda module, args: seen.append([a.tolist() for a in args]))
data = SyntheticData(spec.model.vocab, spec.prompt_len, spec.answer_len, spec.batch, spec.seed, 0)
adapter.make_experience(adapter.generate(data.prompts(0)))
print("PROBE" + json.dumps(seen[0]))
"""


def test_coati_s_booster_wrapped_critic_sees_positions_that_skip_left_padding():
    """The critic as the adapter built it on the colossalai Booster, called by its own make_experience on a
    left-padded rollout (a forward pre-hook reads its inputs): at every real token the position is the count of
    real tokens before it in the row, as the actor's forwards number them."""
    proc = subprocess.run([sys.executable, "-c", CRITIC_PROBE], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE")]
    assert lines, proc.stderr[-3000:]
    _, mask, positions = json.loads(lines[0][len("PROBE"):])
    left_pads = [row.index(1) for row in mask]
    assert len(set(left_pads)) > 1 and max(left_pads) > 0, left_pads  # rows padded on the left by different widths
    for row_mask, row_positions in zip(mask, positions, strict=True):
        real_before = 0
        for real, position in zip(row_mask, row_positions, strict=True):
            if real:
                assert position == real_before, (row_mask, row_positions)
                real_before += 1
