"""What the harness's own instruments cost: the same steps with the trackers on and off, in one process.

The step loop's steps run alternately through the real PhaseTracker (per phase: gc, malloc_trim where the
phase's floor needs it, the RSS high-water reset and read, or the CUDA peak reset and read, and the timer),
with the objects alive after init frozen as StageLoop.run freezes them, and through a tracker that
measures nothing, in the order on, off, off, on, on, off, ... (neither mode always goes first), each step
timed whole from outside with time.perf_counter between barriers. Warm-up steps are left out. Rank 0
prints the median step time of each mode and the overhead of the trackers as a share of the untracked step.

    torchrun --standalone --nproc_per_node 2 scripts/tracker_overhead.py framework=dschat model=glm-base \\
        stage=sft steps=13 warmup_steps=1 prompt_len=128 answer_len=128 batch=2

Overrides are the harness's own; PPO runs without prerequisite checkpoints (random reward and critic:
the work is the same, the values are not).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from adapters import registry  # noqa: E402
from adapters.base import RankContext  # noqa: E402
from bench.config import compose  # noqa: E402
from bench.data import SyntheticData  # noqa: E402
from bench.loop import StageLoop  # noqa: E402
from bench.spec import spec_from_config  # noqa: E402
from bench.trackers.memory import long_lived_frozen  # noqa: E402
from bench.trackers.phases import PhaseTracker  # noqa: E402
from bench.worker import resolve_device  # noqa: E402


class Untracked:
    """PhaseTracker's interface, measuring nothing."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.samples: list[dict[str, Any]] = []
        self.current_phase: str | None = None

    @contextmanager
    def phase(self, name: str, step: int | None = None) -> Iterator[dict[str, Any]]:
        yield {"phase": name, "step": step}


def tracked_steps(steps: int) -> list[bool]:
    """on, off, off, on, on, off, ...: each mode leads every other pair."""
    return [(i % 4) in (0, 3) for i in range(steps)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()


def main(overrides: list[str]) -> None:
    spec = spec_from_config(compose(overrides))
    stage = spec.stage if spec.stage in ("sft", "rm", "ppo") else "sft"
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.set_num_threads(spec.launcher.threads_per_rank)
    device = resolve_device(spec.launcher.device, int(os.environ.get("LOCAL_RANK", 0)))
    adapter = registry.adapter_class(spec.framework)(spec, RankContext(rank, world, int(os.environ.get(
        "LOCAL_RANK", 0)), device))
    adapter.setup(stage, {})
    data = SyntheticData(spec.model.vocab, spec.prompt_len, spec.answer_len, spec.batch, spec.seed,
                         adapter.data_parallel_rank)
    tracker, untracked = PhaseTracker(device), Untracked(device)
    loop = StageLoop(adapter, spec, tracker, data)
    times: dict[bool, list[float]] = {True: [], False: []}
    modes = tracked_steps(spec.steps[stage])
    with long_lived_frozen():
        for step, on in enumerate(modes):
            loop.tracker = tracker if on else untracked
            _sync(device)
            start = time.perf_counter()
            loop._step(stage, step)  # the loop's own step: the adapter's work inside the tracker's phases
            _sync(device)
            if step >= spec.warmup_steps:
                times[on].append(time.perf_counter() - start)
    adapter.close()
    if rank == 0:
        on, off = statistics.median(times[True]), statistics.median(times[False])
        print(f"\n{spec.framework} {stage} {spec.model.name} x{world} ranks on {device.type}: median step "
              f"{on:.3f} s with trackers ({len(times[True])} steps), {off:.3f} s without ({len(times[False])}); "
              f"overhead {100 * (on / off - 1):+.1f} % of the untracked step")
        print(f"with: {[round(t, 3) for t in times[True]]}\nwithout: {[round(t, 3) for t in times[False]]}")
        trimmed = [s["heap_trimmed"] for s in tracker.samples]
        print(f"heap trimmed before {sum(trimmed)} of {len(trimmed)} tracked phases (warm-up included)")


if __name__ == "__main__":
    main(sys.argv[1:])
