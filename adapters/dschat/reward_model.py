"""DeepSpeed-Chat's RewardModel (dschat/utils/model/reward_model.py): a base transformer plus
`v_head = Linear(h, 1, bias=False)`. It serves as the step-2 reward model and, in step 3, as both the
critic (trained) and the reward (frozen), each initialised from the step-2 checkpoint."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from adapters.rl_math import position_ids
from bench.run.data import EOS, PAD


def end_index(input_ids: torch.Tensor, prompt_length: int = 0, pad_is_eos: bool = True) -> torch.Tensor:
    """Per row, the index of the first pad at or after `prompt_length` (the sequence's width if none), as
    RewardModel.forward / forward_value find it (`input_id[prompt_length:] == self.PAD_ID`). Where DS-Chat's pad
    id is its EOS id (`pad_is_eos`: every tokenizer but Llama's), the first EOS counts as that pad and the score is
    read one token before it; with Llama's own [PAD] it is read at the EOS."""
    tail = input_ids[:, prompt_length:] == PAD
    if pad_is_eos:
        tail = tail | (input_ids[:, prompt_length:] == EOS)
    found = tail.any(1)
    return torch.where(found, tail.long().argmax(1) + prompt_length, torch.full_like(found, input_ids.shape[1],
                                                                                     dtype=torch.long))


class RewardModel(nn.Module):
    def __init__(self, base: nn.Module, hidden: int, compute_fp32_loss: bool = False, pad_is_eos: bool = True) -> None:
        super().__init__()
        self.config = base.config
        self.compute_fp32_loss = compute_fp32_loss
        self.pad_is_eos = pad_is_eos  # the tokenizer's pad id is its EOS (options.pad_is_eos)
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
        losses, chosen_end, rejected_end = [], [], []
        c_ends, r_ends = end_index(chosen_ids, 0, self.pad_is_eos), end_index(rejected_ids, 0, self.pad_is_eos)
        for i in range(pairs):
            c_ind, r_ind = int(c_ends[i]), int(r_ends[i])
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

    def forward_value(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      prompt_length: int | None = None) -> dict[str, torch.Tensor]:
        """Per-token values and, given `prompt_length`, per row the value one token before the first pad (EOS)
        after the prompt; without it the values only (the critic's `return_value_only=True`)."""
        values = self.values(input_ids, attention_mask)
        if prompt_length is None:
            return {"values": values}
        ends = end_index(input_ids, prompt_length, self.pad_is_eos)
        return {"values": values, "chosen_end_scores": values.gather(1, (ends - 1)[:, None]).squeeze(1)}
