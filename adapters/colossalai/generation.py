"""ColossalChat's rollout sampler (coati/models/generation.py `_sample`), re-created.

Left-padded prompts, one token per step with the KV cache, temperature then top-k, multinomial
sampling; finished rows emit padding; every step all-reduces the unfinished flags so all ranks stop
together (the PR #3162 hang fix); a row still running at the last step ends there, without a stop token
(ColossalAI 4f9953be's `_sample` returns as it is); the result is padded to the full length, as coati pads every
rollout to max_length. The pad id is masked at every step: upstream's pad is its EOS (train_ppo.py), so a
sampled pad ends a row there; the harness's pad differs from its EOS, and a sampled one would sit inside a
running row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from adapters.rl_math import position_ids

Forward = Callable[..., tuple[torch.Tensor, Any]]


def _all_finished(unfinished: torch.Tensor) -> bool:
    if dist.is_initialized() and dist.get_world_size() > 1:
        unfinished = unfinished.clone()
        dist.all_reduce(unfinished)
    return bool(unfinished.max() == 0)


@torch.no_grad()
def sample(forward: Forward, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_length: int,
           eos_id: int, pad_id: int, temperature: float, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`forward(**model inputs)` returns (logits over the whole vocabulary, past key values).
    Returns (sequences, attention_mask), both [B, max_length]."""
    seq, mask = input_ids, attention_mask
    positions = position_ids(mask)
    unfinished = torch.ones(seq.shape[0], dtype=torch.long, device=seq.device)
    past = None
    for _ in range(seq.shape[1], max_length):
        fresh = past is None
        logits, past = forward(
            input_ids=seq if fresh else seq[:, -1:],
            attention_mask=mask,
            position_ids=positions if fresh else positions[:, -1:],
            past_key_values=past,
            use_cache=True,
        )
        logits = logits[:, -1, :].float()
        logits[:, pad_id] = float("-inf")  # pad and EOS ids differ here; a sampled pad would end the row unseen
        if temperature != 1.0:
            logits = logits / temperature
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        next_tokens = torch.multinomial(torch.softmax(logits, dim=-1), 1).squeeze(1)
        next_tokens = next_tokens * unfinished + pad_id * (1 - unfinished)
        seq = torch.cat([seq, next_tokens[:, None]], dim=1)
        mask = torch.cat([mask, unfinished[:, None].to(mask.dtype)], dim=1)
        positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
        unfinished = unfinished * (next_tokens != eos_id).long()
        if _all_finished(unfinished):
            break
    pad = max_length - seq.shape[1]
    return F.pad(seq, (0, pad), value=pad_id), F.pad(mask, (0, pad), value=0)
