"""What `python -m bench.plan framework=X|all` prints and writes: a framework's fitting plans with the commands
that run them, or every framework side by side with the role-by-role search (`any`) beside them."""

from __future__ import annotations

import os
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from adapters import registry
from bench.plan import plan_file
from bench.plan.cluster import Cluster, Workload
from bench.plan.framework_plans import (
    GIB,
    FrameworkPlan,
    FrameworkResult,
    PlanInputError,
    plan_document,
    with_variants,
)
from bench.plan.physics import Arch
from bench.plan.search import plan_with_variants

FRAMEWORK_CHOICES = ("any", "all", *registry.names())
# the phases shown side by side (ColossalChat's onload/offload hold what its generation holds at most)
SHOWN_PHASES = ("init", "generation", "experience", "training")


def model_overrides(args: list[str]) -> list[str]:
    """The command line's model keys, given to the run specification each framework's plans are built from."""
    return [a for a in args if a.split("=", 1)[0] == "model" or a.startswith("model.")]


def _gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def _variant(result: FrameworkResult, workload: Workload) -> str:
    return result.variant if result.variant != "as asked" else (
        f"LoRA {workload.lora}" if workload.lora else "full fine-tuning")


def _plan_line(plan: FrameworkPlan) -> str:
    phases = ", ".join(f"{p} {_gib(t.device)}" for p, t in plan.phases.items())
    return (f"peak {_gib(plan.peak)} GiB/GPU ({phases}), host {plan.host_per_node / GIB:.0f} GiB/node, "
            f"~{plan.step_seconds:.1f} s/step, micro-batch {plan.workload.micro_batch} x {plan.grad_accum} "
            "accumulated")


def framework_main(framework: str, config: dict[str, Any], args: list[str], context: tuple, console: Console) -> int:
    name, arch, critic_arch, cluster, workload = context
    if config.get("critic_model"):
        console.print(f"[red]critic_model={config['critic_model']!r} with framework={framework}: the harness builds "
                      "critic and reward from the run's model; plan a separate critic with framework=any[/red]")
        return 2
    space = registry.plan_space(framework)
    start = time.perf_counter()
    try:
        results = with_variants(framework, model_overrides(args), arch, critic_arch, cluster, workload)
    except PlanInputError as err:
        console.print(f"[red]{err}[/red]")
        return 2
    top = int(config["top"])
    chosen = None
    for result in results:
        if not result.plans:
            console.print(f"[red]No {framework} plan fits[/red] ({_variant(result, workload)}): {result.why_not()}")
            continue
        console.print(f"[green]{len(result.plans)} {framework} layout(s) fit[/green] ({_variant(result, workload)}) "
                      f"of {result.evaluated} in its space; fastest first (memory: adapters/"
                      f"{registry.package(framework)}/memory.py on a GPU; time: bench/plan/cost.py):")
        for plan in result.plans[:top]:
            console.print(f"  {plan.terms}\n    {_plan_line(plan)}\n    layouts: "
                          f"{plan.notation}")
        chosen = chosen or result
    refused = results[0].refused
    if refused:
        console.print(f"refused by {framework}'s own option check ({sum(refused.values())} layouts):")
        for reason, count in refused.most_common(3):
            console.print(f"  {count} x {reason}")
    for knob, why in space.declared_only:
        console.print(f"not searched: {knob} ({why})")
    console.print(f"searched {sum(r.evaluated for r in results)} {framework} layouts in "
                  f"{time.perf_counter() - start:.2f} s")
    if chosen is None:
        return 1
    best = chosen.plans[0]
    out = config.get("out") or os.path.join("results", "plans", f"{name}-{cluster.nodes}x{cluster.gpus_per_node}x"
                                                                 f"{cluster.gpu.lower()}-{framework}.yaml")
    doc = plan_document(best, config["model"] if isinstance(config["model"], str) else name, None, cluster)
    plan_file.write(doc, out, f"# written by python -m bench.plan framework={framework} ({chosen.variant})\n")
    console.print(f"plan written to {out}\n  run it:  {best.harness_command(out)}\n  in {framework}'s own terms:  "
                  f"{best.command}")
    return 0


def all_main(config: dict[str, Any], args: list[str], context: tuple, console: Console) -> int:
    """Every framework's best plan side by side, ranked by the estimated step time, and `any` beside them."""
    name, arch, critic_arch, cluster, workload = context
    start = time.perf_counter()
    rows: list[tuple[float, list[str]]] = []
    for framework in registry.names():
        rows.append(_framework_row(framework, config, args, arch, critic_arch, cluster, workload))
    rows.append(_any_row(arch, critic_arch, cluster, workload))
    rows.sort(key=lambda r: r[0])
    lora = f"LoRA {workload.lora}" if workload.lora else "full fine-tuning"
    table = Table(title=f"{name} on {cluster.nodes} x {cluster.gpus_per_node} {cluster.gpu} (limit "
                        f"{cluster.limit_bytes / GIB:.1f} GiB/GPU), {workload.prompt_len}+{workload.answer_len} "
                        f"tokens, {workload.global_batch} prompts a step, {workload.precision}, {lora}: each "
                        "framework's fastest plan that fits, GiB per GPU per phase", title_justify="left")
    for column in ("framework", "fits", "its fastest layout, in its own terms", *SHOWN_PHASES, "host/node",
                   "s/step", "why not / note"):
        table.add_column(column, justify="right" if column in (*SHOWN_PHASES, "host/node", "s/step") else "left")
    for _, cells in rows:
        table.add_row(*cells)
    console.print(table)
    console.print("GiB per GPU, the busiest rank, per phase: each framework's own memory model (adapters/<framework>/"
                  "memory.py) on a GPU, uncalibrated; `any`: the generic role-by-role model (bench/plan/cluster.py), "
                  "whose phases are generation, inference (experience) and training. s/step: bench/plan/cost.py's "
                  "estimate, for ranking. `python -m bench.plan framework=X` prints X's plans and writes the best.")
    console.print(f"planned in {time.perf_counter() - start:.2f} s")
    return 0 if any(cells[1] == "yes" for _, cells in rows) else 1


def _framework_row(framework: str, config: dict[str, Any], args: list[str], arch: Arch, critic_arch: Arch,
                   cluster: Cluster, workload: Workload) -> tuple[float, list[str]]:
    if config.get("critic_model"):
        return _not_run(framework, "-", "critic_model: the harness builds critic and reward from the run's model")
    try:
        results = with_variants(framework, model_overrides(args), arch, critic_arch, cluster, workload)
    except PlanInputError as err:
        return _not_run(framework, "-", str(err))
    found = next((r for r in results if r.plans), None)
    if found is None:
        return _not_run(framework, "no", results[0].why_not())
    best = found.plans[0]
    phases = [_gib(_shown(best, p)) for p in SHOWN_PHASES]
    return best.step_seconds, [framework, _fits(found.variant), best.terms, *phases,
                               f"{best.host_per_node / GIB:.0f}", f"{best.step_seconds:.1f}",
                               f"{len(found.plans)} of {found.evaluated} layouts fit"]


def _not_run(framework: str, fits: str, why: str) -> tuple[float, list[str]]:
    return float("inf"), [framework, fits, "", *[""] * len(SHOWN_PHASES), "", "", why]


def _fits(variant: str) -> str:
    """`yes`, or which variant it takes (when nothing fits full fine-tuning as asked)."""
    return "yes" if variant == "as asked" else f"with {variant}"


def _shown(plan: FrameworkPlan, phase: str) -> float:
    if phase == "generation":  # ColossalChat moves its inference models on before generation
        return max(plan.phases[p].device for p in ("onload", "generation") if p in plan.phases)
    if phase == "training":
        return max(plan.phases[p].device for p in ("offload", "training") if p in plan.phases)
    return plan.phases[phase].device if phase in plan.phases else 0.0


def _any_row(arch: Arch, critic_arch: Arch, cluster: Cluster, workload: Workload) -> tuple[float, list[str]]:
    results = plan_with_variants(arch, workload, cluster, critic_arch if critic_arch != arch else None)
    found = next((r for r in results if r.plans), None)
    if found is None:
        return _not_run("any", "no", "no role-by-role layout fits")
    best = found.plans[0]
    by_phase = {p: max(g.phases[p].device for g in best.groups if p in g.phases)
                for p in ("generation", "inference", "training")}
    layouts = ", ".join(f"{r} {lay.notation}" for r, lay in best.layouts.items())
    return best.step_seconds, ["any", _fits(found.variant), f"{best.placement}: {layouts}", "",
                               _gib(by_phase["generation"]), _gib(by_phase["inference"]), _gib(by_phase["training"]),
                               f"{best.host_per_node / GIB:.0f}", f"{best.step_seconds:.1f}",
                               "role by role: no compared framework runs it"]
