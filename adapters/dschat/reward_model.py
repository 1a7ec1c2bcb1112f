"""DeepSpeed-Chat's RewardModel (dschat/utils/model/reward_model.py): a base transformer plus
`v_head = Linear(h, 1, bias=False)`. It serves as the step-2 reward model and, in step 3, as both the
critic (trained) and the reward (frozen), each initialised from the step-2 checkpoint."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from adapters.rl_math import position_ids
from bench.run.data import PAD


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of each row's last real token (sequences may be left- and right-padded)."""
    width = attention_mask.shape[1]
    return width - 1 - attention_mask.flip(1).long().argmax(1)


class RewardModel(nn.Module):
    def __init__(self, base: nn.Module, hidden: int, compute_fp32_loss: bool = False) -> None:
        super().__init__()
        self.config = base.config
        self.compute_fp32_loss = compute_fp32_loss
        self.rwtransformer = base
        self.v_head = nn.Linear(hidden, 1, bias=False)

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.rwtransformer.gradient_checkpointing_enable(**kwargs)

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.rwtransformer(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
            use_cache=False,
        ).last_hidden_state
        return self.v_head(hidden).squeeze(-1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Pairwise loss over a batch of [chosen; rejected]: -log sigmoid(r_c - r_r) on every token from
        the first divergent token to the later of the two ends, averaged per pair, as DS-Chat does; in the
        model's dtype unless compute_fp32_loss."""
        values = self.values(input_ids, attention_mask)
        if self.compute_fp32_loss:
            values = values.float()
        pairs = input_ids.shape[0] // 2
        chosen_ids, rejected_ids = input_ids[:pairs], input_ids[pairs:]
        chosen_v, rejected_v = values[:pairs], values[pairs:]
        width = input_ids.shape[1]
        losses, chosen_end, rejected_end = [], [], []
        for i in range(pairs):
            c_pad = (chosen_ids[i] == PAD).nonzero()
            r_pad = (rejected_ids[i] == PAD).nonzero()
            c_ind = int(c_pad[0]) if len(c_pad) else width
            r_ind = int(r_pad[0]) if len(r_pad) else width
            diverged = (chosen_ids[i] != rejected_ids[i]).nonzero()
            if len(diverged) == 0:
                end, start = c_ind, c_ind - 1
            else:
                end, start = max(c_ind, r_ind), int(diverged[0])
            losses.append(-F.logsigmoid(chosen_v[i, start:end] - rejected_v[i, start:end]).mean())
            chosen_end.append(chosen_v[i, c_ind - 1])
            rejected_end.append(rejected_v[i, r_ind - 1])
        return {
            "loss": torch.stack(losses).mean(),
            "chosen_end_scores": torch.stack(chosen_end),
            "rejected_end_scores": torch.stack(rejected_end),
        }

    def forward_value(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        values = self.values(input_ids, attention_mask)
        ends = last_token_index(attention_mask)
        return {"values": values, "chosen_end_scores": values.gather(1, ends[:, None]).squeeze(1)}
