"""What one PPO rollout costs each rank in time, split into user and kernel seconds and page faults.

A measurement setting that maps more allocations (`memory_mmap_threshold`) is paid in the kernel: each mapped
block is faulted in afresh and unmapped at its free. ZeRO-3's generation gathers every partitioned weight once
per generated token, so that is where a lower threshold costs most. This diagnostic sets up an adapter's PPO
stage (random weights, as scripts/diagnostics/diagnostic_rank.py does), generates one warm-up rollout, then times
`ROLLOUTS` more (default 2), each between barriers, and prints each rank's wall, user and system seconds and
minor page faults per rollout (`resource.getrusage` of the rank's process).

    MALLOC_MMAP_THRESHOLD_=131072 torchrun --standalone --nproc_per_node 2 scripts/diagnostics/rollout_cost.py \
        framework=trlx stage=ppo model=llama-base precision=bf16 zero=3 prompt_len=128 answer_len=128 batch=2 \
        launcher.nproc=2

Under `torchrun` directly the harness's `memory_mmap_threshold` is not applied: set glibc's variable as above,
and compare settings in runs interleaved on one machine (docs/performance.md).
"""

from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import dataclass

import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench.run.config import compose  # noqa: E402
from bench.run.spec import spec_from_config  # noqa: E402
from scripts.diagnostics.diagnostic_rank import DiagnosticRank  # noqa: E402


@dataclass
class RolloutCost:
    wall_s: float
    user_s: float
    system_s: float
    minor_faults: int


def timed_rollout(run: DiagnosticRank, i: int) -> RolloutCost:
    """Rollout i's cost on this rank, from a barrier (the ranks start together) to its end."""
    if dist.is_initialized():
        dist.barrier()
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    run.adapter.generate(run.data.prompts(i))
    end, after = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    return RolloutCost(end - start, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime,
                       after.ru_minflt - before.ru_minflt)


def main(argv: list[str]) -> None:
    rollouts = int(os.environ.get("ROLLOUTS", "2"))
    spec = spec_from_config(compose(argv))
    if spec.stage != "ppo":
        raise SystemExit(f"stage={spec.stage}: this diagnostic times PPO's rollouts (stage=ppo)")
    run = DiagnosticRank.start(spec)
    run.adapter.generate(run.data.prompts(0))  # warm-up: the engines' lazily made buffers exist from here on
    costs = [timed_rollout(run, i) for i in range(1, rollouts + 1)]
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_", "glibc's own")
    print(f"rank {run.rank}: {spec.framework} PPO {spec.model.name} {spec.precision} ZeRO-{spec.zero} batch "
          f"{spec.batch}, mmap threshold {threshold}: "
          + "; ".join(f"wall {c.wall_s:.1f} s, user {c.user_s:.1f} s, system {c.system_s:.1f} s, "
                      f"{c.minor_faults:,} minor faults" for c in costs), flush=True)
    run.adapter.close()


if __name__ == "__main__":
    main(sys.argv[1:])
