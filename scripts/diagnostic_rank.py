"""One rank of an adapter's SFT, RM or PPO stage, set up outside the harness for the diagnostics in scripts/
(run under torchrun; the launcher's environment names the rank). PPO starts from random weights (no SFT or RM
checkpoint): what the diagnostics read is memory, not learning."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from adapters import registry  # noqa: E402
from adapters.base import RankContext  # noqa: E402
from bench.run.data import SyntheticData  # noqa: E402
from bench.run.spec import RunSpec  # noqa: E402
from bench.run.worker import resolve_device  # noqa: E402


@dataclass
class DiagnosticRank:
    spec: RunSpec
    stage: str  # sft | rm | ppo
    rank: int
    device: torch.device
    adapter: Any
    data: SyntheticData

    @classmethod
    def start(cls, spec: RunSpec) -> DiagnosticRank:
        """The adapter set up for the spec's stage (sft for a pipeline)."""
        stage = spec.stage if spec.stage in ("sft", "rm", "ppo") else "sft"
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.set_num_threads(spec.launcher.threads_per_rank)
        device = resolve_device(spec.launcher.device, local_rank)
        adapter = registry.adapter_class(spec.framework)(spec, RankContext(rank, world, local_rank, device))
        adapter.setup(stage, {})
        if stage == "ppo":  # as the loop does after a PPO setup: what make_experience does to the RM's scores
            adapter.set_reward_scaling({})
        data = SyntheticData(spec.model.vocab, spec.prompt_len, spec.answer_len, spec.batch, spec.seed,
                             adapter.data_parallel_rank)
        return cls(spec, stage, rank, device, adapter, data)

    def step(self, i: int) -> None:
        """One training step; in PPO a whole one (rollout, experience, update)."""
        if self.stage == "sft":
            self.adapter.sft_step(self.data.sft(i))
        elif self.stage == "rm":
            self.adapter.rm_step(self.data.preferences(i))
        else:
            self.adapter.ppo_train([self.experience(i)])

    def experience(self, i: int) -> Any:
        """PPO's rollout of step i and the experience made from it."""
        return self.adapter.make_experience(self.adapter.generate(self.data.prompts(i)))
