"""When in a step each phase's resident peak happens, and what ZeRO-3 has gathered then.

The memory model adds a phase's working set (activations, logits, caches) to what stays resident; where a
measured peak does not grow with the batch as that sum does, the question is whether the peak falls at the
moment the working set is largest at all. This diagnostic runs one warm-up step of an adapter (PPO, RM or SFT),
then the next step's phases one after the other (PPO: generation, experience, update; RM: a training step, then
held-out scoring; SFT: a training step), and samples each rank's RSS every 2 ms from a thread (torch's kernels
release the GIL). At each phase's highest sample it notes the module whose forward or backward began last
(torch's global module hooks) and, for a DeepSpeed engine at ZeRO-3, the bytes of parameters gathered whole at
that moment (`ds_status` AVAILABLE, persistent small ones left out) beside the most gathered at once in the
phase (read at every module's forward and backward start as well as by the sampler, so a short step misses
none), and the most gathered or in flight (INFLIGHT: prefetched, their gather under way; on the host gloo keeps
a copy of each until the fetch: scripts/diagnostics/gloo_allgather_copy.py).

    MALLOC_MMAP_THRESHOLD_=4194304 torchrun --standalone --nproc_per_node 2 scripts/diagnostics/peak_moment.py \
        framework=trlx model=llama-base precision=fp32 zero=3 prompt_len=128 answer_len=128 batch=2 launcher.nproc=2

Each rank prints its own lines; `--json=PATH` also writes rank 0's figures in bytes (tests/test_zero3_gathered.py
reads them). The RSS rise is over the phase's first sample (current RSS, not the tracker's high-water mark over
its baseline), so it is read beside the same script's other runs, not beside a record. Under `torchrun`
directly the harness's `memory_mmap_threshold` is not applied: set glibc's variable as above.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import psutil
import torch
import torch.distributed as dist
from torch.nn.modules import module as nn_module

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench.run.config import compose  # noqa: E402
from bench.run.spec import spec_from_config  # noqa: E402
from scripts.diagnostics.diagnostic_rank import DiagnosticRank  # noqa: E402

MIB = 2**20
PERIOD_S = 0.002
# each stage's phases, in the order one step runs them (RM: a training step, then held-out scoring as the loop's
# evaluation runs it, one preference batch after another)
PHASES = {"ppo": ("generation", "experience", "training"), "rm": ("training", "evaluation"), "sft": ("training",)}
EVAL_BATCHES = 4


@dataclass
class PhasePeak:
    start_rss: int
    peak_rss: int = 0
    at_peak: str = ""  # the module whose forward or backward began last when the peak was sampled
    gathered_at_peak: int = 0
    most_gathered: int = 0
    most_gathered_or_in_flight: int = 0  # with the parameters whose gather is under way (prefetched)


@dataclass
class Sampler:
    """Samples RSS and ZeRO-3's gathered parameter bytes into the current phase's PhasePeak."""
    partitioned: list[torch.nn.Parameter]
    names: dict[int, str]
    phase: str = "setup"
    where: str = ""
    peaks: dict[str, PhasePeak] = field(default_factory=dict)
    running: bool = True

    def gathered(self) -> tuple[int, int]:
        """(bytes gathered whole, bytes gathered or in flight), persistent small ones left out."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        available = in_flight = 0
        for p in self.partitioned:
            if p.ds_persist:
                continue
            if p.ds_status == ZeroParamStatus.AVAILABLE:
                available += p.numel() * p.element_size()
            elif p.ds_status == ZeroParamStatus.INFLIGHT:
                in_flight += p.ds_numel * p.element_size()
        return available, available + in_flight

    def note_gathered(self, peak: PhasePeak) -> int:
        available, with_in_flight = self.gathered() if self.partitioned else (0, 0)
        peak.most_gathered = max(peak.most_gathered, available)
        peak.most_gathered_or_in_flight = max(peak.most_gathered_or_in_flight, with_in_flight)
        return available

    def run(self) -> None:
        process = psutil.Process()
        while self.running:
            rss = process.memory_info().rss
            peak = self.peaks.get(self.phase)
            if peak is None:  # setup and the end: no phase's
                time.sleep(PERIOD_S)
                continue
            gathered = self.note_gathered(peak)
            if rss > peak.peak_rss:
                peak.peak_rss, peak.at_peak, peak.gathered_at_peak = rss, self.where, gathered
            time.sleep(PERIOD_S)

    def begin(self, phase: str) -> None:
        self.peaks[phase] = PhasePeak(start_rss=psutil.Process().memory_info().rss)
        self.phase = phase

    def entered(self, direction: str, module: torch.nn.Module) -> None:
        self.where = f"{direction} {self.names.get(id(module), type(module).__name__)}"
        peak = self.peaks.get(self.phase)
        if peak is not None:
            self.note_gathered(peak)


def zero3_parameters() -> list[torch.nn.Parameter]:
    """Every parameter a ZeRO-3 engine partitioned, in any model of the process (found by the garbage collector:
    adapters keep their engines under their own attribute names)."""
    return [obj for obj in gc.get_objects() if isinstance(obj, torch.nn.Parameter) and hasattr(obj, "ds_status")]


def module_names() -> dict[int, str]:
    """Every module's dotted name under the models the process holds, the outermost naming first."""
    names: dict[int, str] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.nn.Module):
            for name, module in obj.named_modules():
                if name and len(name) > len(names.get(id(module), "")):
                    names[id(module)] = name
    return names


def main(argv: list[str]) -> None:
    json_path = next((a.removeprefix("--json=") for a in argv if a.startswith("--json=")), None)
    spec = spec_from_config(compose([a for a in argv if not a.startswith("--json=")]))
    run = DiagnosticRank.start(spec)
    if run.stage not in PHASES:
        raise SystemExit(f"stage={spec.stage}: this diagnostic follows the phases of a PPO, an RM or an SFT "
                         f"step (stage={', stage='.join(PHASES)})")
    run.step(0)  # warm-up: Adam's moments and the engines' lazily made buffers exist from here on
    sampler = Sampler(zero3_parameters(), module_names())
    nn_module.register_module_forward_pre_hook(lambda m, args: sampler.entered("forward", m))
    nn_module.register_module_full_backward_pre_hook(lambda m, grad: sampler.entered("backward", m))
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()

    def begin(phase: str) -> None:
        sampler.begin(phase)
        run.beat(f"phase {phase!r} began")

    if run.stage == "ppo":
        begin("generation")
        rollout = run.adapter.generate(run.data.prompts(1))
        begin("experience")
        experience = run.adapter.make_experience(rollout)
        begin("training")
        run.adapter.ppo_train([experience])
    else:
        begin("training")
        run.step(1)
        if run.stage == "rm":
            gc.collect()
            begin("evaluation")
            for i in range(EVAL_BATCHES):
                run.adapter.rm_scores(run.data.preferences(i, stage="eval"))
    sampler.phase = "done"
    time.sleep(10 * PERIOD_S)
    sampler.running = False
    thread.join()
    world = dist.get_world_size() if dist.is_initialized() else 1
    whole = sum(p.ds_numel * p.element_size() for p in sampler.partitioned)
    for rank in range(world):  # one rank's lines at a time
        if dist.is_initialized():
            dist.barrier()
        if rank != run.rank:
            continue
        print(f"rank {rank}: {spec.framework} {run.stage.upper()} {spec.model.name} {spec.precision} "
              f"ZeRO-{spec.zero} batch {spec.batch}, {whole / MIB:,.0f} MiB of partitioned parameters whole",
              flush=True)
        for phase in PHASES[run.stage]:
            peak = sampler.peaks[phase]
            print(f"  {phase}: RSS peak {(peak.peak_rss - peak.start_rss) / MIB:,.0f} MiB over the phase's start "
                  f"({peak.peak_rss / MIB:,.0f} MiB), at {peak.at_peak or 'no module'}; gathered then "
                  f"{peak.gathered_at_peak / MIB:,.0f} MiB, at most {peak.most_gathered / MIB:,.0f} "
                  f"({peak.most_gathered_or_in_flight / MIB:,.0f} with those in flight)", flush=True)
        if json_path and rank == 0:
            with open(json_path, "w") as f:
                json.dump({phase: asdict(sampler.peaks[phase]) for phase in PHASES[run.stage]}, f, indent=1)
    run.adapter.close()


if __name__ == "__main__":
    main(sys.argv[1:])
