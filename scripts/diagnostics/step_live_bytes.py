"""Torch's own live bytes over one training step (or PPO's experience), against the memory model's terms.

The memory model's calibration stands for what RSS holds beyond torch's tensors (allocator slack). This
diagnostic checks that split: it runs one warm-up step of an adapter's SFT, RM or PPO stage, then profiles the
next -- in PPO the next experience, after its rollout -- with torch's profiler (memory events: every op's
allocations less its frees, in order) and prints the peak of the running sum over its start (the tensors alive
at once) and the RSS growth over the same span, beside the physics' transient terms for the same run.
Allocations of 256 MiB or more are listed apart: DeepSpeed's reduce bucket is allocated whole
(`reduce_bucket_size` values) but only the pages a backward writes become resident.

    torchrun --standalone --nproc_per_node 2 scripts/diagnostics/step_live_bytes.py framework=trlx stage=rm \
        model=glm-base precision=fp32 zero=2 prompt_len=128 answer_len=128 batch=2 launcher.nproc=2

Rank 0 prints; any framework with a memory model; `stage=sft|rm|ppo`; in PPO, `PHASE=training` profiles the
update over a whole step's experience instead (made before the profiled span). Over that update the running
sum is not a census: trlx's 16 minibatches leave frees the profiler does not attribute to an op, and it climbs
to 1,910 MiB (llama-base, ZeRO-2, batch 2) while RSS rises 538. Autograd's saved tensors
(`torch.autograd.graph.saved_tensors_hooks`) count what a backward keeps exactly (docs/planner.md).
"""

from __future__ import annotations

import os
import sys
from functools import partial

import psutil
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench.plan.predict import physics  # noqa: E402
from bench.run.config import compose  # noqa: E402
from bench.run.spec import spec_from_config  # noqa: E402
from scripts.diagnostics.diagnostic_rank import DiagnosticRank  # noqa: E402

MIB = 2**20
PHASE = os.environ.get("PHASE")  # ppo: experience (default) or training
WHOLE = 256 * MIB  # allocations this large are buffers allocated whole (a reduce bucket), listed apart


def live_peak(events: list) -> tuple[float, float]:
    """(peak of the running sum of the ops' own allocations less frees, in start order; the same without the
    allocations of WHOLE bytes or more)."""
    live = peak = whole = peak_small = 0.0
    for event in sorted(events, key=lambda e: e.time_range.start):
        change = event.self_cpu_memory_usage
        live += change
        if change >= WHOLE:
            whole += change
        elif change <= -WHOLE:
            whole = max(0.0, whole + change)
        peak, peak_small = max(peak, live), max(peak_small, live - whole)
    return peak, peak_small


def resident_high_water(start: int) -> int:
    """How far this process's resident high-water mark (VmHWM) stands above `start` bytes; the profiled span
    reset it first (Linux: /proc/self/clear_refs), so it is the span's own peak."""
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return hwm - start


def reset_high_water() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main(overrides: list[str]) -> None:
    spec = spec_from_config(compose(overrides))
    run = DiagnosticRank.start(spec)
    stage = run.stage
    run.step(0)  # warm-up: Adam's moments and the engines' lazily made buffers exist from here on
    phase = PHASE or ("experience" if stage == "ppo" else "training")
    if stage != "ppo" and phase != "training":
        raise SystemExit(f"PHASE={phase}: {stage} profiles its training step only")
    if stage == "ppo" and phase == "experience":
        rollout = run.adapter.generate(run.data.prompts(1))
        work = partial(run.adapter.make_experience, rollout)
    elif stage == "ppo":  # the update over a whole step's experience, made before the profiled span
        experiences = [run.experience(1 + k) for k in range(run.adapter.rollouts_per_step())]
        work = partial(run.adapter.ppo_train, experiences)
    else:
        work = partial(run.step, 1)
    reset_high_water()
    rss = psutil.Process().memory_info().rss
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        work()
    high_water = resident_high_water(rss)
    peak, peak_small = live_peak([e for e in prof.events() if e.self_cpu_memory_usage])
    terms = (physics(spec, stage, run.device.type) or {}).get(phase)
    if run.rank == 0:
        quant = f" reference.quant={spec.reference.quant} reward.quant={spec.reward.quant}" if stage == "ppo" else ""
        print(f"{spec.framework} {stage} {spec.model.name} {spec.precision} ZeRO-{spec.zero} LoRA {spec.lora}{quant}, "
              f"{phase}: torch's live bytes over its start peak at {peak / MIB:,.0f} MiB, "
              f"{peak_small / MIB:,.0f} MiB without allocations of {WHOLE // MIB} MiB or more; RSS rose "
              f"{high_water / MIB:,.0f} MiB")
        if terms is not None:
            print(f"  physics ({phase}): gradients {terms.grads / MIB:,.0f}, buffers {terms.buffers / MIB:,.0f}, "
                  f"activations {terms.activations / MIB:,.0f}, logits {terms.logits / MIB:,.0f}, cache "
                  f"{terms.cache / MIB:,.0f} MiB")
    run.adapter.close()


if __name__ == "__main__":
    main(sys.argv[1:])
