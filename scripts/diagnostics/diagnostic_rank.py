"""One rank of an adapter's SFT, RM or PPO stage, set up outside the harness for the diagnostics in scripts/diagnostics/
(run under torchrun; the launcher's environment names the rank). PPO starts from random weights (no SFT or RM
checkpoint): what the diagnostics read is memory, not learning.

What the harness gives its ranks, a diagnostic rank gets too: the project's JIT folder (a script under torchrun
does not inherit the launcher's), the stale-build-lock guard, and the stall watchdog (`launcher.stall_s`), whose
report goes to bench.run.watchdog's stall folder (`RLHF_BENCH_STALL_DIR`; tests set it and read it back)."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from adapters import registry  # noqa: E402
from adapters.base import RankContext  # noqa: E402
from bench.measure import jit_ops  # noqa: E402
from bench.run import jit_builds  # noqa: E402
from bench.run.data import SyntheticData  # noqa: E402
from bench.run.spec import RunSpec  # noqa: E402
from bench.run.watchdog import RankWatchdog, outside_stall_path  # noqa: E402
from bench.run.worker import jit_listener, lock_listener, resolve_device  # noqa: E402


def _remove_unfired(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


@dataclass
class DiagnosticRank:
    spec: RunSpec
    stage: str  # sft | rm | ppo
    rank: int
    device: torch.device
    adapter: Any
    data: SyntheticData
    watchdog: RankWatchdog

    @classmethod
    def start(cls, spec: RunSpec) -> DiagnosticRank:
        """The adapter set up for the spec's stage (sft for a pipeline)."""
        stage = spec.stage if spec.stage in ("sft", "rm", "ppo") else "sft"
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        jit_builds.use_cache_dir()
        script = os.path.splitext(os.path.basename(sys.argv[0]))[0]
        stall_file = outside_stall_path(script, rank)
        watchdog = RankWatchdog(stall_file, rank, spec.launcher.stall_s)
        atexit.register(_remove_unfired, stall_file)  # a stall ends the process without atexit: its file stays
        watchdog.watch_parent()
        jit_ops.install(on_load=jit_listener(None, watchdog))
        jit_builds.install(on_wait=lock_listener(None, watchdog))
        watchdog.beat("the adapter began its setup")
        torch.set_num_threads(spec.launcher.threads_per_rank)
        device = resolve_device(spec.launcher.device, local_rank)
        adapter = registry.adapter_class(spec.framework)(spec, RankContext(rank, world, local_rank, device))
        adapter.setup(stage, {})
        if stage == "ppo":  # as the loop does after a PPO setup: what make_experience does to the RM's scores
            adapter.set_reward_scaling({})
        data = SyntheticData(spec.model.vocab, spec.prompt_len, spec.answer_len, spec.batch, spec.seed,
                             adapter.data_parallel_rank)
        return cls(spec, stage, rank, device, adapter, data, watchdog)

    def beat(self, what: str) -> None:
        """Progress, for the stall watchdog (bench.run.watchdog)."""
        self.watchdog.beat(what)

    def step(self, i: int) -> None:
        """One training step; in PPO a whole one (rollout, experience, update)."""
        self.beat(f"step {i} began")
        if self.stage == "sft":
            self.adapter.sft_step(self.data.sft(i))
        elif self.stage == "rm":
            self.adapter.rm_step(self.data.preferences(i))
        else:
            self.adapter.ppo_train([self.experience(i)])

    def experience(self, i: int) -> Any:
        """PPO's rollout of step i and the experience made from it."""
        return self.adapter.make_experience(self.adapter.generate(self.data.prompts(i)))
