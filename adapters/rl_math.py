"""PPO arithmetic shared by the adapters (torch only): log-probs, masked means, GAE, clipped losses."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label token, in the logits' dtype as all three frameworks compute it (a
    caller that upcasts does so where its framework does, e.g. DS-Chat's --compute_fp32_loss)."""
    log_probs = F.log_softmax(logits, dim=-1)
    return log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, matching what HF generate uses for left-padded prompts."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp(min=0)


def filled_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions as trlx's make_experience and loss compute them (and HF generate for GPT-2): the real tokens
    counted from 0, every masked token at position 1."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)


def kl_penalised_rewards(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, score: torch.Tensor, start: int,
                         action_mask: torch.Tensor, kl_coef: float, clip: float, one_past: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """DS-Chat's DeepSpeedPPOTrainer.compute_rewards (the plain-PyTorch reference uses the same): -kl_coef *
    (logp - logp_ref) per action, plus the reward model's score clipped to +-clip on each row's EOS action.
    Returns (rewards, ends), `ends` the index one past that action.

    `one_past` (DS-Chat's `ends = start + mask.sum + 1`): where its pad id is the EOS id the mask drops the EOS
    action and the score lands on it (on the last action where a row has no EOS); where the tokenizer has a pad of
    its own (DS-Chat's Llama tokenizers) the mask keeps the EOS action and the score lands one past it, on the
    first pad action. Without (the reference keeps the ids apart) the EOS action is the last unmasked one."""
    rewards = -kl_coef * (log_probs - ref_log_probs)
    # a row that never emitted EOS ends at the last action (upstream's slice `rewards[j, start:ends[j]]` stops there)
    ends = (start + action_mask[:, start:].sum(1) + int(one_past)).clamp(max=rewards.shape[1])
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, ends - 1] += score.clamp(-clip, clip)  # one position per row: same as upstream's per-row loop
    return rewards, ends


def gae(values: torch.Tensor, rewards: torch.Tensor, start: int, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over positions >= start; returns (advantages, returns)."""
    last = torch.zeros_like(values[:, 0])
    reversed_adv = []
    length = rewards.shape[-1]
    for t in reversed(range(start, length)):
        next_values = values[:, t + 1] if t < length - 1 else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last = delta + gamma * lam * last
        reversed_adv.append(last)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    return advantages.detach(), (advantages + values[:, start:]).detach()


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, cliprange: float) -> torch.Tensor:
    ratio = torch.exp((log_probs - old_log_probs) * mask)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    return masked_mean(torch.max(loss1, loss2), mask)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float) -> torch.Tensor:
    clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    loss = torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * masked_mean(loss, mask)
