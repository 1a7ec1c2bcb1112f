"""Synthetic data generated in code from a seed: prompts, SFT pairs and preference pairs.

The preference is learnable: responses rich in a fixed "preferred" token subset are chosen over
responses without it, so a reward model can learn it and PPO can raise the reward by emitting more
preferred tokens. SFT teaches a different, quickly learnable format: the answer walks a fixed cycle of
"template" tokens (outside the preferred subset) from an offset set by the prompt's last token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD = 0
EOS = 1
FIRST_TOKEN = 2


def pad_is_eos_mask(ids: torch.Tensor) -> torch.Tensor:
    """The attention mask of a framework whose pad id is its EOS id (`ids != pad_token_id`: DS-Chat sets
    `pad_token = eos_token` for every non-Llama tokenizer; trlx's GPT-2/GPT-J tokenizers resolve their pad to
    <|endoftext|>): the EOS reads as padding. PAD and EOS are separate ids here, so both are masked."""
    return ((ids != PAD) & (ids != EOS)).long()
CHOSEN_PREFERRED_P = 0.7
REJECTED_PREFERRED_P = 0.05
TEMPLATE_TOKENS = 16

_STAGE_OFFSETS = {"sft": 1, "rm": 2, "ppo": 3, "eval": 4}


@dataclass
class PromptBatch:
    input_ids: torch.Tensor  # [B, prompt_len], left-padded as DS-Chat pads prompts
    attention_mask: torch.Tensor

    @property
    def real_tokens(self) -> int:
        return int(self.attention_mask.sum())


@dataclass
class SFTBatch:
    input_ids: torch.Tensor  # [B, prompt_len + answer_len], right-padded
    attention_mask: torch.Tensor
    labels: torch.Tensor  # -100 on padding

    @property
    def real_tokens(self) -> int:
        return int(self.attention_mask.sum())


@dataclass
class PreferenceBatch:
    chosen_ids: torch.Tensor  # [B, prompt_len + answer_len], right-padded
    chosen_mask: torch.Tensor
    rejected_ids: torch.Tensor
    rejected_mask: torch.Tensor

    @property
    def real_tokens(self) -> int:
        return int(self.chosen_mask.sum() + self.rejected_mask.sum())


class SyntheticData:
    """Per-rank batches: rank r and step s always get the same batch for the same seed."""

    def __init__(self, vocab: int, prompt_len: int, answer_len: int, batch: int, seed: int, rank: int) -> None:
        self.vocab = vocab
        self.prompt_len = prompt_len
        self.answer_len = answer_len
        self.batch = batch
        self.seed = seed
        self.rank = rank
        self.preferred = torch.arange(FIRST_TOKEN, FIRST_TOKEN + (vocab - FIRST_TOKEN) // 8)
        first_template = FIRST_TOKEN + len(self.preferred)
        self.template = torch.arange(first_template, first_template + TEMPLATE_TOKENS)

    def _generator(self, stage: str, step: int) -> torch.Generator:
        return torch.Generator().manual_seed(
            self.seed * 1_000_003 + _STAGE_OFFSETS[stage] * 100_003 + self.rank * 10_007 + step
        )

    def _prompt_tokens(self, g: torch.Generator) -> list[torch.Tensor]:
        lengths = torch.randint(max(1, self.prompt_len // 2), self.prompt_len + 1, (self.batch,), generator=g)
        return [torch.randint(FIRST_TOKEN, self.vocab, (int(n),), generator=g) for n in lengths]

    def _response(self, g: torch.Generator, p_preferred: float) -> torch.Tensor:
        n = int(torch.randint(max(1, self.answer_len // 2), self.answer_len, (1,), generator=g))
        others = torch.randint(FIRST_TOKEN + len(self.preferred), self.vocab, (n,), generator=g)
        liked = self.preferred[torch.randint(0, len(self.preferred), (n,), generator=g)]
        pick = torch.rand(n, generator=g) < p_preferred
        return torch.cat([torch.where(pick, liked, others), torch.tensor([EOS])])

    def prompts(self, step: int, stage: str = "ppo") -> PromptBatch:
        ids = torch.full((self.batch, self.prompt_len), PAD, dtype=torch.long)
        for i, tokens in enumerate(self._prompt_tokens(self._generator(stage, step))):
            ids[i, self.prompt_len - len(tokens) :] = tokens
        return PromptBatch(ids, (ids != PAD).long())

    def _right_padded(self, rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.full((len(rows), self.prompt_len + self.answer_len), PAD, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
        return ids, (ids != PAD).long()

    def sft(self, step: int, stage: str = "sft") -> SFTBatch:
        g = self._generator(stage, step)
        rows = []
        cycle = len(self.template)
        for prompt in self._prompt_tokens(g):
            offset = int(prompt[-1]) % cycle
            answer = self.template[(offset + torch.arange(self.answer_len - 1)) % cycle]
            rows.append(torch.cat([prompt, answer, torch.tensor([EOS])]))
        ids, mask = self._right_padded(rows)
        return SFTBatch(ids, mask, ids.masked_fill(mask == 0, -100))

    def preferences(self, step: int, stage: str = "rm") -> PreferenceBatch:
        g = self._generator(stage, step)
        chosen, rejected = [], []
        for prompt in self._prompt_tokens(g):
            chosen.append(torch.cat([prompt, self._response(g, CHOSEN_PREFERRED_P)]))
            rejected.append(torch.cat([prompt, self._response(g, REJECTED_PREFERRED_P)]))
        chosen_ids, chosen_mask = self._right_padded(chosen)
        rejected_ids, rejected_mask = self._right_padded(rejected)
        return PreferenceBatch(chosen_ids, chosen_mask, rejected_ids, rejected_mask)

    def preferred_fraction(self, answers: torch.Tensor, mask: torch.Tensor) -> float:
        """Ground truth behind the preference: the share of preferred tokens among real answer tokens."""
        hits = torch.isin(answers, self.preferred) & mask.bool()
        return float(hits.sum()) / max(1, int(mask.sum()))
