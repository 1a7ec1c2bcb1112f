"""Each framework's plan on one GPU, predicted against measured: `python scripts/gpu_plans.py --out DIR`.

For every framework: `python -m bench.plan framework=X` plans glm-base PPO (bf16, 128 + 128 tokens, 2 prompts a
step) for this one GPU (its total_memory as torch reports it), and `python -m bench.run plan=FILE` runs the plan it
wrote (1 warm-up + 2 timed steps, the 5-step RM prerequisite first, actor from random weights). The summary
(`summary.md`, `summary.json`) sets, per framework and phase, the plan's figure (X's own memory model on a GPU,
GiB per GPU) beside the run's (the allocator's peak growth over the post-import baseline), n = 1 run each.
Without CUDA it refuses (exit 2); `--dry-run` prints the commands. About 1-2 minutes a framework.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import yaml

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from adapters import registry  # noqa: E402
from bench.plan.cluster import GPUS  # noqa: E402

GIB = 2**30
WORKLOAD = ("model=glm-base", "cluster.nodes=1", "cluster.gpus_per_node=1", "workload.precision=bf16",
            "workload.micro_batch=2", "workload.global_batch=2", "workload.prompt_len=128", "workload.answer_len=128")
RUN = ("steps=3", "warmup_steps=1", "stage_steps.rm=5", "init.sft_prerequisite=false", "launcher.device=cuda",
       "launcher.timeout_s=300", "seed=1")


def gpu_keys(name: str, total_gib: float) -> list[str]:
    """The planner's keys for this device: the table's card of that name where there is one (its speed for the
    step-time estimate), with the device's own total_memory."""
    known = next((g for g in GPUS if g.split("-")[0] in name.replace(" ", "")), "H100-80GB")
    return [f"cluster.gpu={known}", f"cluster.gpu_memory_gib={total_gib:.2f}"]


def commands(framework: str, out: str, device_keys: list[str]) -> tuple[list[str], list[str]]:
    plan = os.path.join(out, f"plan-{framework}.yaml")
    return ([sys.executable, "-m", "bench.plan", *WORKLOAD, *device_keys, f"framework={framework}", f"out={plan}"],
            [sys.executable, "-m", "bench.run", f"plan={plan}", *RUN, f"output_root={out}",
             f"run_name=plan-{framework}"])


def compare(out: str, framework: str) -> dict[str, Any]:
    """The plan's per-phase figures beside the record's measured growth, GiB per GPU."""
    plan_path = os.path.join(out, f"plan-{framework}.yaml")
    record_path = os.path.join(out, f"plan-{framework}", "record.json")
    if not os.path.exists(plan_path) or not os.path.exists(record_path):
        return {"status": "missing", "phases": {}}
    with open(plan_path) as f:
        plan = yaml.safe_load(f)
    with open(record_path) as f:
        record = json.load(f)
    stage = (record.get("stages") or {}).get("ppo") or {}
    measured = (stage.get("memory") or {}).get("phases") or {}
    planned = plan["predicted"]["phase_gib_per_gpu"]
    phases = {}
    for phase, gib in planned.items():
        grown = (measured.get(phase) or {}).get("growth_over_baseline_bytes")
        phases[phase] = {"planned_gib": gib, "measured_gib": round(grown / GIB, 2) if grown else None,
                         "error": round(gib / (grown / GIB) - 1, 3) if grown else None}
    return {"status": record.get("status"), "layout": plan["framework"]["layout"], "phases": phases}


def render(summary: dict[str, Any]) -> str:
    lines = [f"Device: {summary['device']} ({summary['total_gib']:.2f} GiB total_memory). glm-base PPO, bf16, "
             "128 + 128 tokens, batch 2, 1 rank; planned = the framework's memory model on a GPU (GiB per GPU); "
             "measured = allocator peak growth over the post-import baseline; error = planned / measured - 1; n = 1.",
             "", "| framework | layout | phase | planned GiB | measured GiB | error |", "|---|---|---|---|---|---|"]
    for framework, entry in summary["frameworks"].items():
        if not entry["phases"]:
            lines.append(f"| {framework} | {entry['status']} | | | | |")
        for phase, row in entry["phases"].items():
            error = f"{row['error']:+.0%}" if row["error"] is not None else "-"
            lines.append(f"| {framework} | {entry.get('layout', '')} | {phase} | {row['planned_gib']} | "
                         f"{row['measured_gib'] if row['measured_gib'] is not None else '-'} | {error} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/gpu-plans", help="folder for the plans, records and summary")
    parser.add_argument("--budget-s", type=float, default=480.0, help="start no framework after this many seconds")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    args = parser.parse_args(argv)
    if args.dry_run:
        for framework in registry.names():
            for cmd in commands(framework, args.out, ["cluster.gpu=H100-80GB"]):
                print(" ".join(cmd[1:]))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_plans: no CUDA device is visible; this check never falls back to the CPU", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    total = props.total_memory / GIB
    device_keys = gpu_keys(props.name, total)
    os.makedirs(args.out, exist_ok=True)
    start = time.monotonic()
    for framework in registry.names():
        if time.monotonic() - start > args.budget_s:
            print(f"budget spent: {framework} and after not started", flush=True)
            break
        for cmd in commands(framework, args.out, device_keys):
            print(f"[{time.monotonic() - start:5.0f} s] {' '.join(cmd[1:3])} ...", flush=True)
            if subprocess.run(cmd, check=False).returncode not in (0, 1):
                break
    summary = {"device": props.name, "total_gib": total,
               "frameworks": {f: compare(args.out, f) for f in registry.names()}}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    text = render(summary)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
