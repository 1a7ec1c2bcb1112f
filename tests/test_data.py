"""Synthetic data: deterministic per (seed, rank, step), different across ranks, learnable preference."""

from __future__ import annotations

import torch

from bench.run.data import EOS, PAD, SyntheticData


def make(rank: int = 0, seed: int = 1) -> SyntheticData:
    return SyntheticData(vocab=256, prompt_len=16, answer_len=16, batch=8, seed=seed, rank=rank)


def test_batches_are_reproducible_and_rank_specific():
    assert torch.equal(make().prompts(3).input_ids, make().prompts(3).input_ids)
    assert not torch.equal(make(rank=0).prompts(3).input_ids, make(rank=1).prompts(3).input_ids)
    assert not torch.equal(make(seed=1).sft(0).input_ids, make(seed=2).sft(0).input_ids)


def test_prompts_are_left_padded_with_real_lengths():
    batch = make().prompts(0)
    assert (batch.input_ids[:, -1] != PAD).all()
    assert batch.real_tokens < batch.input_ids.numel()


def test_chosen_responses_carry_the_preference():
    data = make()
    batch = data.preferences(0)
    chosen = data.preferred_fraction(batch.chosen_ids[:, 16:], batch.chosen_mask[:, 16:])
    rejected = data.preferred_fraction(batch.rejected_ids[:, 16:], batch.rejected_mask[:, 16:])
    assert chosen > rejected + 0.3
    assert ((batch.chosen_ids == EOS).sum(1) == 1).all()


def test_sft_labels_mask_padding():
    batch = make().sft(0)
    assert ((batch.labels == -100) == (batch.attention_mask == 0)).all()
