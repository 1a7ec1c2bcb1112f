"""The GPU check: the key configurations of every adapter on one CUDA device, into one folder.

    python scripts/gpu_check.py --out results/gpu-check     # needs CUDA: refuses to run (exit 2) without it
    python scripts/gpu_check.py --dry-run                    # prints the runs and their order, runs nothing

Every check is one PPO run (its prerequisite RM trains first, 5 steps) on one rank in bf16 with 128 prompt +
128 answer tokens, batch 2, 1 warm-up + 3 timed steps, each through `python -m bench.run` (its own process
tree), with `launcher.device=cuda`: never the CPU. The checks run in the order below, most important first,
and a run is not started once `--budget-s` has passed, so a slow device cuts the tail, never the core:
glm-base at ZeRO-2 in every framework, DS-Chat's Hybrid Engine on against off, ZeRO-3 (on one GPU it
shards nothing: it checks the path and its buffers), LoRA 64, glm-large at ZeRO-2, and the plain-PyTorch
reference where it is registered. Measured on an H200: 70-170 s a run (the first run of a framework trains its
RM prerequisite and JIT-compiles the engine's CUDA ops), so the default budget covers the first 3-5 checks and
`--only` picks the rest.

The summary (`summary.md`, `summary.json`): per run its status, per phase the peak of allocated memory, of
reserved memory (the caching allocator's pool) and NVML's figure for the process (read once, at the stage's
end; what neither allocator figure holds is CUDA context and communication buffers), tokens/s of each phase,
the step's TFLOP/s and MFU against the device's dense bf16 peak (bench/results/collect.py's table; none for an
unknown device), and the Hybrid Engine's generation speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from adapters import registry  # noqa: E402
from bench.results.collect import collect  # noqa: E402
from bench.results.record import PHASE_ORDER  # noqa: E402

MIB = 2**20
# PPO's actor from random weights (init.sft_prerequisite=false): the check measures memory and speed, whose
# shapes an SFT start does not change, and a prerequisite SFT run per framework would cost its time budget
COMMON = ("stage=ppo", "precision=bf16", "prompt_len=128", "answer_len=128", "batch=2", "steps=4",
          "warmup_steps=1", "stage_steps.rm=5", "init.sft_prerequisite=false", "launcher.nproc=1",
          "launcher.device=cuda", "launcher.timeout_s=300", "seed=1")
FRAMEWORKS = ("dschat", "colossalai", "trlx")
REFERENCE = "torch"  # the plain-PyTorch yardstick, checked once it is registered


@dataclass(frozen=True)
class Check:
    name: str
    overrides: tuple[str, ...]
    why: str


def checks(frameworks: tuple[str, ...]) -> list[Check]:
    """The runs, most important first."""
    runs = [Check(f"base-z2-{f}", (f"framework={f}", "model=glm-base", "zero=2", "lora=0"),
                  "glm-base, ZeRO-2, full fine-tuning: the core comparison") for f in FRAMEWORKS]
    runs.append(Check("base-z2-dschat-he", ("framework=dschat", "model=glm-base", "zero=2", "lora=0",
                                            "framework.hybrid_engine=true"),
                      "DS-Chat's Hybrid Engine on (its inference kernels exist only on CUDA): with GPT-2 layers an "
                      "`unsupported` record naming deepspeed-0.19.8-hybrid-engine-gpt2-container"))
    runs += [Check(f"base-z3-{f}", (f"framework={f}", "model=glm-base", "zero=3", "lora=0"),
                   "ZeRO-3 path (Gemini for coati) and its buffers; on one GPU nothing is sharded") for f in FRAMEWORKS]
    runs += [Check(f"base-z2-lora64-{f}", (f"framework={f}", "model=glm-base", "zero=2", "lora=64"),
                   "LoRA 64 against full fine-tuning") for f in FRAMEWORKS]
    runs += [Check(f"large-z2-{f}", (f"framework={f}", "model=glm-large", "zero=2", "lora=0"),
                   "glm-large, the ladder's next rung") for f in FRAMEWORKS]
    if REFERENCE in frameworks:
        runs.append(Check(f"base-z2-{REFERENCE}", (f"framework={REFERENCE}", "model=glm-base", "zero=2", "lora=0"),
                          "the plain-PyTorch reference"))
    return runs


def command(check: Check, out: str) -> list[str]:
    return [sys.executable, "-m", "bench.run", *COMMON, *check.overrides, f"output_root={out}",
            f"run_name={check.name}"]


def _mib(value: Any) -> str:
    return f"{value / MIB:,.0f}" if isinstance(value, (int, float)) else "-"


def _record(out: str, name: str) -> dict[str, Any] | None:
    path = os.path.join(out, "runs", name, "record.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def summarize(out: str, names: list[str]) -> dict[str, Any]:
    """Per run: status, per-phase allocated / reserved peaks and NVML, tokens/s per phase, TFLOP/s, MFU."""
    rows = {os.path.basename(r["run"]): r for r in collect(out).rows}
    runs: dict[str, Any] = {}
    for name in names:
        record = _record(out, name)
        if record is None:
            runs[name] = {"status": "not run"}
            continue
        stage = record["stages"].get("ppo") or {}
        memory = stage.get("memory") or {}
        outside = (memory.get("outside_allocator_per_rank") or [{}])[0] or {}
        row = rows.get(name, {})
        runs[name] = {
            "status": record["status"],
            "error": (stage.get("error") or {}).get("message"),
            "gpu": (record.get("environment") or {}).get("gpu"),
            "phases": {phase: {"allocated_peak_bytes": entry.get("allocated_peak_bytes"),
                               "reserved_peak_bytes": entry.get("reserved_peak_bytes"),
                               "tokens_per_s": row.get(f"tokens_per_s_{phase}")}
                       for phase, entry in sorted((memory.get("phases") or {}).items(),
                                                  key=lambda kv: PHASE_ORDER.index(kv[0])) if phase != "imports"},
            "nvml_process_bytes": outside.get("nvml_process_bytes"),
            "outside_allocator_bytes": outside.get("outside_allocator_bytes"),
            "tflops_per_s": row.get("tflops_per_s_rank0"),
            "mfu": row.get("mfu"),
        }
    he, plain = runs.get("base-z2-dschat-he", {}), runs.get("base-z2-dschat", {})
    speeds = [(r.get("phases") or {}).get("generation", {}).get("tokens_per_s") for r in (he, plain)]
    speedup = speeds[0] / speeds[1] if all(isinstance(s, (int, float)) and s for s in speeds) else None
    return {"runs": runs, "hybrid_engine_generation_speedup": speedup}


def render(summary: dict[str, Any]) -> str:
    lines = ["# GPU check", "",
             "One rank, bf16, PPO 128 + 128 tokens, batch 2, 1 warm-up + 3 timed steps. Memory in MiB: "
             "allocated = torch.cuda.max_memory_allocated per phase (tensors alive), reserved = "
             "max_memory_reserved (the caching allocator's pool), NVML = the process's device memory read once "
             "at the stage's end (outside = NVML - reserved: CUDA context, communication buffers). Tokens/s per "
             "phase on this rank; TFLOP/s of the whole step (the shared FLOPs formula); MFU against the "
             "device's dense bf16 peak.", "",
             "| run | status | phase | allocated | reserved | tokens/s |", "|---|---|---|---|---|---|"]
    for name, run in summary["runs"].items():
        phases = run.get("phases") or {"-": {}}
        for phase, entry in phases.items():
            tokens = entry.get("tokens_per_s")
            lines.append(f"| {name} | {run['status']} | {phase} | "
                         f"{_mib(entry.get('allocated_peak_bytes'))} | {_mib(entry.get('reserved_peak_bytes'))} | "
                         f"{f'{tokens:,.0f}' if isinstance(tokens, (int, float)) else '-'} |")
    lines += ["", "| run | NVML MiB | outside the allocator MiB | TFLOP/s | MFU | error |", "|---|---|---|---|---|---|"]
    for name, run in summary["runs"].items():
        tflops, mfu = run.get("tflops_per_s"), run.get("mfu")
        lines.append(f"| {name} | {_mib(run.get('nvml_process_bytes'))} | {_mib(run.get('outside_allocator_bytes'))} "
                     f"| {f'{tflops:.1f}' if tflops else '-'} | {f'{100 * mfu:.1f} %' if mfu else '-'} | "
                     f"{(run.get('error') or '')[:120]} |")
    speedup = summary.get("hybrid_engine_generation_speedup")
    lines += ["", f"DS-Chat Hybrid Engine, generation tokens/s on / off: "
                  f"{f'{speedup:.2f}x' if speedup else 'not measured (a run missing or failed)'}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/gpu-check", help="folder for the records and the summary")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="start no run after this many seconds (default 420: ends within ~8 minutes)")
    parser.add_argument("--only", default="", help="comma-separated run names (default: all, in order)")
    parser.add_argument("--dry-run", action="store_true", help="print the runs and exit")
    args = parser.parse_args(argv)
    plan = checks(registry.names())
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - {c.name for c in plan})
        if unknown:
            print(f"--only: unknown run(s) {', '.join(unknown)}; allowed: {', '.join(c.name for c in plan)}",
                  file=sys.stderr)
            return 2
        plan = [c for c in plan if c.name in wanted]
    if args.dry_run:
        for i, check in enumerate(plan, 1):
            print(f"{i:2}. {check.name}: {check.why}\n    {' '.join(command(check, args.out)[1:])}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible (torch.cuda.is_available() is False); this check never "
              "falls back to the CPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    start = time.monotonic()
    for i, check in enumerate(plan, 1):
        elapsed = time.monotonic() - start
        if elapsed > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent: {len(plan) - i + 1} run(s) not started", flush=True)
            break
        print(f"[{i}/{len(plan)} {elapsed:5.0f} s] {check.name}", flush=True)
        subprocess.run(command(check, args.out), check=False)
    summary = summarize(args.out, [c.name for c in plan])
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    text = render(summary)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text)
    print(text)
    return 0 if all(r["status"] == "ok" for r in summary["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
