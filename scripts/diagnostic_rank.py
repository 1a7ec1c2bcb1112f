"""One rank of an adapter's SFT or RM stage, set up outside the harness for the diagnostics in scripts/ (run
under torchrun; the launcher's environment names the rank)."""

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
    stage: str  # sft | rm
    rank: int
    device: torch.device
    adapter: Any
    data: SyntheticData

    @classmethod
    def start(cls, spec: RunSpec) -> DiagnosticRank:
        """The adapter set up for the spec's stage (sft when the spec names another)."""
        stage = spec.stage if spec.stage in ("sft", "rm") else "sft"
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.set_num_threads(spec.launcher.threads_per_rank)
        device = resolve_device(spec.launcher.device, local_rank)
        adapter = registry.adapter_class(spec.framework)(spec, RankContext(rank, world, local_rank, device))
        adapter.setup(stage, {})
        data = SyntheticData(spec.model.vocab, spec.prompt_len, spec.answer_len, spec.batch, spec.seed,
                             adapter.data_parallel_rank)
        return cls(spec, stage, rank, device, adapter, data)

    def step(self, i: int) -> None:
        if self.stage == "sft":
            self.adapter.sft_step(self.data.sft(i))
        else:
            self.adapter.rm_step(self.data.preferences(i))
