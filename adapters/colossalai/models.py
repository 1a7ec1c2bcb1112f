"""ColossalChat's value models (coati/models/reward_model.py, critic.py): a transformer backbone plus a
fresh linear value head, which the reward model re-initialises (normal, std 1 / (hidden + 1)) and the critic keeps
as nn.Linear makes it. The reward model scores a sequence at its last attended token; the critic
gives a value per token."""

from __future__ import annotations

import torch
from torch import nn


class _ValueModel(nn.Module):
    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.model = backbone
        self.config = backbone.config  # shardformer policies read the root module's config
        self.value_head = nn.Linear(backbone.config.hidden_size, 1)  # nn.Linear's own initialisation (critic.py)

    def get_input_embeddings(self) -> nn.Module:  # shardformer's policy reads it from the root module
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> None:  # a value model has no LM head to tie
        return None

    def _hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids)["last_hidden_state"]


class RewardModel(_ValueModel):
    def __init__(self, backbone: nn.Module) -> None:
        super().__init__(backbone)
        # reward_model.py re-initialises its head; critic.py keeps nn.Linear's
        self.value_head.weight.data.normal_(mean=0.0, std=1 / (backbone.config.hidden_size + 1))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self._hidden(input_ids, attention_mask)
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        last = (attention_mask * positions).max(dim=1).values
        picked = hidden[torch.arange(hidden.size(0), device=hidden.device), last]
        return self.value_head(picked.to(self.value_head.weight.dtype)).squeeze(-1)


class Critic(_ValueModel):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token values; `position_ids` those of the actor's forwards (left padding skipped)."""
        hidden = self._hidden(input_ids, attention_mask, position_ids)
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)
