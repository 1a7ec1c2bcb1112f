"""What the harness's own instruments cost: the same steps with the trackers on and off, in one process.

The step loop's steps run alternately through the real PhaseTracker (per phase: gc, malloc_trim where the
phase's floor needs it and its schedule says so, the RSS high-water reset and read, or the CUDA peak reset and
read, and the timer), with the objects alive after init frozen as StageLoop.run freezes them, and through a
tracker that measures nothing, in the order on, off, off, on, on, off, ... (neither mode always goes first),
each step timed whole from outside with time.perf_counter between barriers. Warm-up steps are left out. Rank 0
prints the median and mean step time of each mode and the overhead of the trackers as a share of the
untracked step.

With --every a third mode joins, the trackers with the heap released before every phase that needs it
(memory_release_every=1, as a soak run does), the three rotating (on, off, every / off, every, on / ...): the
difference between it and `on` is what the release's refault costs each time it happens. A periodic cost shows
in the mean, not the median.

    torchrun --standalone --nproc_per_node 2 scripts/diagnostics/tracker_overhead.py framework=dschat model=glm-base \\
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from adapters import registry  # noqa: E402
from adapters.base import RankContext  # noqa: E402
from bench.measure.memory import long_lived_frozen  # noqa: E402
from bench.measure.phases import PhaseTracker  # noqa: E402
from bench.run.config import compose  # noqa: E402
from bench.run.data import SyntheticData  # noqa: E402
from bench.run.loop import StageLoop  # noqa: E402
from bench.run.spec import spec_from_config  # noqa: E402
from bench.run.worker import resolve_device  # noqa: E402


class Untracked:
    """PhaseTracker's interface, measuring nothing."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.samples: list[dict[str, Any]] = []
        self.current_phase: str | None = None

    @contextmanager
    def phase(self, name: str, step: int | None = None) -> Iterator[dict[str, Any]]:
        yield {"phase": name, "step": step}


def mode_order(steps: int, modes: tuple[str, ...]) -> list[str]:
    """Blocks of one step per mode, each block the last one rotated by one: with two modes on, off, off, on, ...;
    every mode leads as often as the others."""
    order: list[str] = []
    for block in range(-(-steps // len(modes))):
        shift = block % len(modes)
        order.extend(modes[shift:] + modes[:shift])
    return order[:steps]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()


def main(argv: list[str]) -> None:
    modes = ("on", "off", "every") if "--every" in argv else ("on", "off")
    spec = spec_from_config(compose([a for a in argv if a != "--every"]))
    stage = spec.stage if spec.stage in ("sft", "rm", "ppo") else "sft"
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.set_num_threads(spec.launcher.threads_per_rank)
    device = resolve_device(spec.launcher.device, int(os.environ.get("LOCAL_RANK", 0)))
    adapter = registry.adapter_class(spec.framework)(spec, RankContext(rank, world, int(os.environ.get(
        "LOCAL_RANK", 0)), device))
    adapter.setup(stage, {})
    data = SyntheticData(spec.model.vocab, spec.prompt_len, spec.answer_len, spec.batch, spec.seed,
                         adapter.data_parallel_rank)
    trackers = {"on": PhaseTracker(device, spec.release_every), "off": Untracked(device),
                "every": PhaseTracker(device, 1)}
    loop = StageLoop(adapter, spec, trackers["on"], data)
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    trimmed: dict[str, list[bool]] = {mode: [] for mode in modes}
    with long_lived_frozen():
        for step, mode in enumerate(mode_order(spec.steps[stage], modes)):
            loop.tracker = trackers[mode]
            count = len(loop.tracker.samples)
            _sync(device)
            start = time.perf_counter()
            loop._step(stage, step)  # the loop's own step: the adapter's work inside the tracker's phases
            _sync(device)
            if step >= spec.warmup_steps:
                times[mode].append(time.perf_counter() - start)
                trimmed[mode].append(any(s["heap_trimmed"] for s in loop.tracker.samples[count:]))
    adapter.close()
    if rank == 0:
        off = times["off"]
        print(f"\n{spec.framework} {stage} {spec.model.name} x{world} ranks on {device.type}, without trackers: "
              f"median step {statistics.median(off):.3f} s, mean {statistics.mean(off):.3f} s ({len(off)} steps)")
        for mode in modes:
            if mode != "off":
                what = ("trackers, heap released every run that needs it" if mode == "every" else
                        f"trackers, heap released in at least one run in every {spec.release_every}")
                median, mean = statistics.median(times[mode]), statistics.mean(times[mode])
                print(f"{mode} ({what}): median {median:.3f} s ({100 * (median / statistics.median(off) - 1):+.1f} "
                      f"%), mean {mean:.3f} s ({100 * (mean / statistics.mean(off) - 1):+.1f} %); heap trimmed in "
                      f"{sum(trimmed[mode])} of its {len(times[mode])} timed steps")
        for mode in modes:
            print(f"{mode}: {[round(t, 3) for t in times[mode]]}")


if __name__ == "__main__":
    main(sys.argv[1:])
