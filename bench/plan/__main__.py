"""`python -m bench.plan [KEY=VALUE ...]`: per-GPU memory of RLHF (PPO) per role and phase, and the execution
plans that fit; `python -m bench.plan --check plan=FILE [KEY=VALUE ...]`: what in a hand-written plan would
run out of memory, where, by how much, and what would fix it.

framework=any (default): the role-by-role search (layouts for a custom system); framework=dschat|colossalai|trlx|
trl|torch: that framework's own layout space on its own memory model, with the commands that run its plans;
framework=all: every framework side by side.

Keys: conf/planner.yaml (framework, model, critic_model, cluster.*, workload.*, top, out). Nothing is launched and no
framework is imported. Exit status: 0 a plan fits (or the checked plan fits), 1 none fits, 2 bad input.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from bench.plan import plan_file
from bench.plan.cluster import PHASES, ROLE_PHASES, ROLES, Cluster, Layout, Role, Workload, resident, role_phase
from bench.plan.framework_cli import FRAMEWORK_CHOICES, all_main, framework_main
from bench.plan.model_state import deepspeed_zero2_estimate, deepspeed_zero3_estimate, zero_paper_bytes
from bench.plan.search import (
    GIB,
    PLACEMENTS,
    Plan,
    SearchResult,
    divides_heads,
    evaluate,
    make_roles,
    plan_with_variants,
)

COLUMNS = ("params", "grads", "optimizer", "activations", "cache", "logits", "lora", "buffers", "host")


def _gib(value: float) -> str:
    return f"{value / GIB:,.2f}" if value else "-"


def compose(overrides: list[str]) -> dict[str, Any]:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from bench.run.config import CONF_DIR, to_plain

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return to_plain(hydra_compose(config_name="planner", overrides=overrides))


def dtype_problem(cluster: Cluster, workload: Workload) -> str | None:
    if workload.precision == "bf16" and not cluster.spec.bf16:
        return (f"workload.precision=bf16 is not supported on {cluster.gpu} (no bf16 tensor cores); use fp16 "
                "(dynamic loss scaling) or fp32")
    return None


def breakdown_table(plan: Plan, workload: Workload, title: str) -> Table:
    """Per role and phase: its per-GPU bytes by term (resident + what the phase adds), and activations at the
    other recomputation setting for comparison."""
    table = Table(title=title, title_justify="left")
    for column in ("role", "layout", "phase", *COLUMNS, "activations, other recompute", "role total"):
        table.add_column(column, justify="left" if column in ("role", "layout", "phase") else "right")
    for role in ROLES:
        r, lay = plan.roles[role], plan.layouts[role]
        base = resident(r, lay, workload)
        for phase in ROLE_PHASES[role]:
            terms = base + role_phase(r, lay, workload, phase)
            other = role_phase(r, replace(lay, recompute=not lay.recompute), workload, phase).activations \
                if r.trained and phase == "training" else None
            table.add_row(role, lay.notation, phase, *(_gib(getattr(terms, c)) for c in COLUMNS),
                          _gib(other) if other is not None else "", _gib(terms.device))
        table.add_section()
    return table


def groups_table(plan: Plan) -> Table:
    table = Table(title=f"per GPU, roles together (limit {plan.limit / GIB:.1f} GiB)", title_justify="left")
    for column in ("GPUs", "roles", *PHASES, "peak", "fits"):
        table.add_column(column, justify="left" if column in ("roles", "fits") else "right")
    for group in plan.groups:
        cells = [_gib(group.phases[p].device) if p in group.phases else "" for p in PHASES]
        table.add_row(str(group.gpus), "+".join(group.roles), *cells, _gib(group.peak),
                      "yes" if group.peak <= plan.limit else "NO")
    return table


def calculators_line(plan: Plan, cluster: Cluster) -> str | None:
    """What the public model-state formulas say for the actor's layout, beside this model's whole figure:
    they count weights, gradients and optimizer states only (memory-and-stability.md 1.1, 1.2)."""
    actor, lay = plan.roles["actor"], plan.layouts["actor"]
    if actor.lora or lay.dp < 1:
        return None
    shard = actor.params // (lay.tp * lay.pp)
    per_node = min(lay.dp, cluster.gpus_per_node)
    nodes = max(1, lay.dp // per_node)
    paper = zero_paper_bytes(shard, lay.zero, lay.dp).total
    if lay.zero >= 3:
        deepspeed = deepspeed_zero3_estimate(shard, actor.arch.largest_layer_params // lay.tp, per_node, nodes,
                                             cpu_offload=lay.offload, cpu_offload_params=lay.offload).device
    else:
        deepspeed = deepspeed_zero2_estimate(shard, per_node, nodes, cpu_offload=lay.offload).device
    group = next(g for g in plan.groups if "actor" in g.roles)
    return (f"the actor's model states alone ({lay.notation}), per GPU: the ZeRO paper {paper / GIB:.1f} GiB, "
            f"DeepSpeed's estimator {deepspeed / GIB:.1f} GiB; this model, everything its GPUs hold at their "
            f"peak: {group.peak / GIB:.1f} GiB")


def _layouts_line(plan: Plan) -> str:
    return ", ".join(f"{r} {plan.layouts[r].notation}" for r in ROLES)


def _predicted(plan: Plan) -> dict[str, Any]:
    return {"peak_gib_per_gpu": round(plan.peak / GIB, 2), "limit_gib": round(plan.limit / GIB, 2),
            "host_gib_per_node": round(plan.host_per_node / GIB, 1),
            "phase_gib_per_gpu": {"+".join(g.roles): {p: round(t.device / GIB, 2) for p, t in g.phases.items()}
                                  for g in plan.groups},
            "step_seconds_estimate": round(plan.step_seconds, 2),
            "phase_seconds_estimate": {p: round(s, 2) for p, s in plan.seconds.items()}}


def _print_result(console: Console, result: SearchResult, workload: Workload, top: int) -> None:
    lora = f"LoRA {workload.lora}" if workload.lora else "full fine-tuning"
    lora = result.variant if "LoRA" in result.variant else f"{result.variant}, {lora}"
    if not result.plans and not result.rejected:
        console.print(f"[red]No plan fits[/red] ({lora}): no layout gives every data-parallel rank a whole number of "
                      f"micro-batches: global_batch={workload.global_batch} prompts a step at micro-batch "
                      f"{workload.micro_batch} over {result.gpus} GPUs (dp = GPUs / (tp x pp), tp inside a node, pp "
                      "dividing the blocks); raise workload.global_batch or use fewer GPUs")
        return
    if not result.plans:
        console.print(f"[red]No plan fits[/red] ({lora}). Why the layouts tried do not fit:")
        for plan in result.rejected:
            console.print(f"  {plan.placement}: {_layouts_line(plan)}")
            for line in plan.overflows():
                console.print(f"    - {line}")
        return
    console.print(f"[green]{len(result.plans)} placement(s) fit[/green] ({lora}); fastest first "
                  "(estimated step time: bench/plan/cost.py):")
    for plan in result.plans[:top]:
        console.print(f"  {plan.placement}: peak {plan.peak / GIB:.1f} GiB/GPU, host {plan.host_per_node / GIB:.0f} "
                      f"GiB/node, ~{plan.step_seconds:.1f} s/step | {_layouts_line(plan)}")
    if result.rejected:
        console.print("  rejected (do not fit):")
        for plan in result.rejected:
            first = plan.overflows()[0] if plan.overflows() else ""
            console.print(f"    {plan.placement}: {first}")


def plan_main(config: dict[str, Any], console: Console, args: list[str] | None = None) -> int:
    top = config.get("top")
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        console.print(f"[red]top={top!r} must be an integer >= 1 (the fitting plans printed per variant)[/red]")
        return 2
    framework = config.get("framework") or "any"
    if framework not in FRAMEWORK_CHOICES:
        console.print(f"[red]framework={framework!r} is not known; allowed: {', '.join(FRAMEWORK_CHOICES)}[/red]")
        return 2
    context = plan_file.context(config)
    name, arch, critic_arch, cluster, workload = context
    problem = dtype_problem(cluster, workload)
    if problem:
        console.print(f"[red]{problem}[/red]")
        return 2
    if framework == "all":
        return all_main(config, args or [], context, console)
    if framework != "any":
        return framework_main(framework, config, args or [], context, console)
    console.print("framework=any: the role-by-role search. Its layouts are execution plans for a custom system; "
                  "no compared framework runs them as they stand (framework=X searches X's own space)")
    console.print(f"{name}: {arch.total_params / 1e9:.2f} B parameters per role; {cluster.nodes} node(s) x "
                  f"{cluster.gpus_per_node} {cluster.gpu} of "
                  f"{cluster.total_memory_bytes / GIB:.2f} GiB (torch's total_memory), limit "
                  f"{cluster.limit_bytes / GIB:.1f} GiB/GPU; batch {workload.micro_batch} x "
                  f"{workload.prompt_len}+{workload.answer_len} tokens, {workload.precision}")
    start = time.perf_counter()
    results = plan_with_variants(arch, workload, cluster, critic_arch if critic_arch != arch else None)
    elapsed = time.perf_counter() - start
    chosen: tuple[SearchResult, Plan] | None = None
    for result in results:
        w = replace(workload, lora=result.plans[0].roles["actor"].lora) if result.plans else workload
        _print_result(console, result, w, top)
        if result.plans and chosen is None:
            chosen = (result, result.plans[0])
    if len(results) > 1:
        console.print("[yellow]No plan fits full fine-tuning as asked; the variants above change it (LoRA on actor "
                      "and critic, ZeRO-Offload of the optimizer to host memory).[/yellow]")
    console.print(f"searched {sum(r.evaluated for r in results)} role-layout combinations in {elapsed:.2f} s")
    if chosen is None:
        return 1
    result, best = chosen
    w = replace(workload, lora=best.roles["actor"].lora)
    console.print(breakdown_table(best, w, f"best plan ({result.variant}): {best.placement}, per GPU, GiB"))
    console.print(groups_table(best))
    calculators = calculators_line(best, cluster)
    if calculators:
        console.print(calculators)
    out = config.get("out") or os.path.join("results", "plans", f"{name}-{cluster.nodes}x{cluster.gpus_per_node}x"
                                                                 f"{cluster.gpu.lower()}.yaml")
    groups = PLACEMENTS[best.placement]
    doc = plan_file.document(name, config.get("critic_model"), cluster, w, best.placement, best.layouts, groups,
                             _predicted(best))
    plan_file.write(doc, out, f"# written by python -m bench.plan ({result.variant}); check it with\n"
                              f"#   python -m bench.plan --check plan={out}\n")
    console.print(f"plan written to {out}")
    return 0


FIXES = ("halve the micro-batch", "recomputation on", "ZeRO-3 for every role", "optimizer offload",
         "double tensor parallelism")


def _fixed(layouts: dict[str, Layout], workload: Workload, fix: str, cluster: Cluster,
           roles: dict[str, Role]) -> tuple[dict[str, Layout], Workload] | None:
    """One change to a plan that does not fit, or None where it does not apply."""
    if fix == "halve the micro-batch":
        return (layouts, replace(workload, micro_batch=workload.micro_batch // 2)) if workload.micro_batch > 1 \
            else None
    changed = {}
    for name, lay in layouts.items():
        trained = roles[name].trained
        if fix == "recomputation on" and trained and not lay.recompute:
            changed[name] = replace(lay, recompute=True)
        elif fix == "ZeRO-3 for every role" and lay.zero < 3 and lay.dp > 1:
            changed[name] = replace(lay, zero=3)
        elif fix == "optimizer offload" and trained and not lay.offload and not roles[name].lora:
            changed[name] = replace(lay, offload=True, zero=max(lay.zero, 1)) if lay.dp > 1 or lay.zero else None
        elif fix == "double tensor parallelism" and lay.dp % 2 == 0 and lay.tp * 2 <= cluster.gpus_per_node \
                and divides_heads(roles[name].arch, lay.tp * 2):
            changed[name] = replace(lay, tp=lay.tp * 2, dp=lay.dp // 2)
    changed = {k: v for k, v in changed.items() if v is not None}
    return ({**layouts, **changed}, workload) if changed else None


def check_main(path: str, overrides: dict[str, Any], console: Console) -> int:
    data = plan_file.merged(plan_file.read(path), overrides)
    name, arch, critic_arch, cluster, workload = plan_file.context(data)
    problem = dtype_problem(cluster, workload)
    if problem:
        console.print(f"[red]{problem}[/red]")
        return 2
    layouts, groups = plan_file.layouts_of(data["execution_plan"], arch, critic_arch, cluster)
    for role in ("actor", "critic"):
        per_step = workload.micro_batch * layouts[role].dp
        if workload.global_batch % per_step:
            raise plan_file.PlanError(f"workload.global_batch={workload.global_batch} is not a whole number of "
                                      f"micro-batches of {workload.micro_batch} over the {role}'s "
                                      f"{layouts[role].dp} data-parallel ranks")
    roles = make_roles(arch, workload, critic_arch)
    plan = evaluate("as written", roles, layouts, groups, workload, cluster)
    console.print(breakdown_table(plan, workload, f"{path}: {name}, per GPU, GiB"))
    console.print(groups_table(plan))
    if plan.fits:
        console.print(f"[green]fits[/green]: peak {plan.peak / GIB:.1f} GiB per GPU (limit {plan.limit / GIB:.1f}), "
                      f"~{plan.step_seconds:.1f} s/step estimated")
        return 0
    console.print("[red]does not fit[/red]:")
    for line in plan.overflows():
        console.print(f"  - {line}")
    console.print("single changes, each tried alone:")
    found = False
    for fix in FIXES:
        changed = _fixed(layouts, workload, fix, cluster, roles)
        if changed is None:
            continue
        new = evaluate(fix, make_roles(arch, changed[1], critic_arch), changed[0], groups, changed[1], cluster)
        verdict = "fits" if new.fits else "still over"
        found |= new.fits
        console.print(f"  - {fix}: peak {new.peak / GIB:.1f} GiB/GPU, host {new.host_per_node / GIB:.0f} GiB/node "
                      f"({verdict}; ~{new.step_seconds:.1f} s/step)")
    if not found:
        combined = _combined_fix(layouts, workload, cluster, arch, critic_arch, groups)
        if combined:
            console.print(f"  together: {combined}")
        else:
            console.print("  none of these, alone or together; `python -m bench.plan` with this model and cluster "
                          "searches every layout and the LoRA and offload variants")
    return 1


def _combined_fix(layouts: dict[str, Layout], workload: Workload, cluster: Cluster, arch, critic_arch,
                  groups: tuple[tuple[str, ...], ...]) -> str | None:
    """The fixes applied one after another, in FIXES's order of cost, until the plan fits."""
    applied = []
    for _ in range(6):
        for fix in ("recomputation on", "double tensor parallelism", "ZeRO-3 for every role", "halve the micro-batch",
                    "optimizer offload"):
            changed = _fixed(layouts, workload, fix, cluster, make_roles(arch, workload, critic_arch))
            if changed is None:
                continue
            layouts, workload = changed
            applied.append(fix)
            new = evaluate("combined", make_roles(arch, workload, critic_arch), layouts, groups, workload, cluster)
            if new.fits:
                shown = ", ".join(f"{r} {layouts[r].notation}" for r in ROLES)
                return (f"{' + '.join(applied)} -> peak {new.peak / GIB:.1f} GiB/GPU, micro-batch "
                        f"{workload.micro_batch}, ~{new.step_seconds:.1f} s/step ({shown})")
    return None


def _split_overrides(args: list[str]) -> tuple[str | None, list[str]]:
    plan, rest = None, []
    for arg in args:
        if arg.startswith("plan="):
            plan = arg[len("plan="):]
        else:
            rest.append(arg)
    return plan, rest


def _as_mapping(overrides: list[str]) -> dict[str, Any]:
    """KEY=VALUE overrides as a nested mapping (for --check, where the plan file is the base)."""

    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise plan_file.PlanError(f"{item!r} is not KEY=VALUE")
        head, _, tail = key.partition(".")
        parsed = yaml.safe_load(value)
        if tail:
            out.setdefault(head, {})[tail] = parsed
        else:
            out[head] = parsed
    return out


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    if any(a in ("-h", "--help") for a in args):
        console.print(__doc__)
        return 0
    check = "--check" in args
    args = [a for a in args if a != "--check"]
    unknown_flags = [a for a in args if a.startswith("-")]
    if unknown_flags:
        console.print(f"[red]unknown option(s) {unknown_flags}; allowed: --check, -h[/red]")
        return 2
    plan_path, overrides = _split_overrides(args)
    try:
        if check:
            if not plan_path:
                console.print("[red]--check needs plan=FILE (a plan YAML, e.g. conf/plan/example-8b.yaml)[/red]")
                return 2
            return check_main(plan_path, _as_mapping(overrides), console)
        if plan_path:
            console.print("[red]plan=FILE is read only with --check[/red]")
            return 2
        # `framework` is read here: to Hydra it would name a config group (conf/framework, the runs' frameworks)
        chosen = [a.split("=", 1)[1] for a in overrides if a.startswith("framework=")]
        overrides = [a for a in overrides if not a.startswith("framework=")]
        try:
            config = compose(overrides)
        except Exception as err:  # noqa: BLE001 - Hydra's own errors name the bad override
            console.print(f"[red]{err}[/red]")
            return 2
        if chosen:
            config["framework"] = chosen[-1]
        return plan_main(config, console, overrides)
    except plan_file.PlanError as err:
        console.print(f"[red]{err}[/red]")
        return 2


if __name__ == "__main__":
    sys.exit(main())
