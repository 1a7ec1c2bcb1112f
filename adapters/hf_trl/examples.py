"""The synthetic data as TRL's trainers take it: a tokenizer built in code and `datasets.Dataset`s.

Every trainer needs a `processing_class`; nothing may be downloaded, so a word-level tokenizer over the
synthetic vocabulary ("<pad>", "<eos>", "t2" ... "t{V-1}") is built here: ids and text map one to one, so
GRPO's text prompts round-trip. The rows are the harness's own synthetic samples (bench.run.data, every
data-parallel rank's share); TRL's dataloaders draw and shard them as they do any dataset.
"""

from __future__ import annotations

from typing import Any

import torch

from bench.run.data import EOS, PAD, SyntheticData


def tokenizer(vocab: int) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": PAD, "<eos>": EOS, **{f"t{i}": i for i in range(EOS + 1, vocab)}}
    inner = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>", eos_token="<eos>",
                                   model_input_names=["input_ids", "attention_mask"])


def text(ids: torch.Tensor) -> str:
    return " ".join(f"t{int(i)}" for i in ids)


def _real(ids: torch.Tensor, mask: torch.Tensor) -> list[int]:
    return [int(i) for i in ids[mask.bool()]]


class Rows:
    """The synthetic samples of every data-parallel rank for `batches` batches each, as dataset columns."""

    def __init__(self, vocab: int, prompt_len: int, answer_len: int, batch: int, seed: int, ranks: int) -> None:
        self.sources = [SyntheticData(vocab, prompt_len, answer_len, batch, seed, rank) for rank in range(ranks)]

    def sft(self, batches: int) -> dict[str, list]:
        rows = []
        for b in range(batches):
            for data in self.sources:
                batch = data.sft(b)
                rows += [_real(ids, mask) for ids, mask in zip(batch.input_ids, batch.attention_mask, strict=True)]
        return {"input_ids": rows}

    def preferences(self, batches: int) -> dict[str, list]:
        columns: dict[str, list] = {k: [] for k in ("input_ids_chosen", "attention_mask_chosen",
                                                    "input_ids_rejected", "attention_mask_rejected")}
        for b in range(batches):
            for data in self.sources:
                pairs = data.preferences(b)
                for side, ids, mask in (("chosen", pairs.chosen_ids, pairs.chosen_mask),
                                        ("rejected", pairs.rejected_ids, pairs.rejected_mask)):
                    for row, row_mask in zip(ids, mask, strict=True):
                        real = _real(row, row_mask)
                        columns[f"input_ids_{side}"].append(real)
                        columns[f"attention_mask_{side}"].append([1] * len(real))
        return columns

    def prompts(self, batches: int) -> list[list[int]]:
        rows = []
        for b in range(batches):
            for data in self.sources:
                batch = data.prompts(b)
                rows += [_real(ids, mask) for ids, mask in zip(batch.input_ids, batch.attention_mask, strict=True)]
        return rows


def dataset(columns: dict[str, list]) -> Any:
    from datasets import Dataset

    return Dataset.from_dict(columns)


def preferred_reward(data: SyntheticData):
    """GRPO's reward function: the share of preferred tokens among an answer's tokens (the ground truth the
    PPO reward model learns), computed from the completion ids GRPOTrainer hands every reward function."""
    preferred = set(int(t) for t in data.preferred)

    def preferred_tokens(completions: list, completion_ids: list[list[int]], **_: Any) -> list[float]:
        return [sum(t in preferred for t in ids if t != EOS) / max(1, sum(t != EOS for t in ids))
                for ids in completion_ids]

    return preferred_tokens
