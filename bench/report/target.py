"""The decision tree at the user's target: `python -m bench.report DIR --target "model=glm-10b
cluster.gpus_per_node=8 cluster.gpu=A100-80GB"` adds, beside the measured branches, a branch for that model on
those GPUs whose leaf is every framework's plan as `python -m bench.plan framework=X` finds it. A predicted leaf
names no winner: it lists what each framework's own memory model predicts (fits or not, its fastest layout, its
peak per GPU, the estimated step time to rank by) and what that rests on, the planner's published-fact check."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from adapters import registry
from bench.plan import plan_file
from bench.plan.framework_cli import model_overrides
from bench.plan.framework_plans import GIB, FrameworkResult, PlanInputError, with_variants
from bench.plan.search import plan_with_variants
from bench.report.decision import Leaf, Node


class TargetError(ValueError):
    """The --target keys are not a plan the planner can make; the message names the key."""


@dataclass
class Target:
    keys: str
    name: str
    gpus: int
    where: str  # nodes x GPUs per node and the GPU
    precision: str
    lora: int
    results: dict[str, list[FrameworkResult]]
    any_step_seconds: float | None  # the role-by-role search's best, for reference


def plan_target(keys: str) -> Target:
    """Every framework's plans at the target given as planner keys (`bench.plan`'s KEY=VALUE)."""
    from bench.plan.__main__ import compose

    args = shlex.split(keys)
    if any(a.startswith(("framework=", "plan=", "-")) for a in args):
        raise TargetError(f"--target {keys!r}: give the model, cluster.* and workload.* keys only (every framework is "
                          "planned)")
    try:
        config = compose(args)
        name, arch, critic_arch, cluster, workload = plan_file.context(config)
    except plan_file.PlanError as err:
        raise TargetError(f"--target: {err}") from None
    except Exception as err:  # noqa: BLE001 - Hydra's own errors name the bad override
        raise TargetError(f"--target {keys!r}: {err}") from None
    results = {}
    for framework in registry.names():
        try:
            results[framework] = with_variants(framework, model_overrides(args), arch, critic_arch, cluster, workload)
        except PlanInputError as err:
            raise TargetError(f"--target: {err}") from None
    generic = next((r for r in plan_with_variants(arch, workload, cluster) if r.plans), None)
    return Target(keys, name, cluster.gpus, f"{cluster.nodes} x {cluster.gpus_per_node} {cluster.gpu}",
                  workload.precision, workload.lora, results, generic.best.step_seconds if generic else None)


def fact_accuracy() -> str:
    """What a predicted leaf rests on: how many published GPU facts each framework's own memory model agrees with
    (the facts are DS-Chat's and ColossalChat's; the other frameworks' models have none to check)."""
    from bench.plan import facts

    verdicts = facts.judge_all()
    counts = []
    for framework in sorted({v.fact.framework for v in verdicts}):
        own = [v for v in verdicts if v.fact.framework == framework]
        counts.append(f"{framework}'s {sum(v.agrees for v in own)} of {len(own)}")
    return (f"the frameworks' own memory models agree with published GPU facts: {', '.join(counts)}; the others "
            f"have no published fact (the verdict, and a published figure within ±{facts.FIGURE_TOLERANCE:.0%}: "
            "python -m bench.plan.facts)")


def branch(target: Target, accuracy: str) -> tuple[str, Node]:
    """The target's branch: model, GPUs, precision, fine-tuning, then the predicted leaf."""
    evidence, fitting = [], []
    for framework, results in target.results.items():
        found = next((r for r in results if r.plans), None)
        if found is None:
            evidence.append(f"{framework}: predicted not to fit: {results[0].why_not()}")
            continue
        best = found.plans[0]
        variant = "" if found.variant == "as asked" else f" (with {found.variant})"
        fitting.append((best.step_seconds, framework))
        evidence.append(f"{framework}: predicted to fit{variant}: {best.terms}; peak {best.peak / GIB:.1f} GiB per "
                        f"GPU; ~{best.step_seconds:.1f} s a step estimated")
    if target.any_step_seconds is not None:
        evidence.append(f"any (role by role, a layout no compared framework runs): ~{target.any_step_seconds:.1f} s a "
                        "step estimated")
    evidence.append(f"rests on: predicted, not measured: each framework's own memory model on a GPU, uncalibrated, "
                    f"and the step-time estimate (bench/plan/cost.py); {accuracy}")
    fitting.sort()
    if not fitting:
        verdict = "predicted: no framework fits (each one's first reason below)"
    else:
        ranked = ", ".join(f"{f} (~{s:.1f} s)" for s, f in fitting)
        verdict = (f"predicted to fit: {ranked}, by the step-time estimate; a prediction, so no winner is named "
                   "until runs on these GPUs measure it")
    mode = f"LoRA {target.lora}" if target.lora else "full fine-tuning"
    tune = Node("Full fine-tuning, LoRA, or partial freezing?", [(mode, Leaf(verdict, False, evidence))])
    precision = Node("Which precision?", [(target.precision, tune)])
    gpus = Node("How many GPUs?", [(f"{target.gpus} ({target.where}, predicted)", precision)])
    return f"{target.name} (predicted at {target.where}: --target {target.keys})", gpus
