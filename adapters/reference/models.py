"""The reference's value model: a transformer backbone and a linear head giving one value per token. The
reward model and the critic are both this model; the reward of a sequence is its value at the last attended
token (`end_scores`)."""

from __future__ import annotations

import torch
from torch import nn


class ValueModel(nn.Module):
    """Called through forward only: DDP's gradient hooks and FSDP2's gathers hang on the module's call."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.model = backbone
        self.value_head = nn.Linear(backbone.config.hidden_size, 1, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T]: one value per token."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1)


def end_scores(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B]: each sequence's value at its last attended token."""
    positions = torch.arange(values.shape[1], device=values.device)
    last = (attention_mask * positions).max(dim=1).values
    return values[torch.arange(values.shape[0], device=values.device), last]


def pairwise_loss(chosen_ids: torch.Tensor, rejected_ids: torch.Tensor, chosen_values: torch.Tensor,
                  rejected_values: torch.Tensor, chosen_mask: torch.Tensor, rejected_mask: torch.Tensor
                  ) -> torch.Tensor:
    """-log sigmoid(v_chosen - v_rejected) on every token from the first one where the pair differs to the
    later of the two ends (right-padded pairs), averaged per pair, then over pairs: DS-Chat's RM loss, which
    teaches the model to score any prefix, as PPO then asks of it for rollouts cut off before their stop."""
    width = chosen_ids.shape[1]
    positions = torch.arange(width, device=chosen_ids.device)[None, :]
    differs = chosen_ids != rejected_ids
    start = torch.where(differs.any(1), differs.float().argmax(1), chosen_mask.sum(1) - 1)
    end = torch.maximum(chosen_mask.sum(1), rejected_mask.sum(1))
    span = ((positions >= start[:, None]) & (positions < end[:, None])).to(chosen_values.dtype)
    per_token = -torch.nn.functional.logsigmoid(chosen_values - rejected_values)
    return ((per_token * span).sum(1) / span.sum(1).clamp(min=1)).mean()
