"""Shared PPO arithmetic, on values worked by hand."""

from __future__ import annotations

import torch

from adapters.rl_math import kl_penalised_rewards


def test_the_kl_penalty_per_action_and_the_clipped_score_on_each_row_s_last_answer_action():
    # 2 rows, 5 actions, the answer starts at action 2; row 0 answers 3 actions (2, 3, 4), row 1 two (2, 3)
    log_probs = torch.tensor([[0.0, 0.0, -1.0, -2.0, -1.0], [0.0, 0.0, -0.5, -0.5, 0.0]])
    ref_log_probs = torch.tensor([[0.0, 0.0, -1.5, -1.0, -1.0], [0.0, 0.0, -0.5, -1.5, 0.0]])
    action_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    score = torch.tensor([3.0, -7.0])
    rewards, ends = kl_penalised_rewards(log_probs, ref_log_probs, score, 2, action_mask, kl_coef=0.1, clip=5.0)
    assert ends.tolist() == [5, 4]
    # -0.1 x (logp - ref): row 0 at actions 2, 3: -0.05, +0.1; the score 3 (inside the clip) on action 4;
    # row 1 at action 3: -0.1, plus the score clipped to -5
    expected = torch.tensor([[0.0, 0.0, -0.05, 0.1, 3.0], [0.0, 0.0, 0.0, -5.1, 0.0]])
    assert torch.allclose(rewards, expected)
