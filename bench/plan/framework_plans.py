"""`python -m bench.plan framework=X`: the plans framework X runs, each predicted by X's own memory model.

Every point of X's declared layout space (adapters/<framework>/plan_space.py) becomes the run `bench.run` would
start for it (a RunSpec: the planner's model, cluster and workload, the point's knobs), refused where X's own
option check refuses it (its `validate`, the same one a run meets), and predicted by X's memory model
(adapters/<framework>/memory.py, the one its CPU records check) on a CUDA device: per phase, the bytes the busiest
rank holds, physics only (the calibration is fitted on CPU hosts and is not carried over). A point fits when every
phase stays under cluster.safety of the GPU's memory and its offloaded states under that share of a node's host
memory; fitting points are ranked by the planner's step-time estimate (bench.plan.cost) on the point's role
layouts with X's behaviours. Imports no framework.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from adapters import registry
from bench.plan.cluster import GB, PHASES, Cluster, Layout, Workload
from bench.plan.cost import phase_seconds
from bench.plan.framework_space import Context, FrameworkSpace, Point, harness_overrides
from bench.plan.physics import Arch, Terms
from bench.plan.run_shape import RunShape
from bench.plan.search import make_roles
from bench.run.spec import RunSpec, SpecError

GIB = 2 ** 30
LORA_VARIANTS = (8, 64)  # tried, as the generic search's variants, when nothing fits full fine-tuning
TERM_WORDS = {"other": "models built whole in fp32"}  # the memory models' `other`: a build before the engine


@dataclass
class FrameworkPlan:
    framework: str
    point: Point
    layouts: dict[str, Layout]
    workload: Workload  # the planner's workload with the framework's behaviours and the point's micro-batch
    grad_accum: int
    phases: dict[str, Terms]  # per GPU, the busiest rank, from the framework's memory model
    seconds: dict[str, float]  # per phase of the step-time estimate
    limit: float
    host_limit: float
    gpus_per_node: int
    command: str  # the framework's own command line
    terms: str  # the layout in the framework's own words

    @property
    def peak(self) -> float:
        return max(t.device for t in self.phases.values())

    @property
    def host_per_node(self) -> float:
        return max(t.host for t in self.phases.values()) * self.gpus_per_node

    @property
    def step_seconds(self) -> float:
        return sum(self.seconds.values())

    @property
    def fits(self) -> bool:
        return self.peak <= self.limit and self.host_per_node <= self.host_limit

    @property
    def notation(self) -> str:
        return ", ".join(f"{r} {lay.notation}" for r, lay in self.layouts.items())

    def overflow(self) -> str:
        """Why it does not fit: the worst phase, its excess and its largest terms."""
        if self.peak > self.limit:
            phase = max(self.phases, key=lambda p: self.phases[p].device)
            terms = self.phases[phase]
            biggest = sorted(((v, k) for k, v in terms.as_dict().items() if k != "host" and v), reverse=True)[:2]
            parts = ", ".join(f"{TERM_WORDS.get(k, k)} {v / GIB:.1f}" for v, k in biggest)
            return (f"{phase} needs {terms.device / GIB:.1f} GiB per GPU > {self.limit / GIB:.1f} GiB limit "
                    f"(largest: {parts})")
        return (f"host memory: {self.host_per_node / GIB:.0f} GiB per node of offloaded states > "
                f"{self.host_limit / GIB:.0f} GiB")

    def harness_command(self, path: str) -> str:
        return f"python -m bench.run plan={path} framework={self.framework}"


@dataclass
class FrameworkResult:
    framework: str
    plans: list[FrameworkPlan]  # the points that fit, fastest first
    leanest: FrameworkPlan | None  # the point with the smallest peak when none fits
    refused: Counter = field(default_factory=Counter)  # why the framework refuses points (its own option check)
    evaluated: int = 0
    seconds: float = 0.0
    variant: str = "as asked"
    missing_model: str | None = None  # why nothing could be predicted

    @property
    def best(self) -> FrameworkPlan | None:
        return self.plans[0] if self.plans else None

    def why_not(self) -> str:
        """The first reason no plan fits."""
        if self.missing_model:
            return self.missing_model
        if self.leanest is not None:
            lean = self.leanest
            return (f"its leanest layout ({lean.terms}, micro-batch {lean.workload.micro_batch}): "
                    f"{lean.overflow()}")
        if self.refused:
            reason, count = self.refused.most_common(1)[0]
            return f"every layout refused ({count} of {self.evaluated}: {reason})"
        return "no layout of its space applies to this model and cluster"


class PlanInputError(ValueError):
    """A planner key the run specification refuses; the message names it."""


def base_spec(framework: str, model_overrides: list[str], cluster: Cluster, workload: Workload) -> RunSpec:
    """The run `bench.run` would build for this framework, model and workload, before any layout knob."""
    from bench.run.config import compose
    from bench.run.spec import spec_from_config

    launcher = [f"launcher.nproc={cluster.gpus_per_node}", f"launcher.nnodes={cluster.nodes}"]
    if cluster.nodes > 1:  # the spec a node of the run builds: its place is not the plan's concern
        launcher += ["launcher.node_rank=0", "launcher.rdzv_endpoint=localhost:29500", "launcher.rdzv_id=plan"]
    overrides = [f"framework={framework}", "stage=ppo", *model_overrides, *launcher,
                 f"precision={workload.precision}", f"prompt_len={workload.prompt_len}",
                 f"answer_len={workload.answer_len}", f"lora={workload.lora}", "batch=1"]
    try:
        return spec_from_config(compose(overrides), env={}, check=False)
    except (SpecError, TypeError, ValueError) as err:
        raise PlanInputError(f"framework={framework}: {err}") from None


def _micro_batch(space: FrameworkSpace, workload: Workload, dp: int) -> tuple[int, int] | str:
    """(micro-batch, gradient accumulation) of a point with `dp` data-parallel ranks, or why there is none."""
    if space.one_rollout_per_step:
        if workload.global_batch % dp:
            return (f"global_batch={workload.global_batch} is not a whole number of prompts over {dp} "
                    "data-parallel ranks")
        return workload.global_batch // dp, 1
    per_step = workload.micro_batch * dp
    if workload.global_batch % per_step:
        return (f"global_batch={workload.global_batch} is not a whole number of micro-batches of "
                f"{workload.micro_batch} over {dp} data-parallel ranks")
    return workload.micro_batch, workload.global_batch // per_step


def evaluate_point(space: FrameworkSpace, spec: RunSpec, point: Point, arch: Arch, critic_arch: Arch,
                   cluster: Cluster, workload: Workload, model: Any) -> FrameworkPlan | str:
    """The point predicted, or the reason it cannot run (its own option check, or the batch arithmetic)."""
    layouts = space.roles(point, cluster.gpus)
    dp = layouts["actor"].dp
    shape = _micro_batch(space, workload, dp)
    if isinstance(shape, str):
        return shape
    micro, accum = shape
    knobs = {"framework_options": dict(spec.framework_options), "batch": micro, "grad_accum": accum}
    for key, value in point.items():
        if key.startswith("framework."):
            knobs["framework_options"][key.split(".", 1)[1]] = value
        else:
            knobs[key] = value
    try:
        run = spec.replace(**knobs)
        registry.options_class(space.framework).validate(run)
    except SpecError as err:
        return str(err)
    shape = RunShape.from_spec(run, "ppo", "cuda")
    if critic_arch != arch:  # a critic of its own (published facts; framework=X plans the run's model)
        if space.critic_model is None:
            return f"{space.framework}'s memory model builds critic and reward from the run's model"
        shape = replace(shape, critic_arch=critic_arch)
    phases = model(shape)
    behaviours = space.behaviours(point, arch, workload.lora)
    planned = replace(workload, micro_batch=micro, **behaviours)
    roles = make_roles(arch, planned, critic_arch)
    seconds = {p: sum(phase_seconds(roles[r], layouts[r], planned, cluster, p) for r in layouts) for p in PHASES}
    context = Context(spec.model.name, workload.precision, micro, accum, workload.prompt_len, workload.answer_len,
                      workload.lora, cluster.nodes, cluster.gpus_per_node)
    return FrameworkPlan(space.framework, point, layouts, planned, accum, phases, seconds, cluster.limit_bytes,
                         cluster.safety * cluster.host_mem_gb * GB, cluster.gpus_per_node,
                         space.command(point, context), space.upstream_terms(point, context))


def search_framework(framework: str, model_overrides: list[str], arch: Arch, critic_arch: Arch, cluster: Cluster,
                     workload: Workload, variant: str = "as asked") -> FrameworkResult:
    start = time.perf_counter()
    space = registry.plan_space(framework)
    model = registry.memory_model(framework)
    if model is None:
        return FrameworkResult(framework, [], None, variant=variant,
                               missing_model=f"{framework} has no memory model to predict it with")
    spec = base_spec(framework, model_overrides, cluster, workload)
    result = FrameworkResult(framework, [], None, variant=variant)
    for point in space.points(arch, cluster.gpus, cluster.gpus_per_node, workload.lora):
        result.evaluated += 1
        found = evaluate_point(space, spec, point, arch, critic_arch, cluster, workload, model)
        if isinstance(found, str):
            result.refused[found] += 1
        elif found.fits:
            result.plans.append(found)
        elif result.leanest is None or found.peak < result.leanest.peak:
            result.leanest = found
    result.plans.sort(key=lambda p: (p.step_seconds, p.peak))
    if result.plans:
        result.leanest = None
    result.seconds = time.perf_counter() - start
    return result


def with_variants(framework: str, model_overrides: list[str], arch: Arch, critic_arch: Arch, cluster: Cluster,
                  workload: Workload) -> list[FrameworkResult]:
    """The framework's plans as asked; when none fits full fine-tuning, with LoRA 8 and 64 too (its space holds
    offload already)."""
    results = [search_framework(framework, model_overrides, arch, critic_arch, cluster, workload)]
    if results[0].plans or workload.lora or results[0].missing_model:
        return results
    for rank in LORA_VARIANTS:
        results.append(search_framework(framework, model_overrides, arch, critic_arch, cluster,
                                        replace(workload, lora=rank), variant=f"LoRA {rank}"))
        if results[-1].plans:
            break
    return results


def plan_document(plan: FrameworkPlan, model: Any, critic_model: Any, cluster: Cluster) -> dict[str, Any]:
    """The plan file `bench.run plan=FILE` runs: the execution plan, the framework, its knobs in both terms."""
    from bench.plan import plan_file

    predicted = {"source": f"adapters/{registry.package(plan.framework)}/memory.py on cuda (physics, uncalibrated)",
                 "peak_gib_per_gpu": round(plan.peak / GIB, 2), "limit_gib": round(plan.limit / GIB, 2),
                 "host_gib_per_node": round(plan.host_per_node / GIB, 1),
                 "phase_gib_per_gpu": {p: round(t.device / GIB, 2) for p, t in plan.phases.items()},
                 "step_seconds_estimate": round(plan.step_seconds, 2),
                 "phase_seconds_estimate": {p: round(s, 2) for p, s in plan.seconds.items()}}
    doc = plan_file.document(model, critic_model, cluster, plan.workload, "colocated", plan.layouts,
                             (tuple(plan.layouts),), predicted)
    doc["framework"] = {"name": plan.framework, "knobs": harness_overrides(plan.point), "layout": plan.terms,
                        "upstream_command": plan.command}
    return doc
