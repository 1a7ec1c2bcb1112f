"""Trlx's models (trlx/models/modeling_ppo.py, examples/summarize_rlhf/reward_model), re-created.

The PPO policy and critic share one trunk: a causal LM plus an fp32 value head (h -> 2h -> 1). The
reference is either a "hydra" branch -- a frozen copy of only the top `num_layers_unfrozen` blocks,
the final norm and the LM head, fed the shared trunk's hidden state below them -- or the same model
with its peft adapters disabled, or a whole frozen copy (built by the adapter). trlx has branch classes for
GPT-2-style models (GPTModelBranch) and Llama (LlamaModelBranch) among the families here (options.BRANCH_FAMILIES).
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import torch
from torch import nn

from adapters.rl_math import filled_position_ids, position_ids
from bench.run.models import decoder_blocks, final_norm


def make_value_head(hidden: int) -> nn.Module:
    """trlx.utils.modeling.make_head(hidden, 1): created in fp32 whatever the trunk's dtype."""
    return nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.ReLU(), nn.Linear(2 * hidden, 1)).float()


def causal_padding_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive [B, 1, L, L] mask: causal and hiding padded keys (GPT-2 blocks take it as is)."""
    length = attention_mask.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = causal[None, None] & attention_mask[:, None, None, :].bool()
    return torch.zeros(allowed.shape, dtype=dtype, device=attention_mask.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)


class ModelBranch(nn.Module):
    """trlx's GPTModelBranch / LlamaModelBranch: frozen copies of the top blocks, final norm and LM head. A
    Llama-style block takes its rotary position embedding from the caller (transformers >= 4.48 computes it
    once per model): the branch keeps a copy of the trunk's rotary module, as trlx's copied blocks (on
    transformers 4.32) each carried their own."""

    def __init__(self, lm: nn.Module, num_layers: int, gather=None) -> None:
        super().__init__()
        blocks, norm, head = decoder_blocks(lm)[-num_layers:], final_norm(lm), lm.get_output_embeddings()
        with gather(list(blocks.parameters()) + list(norm.parameters())
                    + list(head.parameters())) if gather else nullcontext():
            self.blocks = copy.deepcopy(blocks)
            self.final_norm = copy.deepcopy(norm)
            self.lm_head = copy.deepcopy(head)
        self.rotary = copy.deepcopy(getattr(lm.base_model, "rotary_emb", None))  # GPT-2: none
        for param in self.parameters():
            param.requires_grad_(False)

    def get_output_embeddings(self) -> nn.Module:
        """The branch's LM head, as a transformers model names its own: reference.quant keeps it in the run's
        precision (adapters/quantize.py), as transformers' load_in_8bit keeps every model's lm_head."""
        return self.lm_head

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`positions`: the trunk's position ids (forward_hydra passes them on; GPT-2 added its position table
        below the branch, so its blocks take none)."""
        mask = causal_padding_mask(attention_mask, hidden.dtype)
        kwargs = {} if self.rotary is None else {"position_ids": positions,
                                                 "position_embeddings": self.rotary(hidden, positions)}
        for block in self.blocks:
            hidden = block(hidden, attention_mask=mask, **kwargs)[0]
        return self.lm_head(self.final_norm(hidden))


class PolicyWithValueHead(nn.Module):
    """AutoModelForCausalLMWithHydraValueHead: one trunk, logits and values from one forward."""

    def __init__(self, lm: nn.Module, hidden: int, hydra_layers: int, gather=None) -> None:
        super().__init__()
        self.base_model = lm
        self.v_head = make_value_head(hidden)
        self.hydra_layers = hydra_layers
        self.frozen_head = ModelBranch(self._lm, hydra_layers, gather) if hydra_layers > 0 else None

    @property
    def _lm(self) -> nn.Module:
        """The causal LM under any peft wrapper."""
        return self.base_model.get_base_model() if hasattr(self.base_model, "get_base_model") else self.base_model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, reference: bool = False):
        """(values, the LM's whole output) of the policy; with `reference`, the reference logits. The logits
        are read from the output: returned once, so that accelerate's fp32 conversion copies them once.
        Like trlx's forward it asks for every hidden state and leaves `use_cache` to the model's config, so
        the output also holds the KV cache of every layer. Both go through forward so that engines (DDP,
        ZeRO-3 gathering, autocast) see every call."""
        if reference:
            return self._reference_logits(input_ids, attention_mask)
        out = self.base_model(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=filled_position_ids(attention_mask), output_hidden_states=True)
        values = self.v_head(out.hidden_states[-1].to(self.v_head[0].weight.dtype)).squeeze(-1)
        return values, out

    @torch.no_grad()
    def _reference_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """forward_hydra: the trunk's hidden state below the branch through the frozen branch, or, with
        peft, the model with its adapters disabled."""
        if self.frozen_head is None:
            with self.base_model.disable_adapter():
                return self.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                       position_ids=filled_position_ids(attention_mask)).logits
        _, out = self.forward(input_ids, attention_mask)
        return self.frozen_head(out.hidden_states[-(self.hydra_layers + 1)], attention_mask,
                                filled_position_ids(attention_mask))


def freeze_bottom_layers(lm: nn.Module, num_layers_unfrozen: int) -> None:
    """trlx's freeze_bottom_causal_layers: the input embeddings (and the LM head tied to them; an untied head
    keeps training) and all blocks below the top `num_layers_unfrozen` stop training; -1 keeps everything
    trainable. The position table is not an input embedding to it, so it keeps training, as upstream."""
    if num_layers_unfrozen < 0:
        return
    blocks = decoder_blocks(lm)
    frozen = [lm.get_input_embeddings(), *blocks[: len(blocks) - num_layers_unfrozen]]
    for module in frozen:
        for param in module.parameters():
            param.requires_grad_(False)


def freeze_reward_backbone(model: nn.Module, unfrozen_fraction: float | None) -> None:
    """train_reward_model_gptj.py: "Freeze the first 70% of the hidden layers of the reward model
    backbone" -- blocks[:-int(0.3 * layers)]. Its slice freezes nothing when int(...) is 0 (fewer than
    four layers), and that quirk is kept."""
    if unfrozen_fraction is None:
        return
    blocks = decoder_blocks(model.transformer)
    unfrozen = int(unfrozen_fraction * len(blocks))
    for block in blocks[:-unfrozen]:
        block.requires_grad_(False)


class GPTRewardModel(nn.Module):
    """examples/summarize_rlhf/reward_model/reward_model.py: transformer + bias-free v_head; pairwise loss
    per token from the first token where chosen and rejected differ to the longer one's end."""

    def __init__(self, backbone: nn.Module, hidden: int) -> None:
        super().__init__()
        self.transformer = backbone
        self.v_head = nn.Linear(hidden, 1, bias=False)

    def token_rewards(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.transformer(input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids(attention_mask), use_cache=False).last_hidden_state
        return self.v_head(hidden).squeeze(-1).float()

    def end_scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        rewards = self.token_rewards(input_ids, attention_mask)
        last = (attention_mask * torch.arange(input_ids.shape[1], device=input_ids.device)).argmax(1)
        return rewards.gather(1, last[:, None]).squeeze(1)

    def forward(self, chosen_ids, chosen_mask, rejected_ids, rejected_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairwise loss; returns (loss, per-pair correctness of the end scores)."""
        n = chosen_ids.shape[0]
        rewards = self.token_rewards(torch.cat([chosen_ids, rejected_ids]), torch.cat([chosen_mask, rejected_mask]))
        chosen_r, rejected_r = rewards[:n], rewards[n:]
        losses, correct = [], []
        for i in range(n):
            c_end, r_end = int(chosen_mask[i].sum()), int(rejected_mask[i].sum())
            differ = (chosen_ids[i] != rejected_ids[i]).nonzero()
            start = int(differ[0]) if len(differ) else min(c_end, r_end) - 1
            end = max(c_end, r_end)
            losses.append(-nn.functional.logsigmoid(chosen_r[i, start:end] - rejected_r[i, start:end]).mean())
            correct.append(chosen_r[i, c_end - 1] > rejected_r[i, r_end - 1])
        return torch.stack(losses).mean(), torch.stack(correct).float()
