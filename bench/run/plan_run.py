"""`python -m bench.run plan=FILE framework=NAME`: an execution plan (the YAML `python -m bench.plan` writes, or a
hand-written one) run as the framework's own knobs.

The plan's model, cluster and workload become the run's `model`, `launcher.nnodes` x `launcher.nproc`,
`precision`, `batch`, `prompt_len`, `answer_len` and `lora`; each role's layout becomes the knobs the framework
itself has for it (its options class's `plan_knobs`: DS-Chat a ZeRO stage and recomputation per trained model,
the others one setting for every role). What a framework cannot express is refused before launch, naming the
role, the plan's key and why. The record keeps the plan and, per role and phase, what the planner predicts for it
beside what the run measured (bench.run.plan_record).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any

from bench.plan import plan_file
from bench.plan.cluster import ROLES, Layout, Workload
from bench.run.spec import UnsupportedError

# Workload keys a run takes from the plan (the rest must keep their defaults: each says why it cannot be run)
RUN_WORKLOAD = {"precision": "precision", "micro_batch": "batch", "prompt_len": "prompt_len",
                "answer_len": "answer_len", "lora": "lora"}
NOT_RUN = {
    "ppo_epochs": "each framework keeps its own PPO epochs (framework.ppo.ppo_epochs and the like)",
    "critic_lora": "the critic's LoRA rank is a framework knob (DS-Chat's framework.critic_lora_dim)",
    "lora_trains": "what LoRA trains is each framework's own behaviour, not a knob",
    "cache": "the harness's models decode with a KV cache",
    "flash_attention": "the harness's models use their own attention",
    "release_inference_cache": "the Hybrid Engine's cache release is not wired to a run knob",
    "offload_reference": "the reference's offload is not wired to a run knob",
    "offload_inference_models": "ColossalChat's inference-model offload is not wired to a run knob",
    "parallel_output": "ColossalChat's parallel_output is not wired to a run knob",
    "keep_experience_caches": "what an experience maker keeps is each framework's own behaviour",
    "hydra_layers": "trlx's hydra layout is its framework.num_layers_unfrozen",
    "overlap_comm": "the run's ds.overlap_comm follows its device (on where it has streams: CUDA)",
}


@dataclass(frozen=True)
class RoleKnobs:
    """What expresses one role's layout in the framework: the knobs and their values, as the record states."""

    role: str
    layout: str  # the plan's notation (d{dp}p{pp}m{tp}, the ZeRO stage, its switches)
    knobs: dict[str, Any]


@dataclass(frozen=True)
class PlannedRun:
    path: str
    document: dict[str, Any]
    overrides: list[str]
    roles: list[RoleKnobs]


def refuse(framework: str, role: str, key: str, value: Any, why: str) -> UnsupportedError:
    return UnsupportedError(f"plan: execution_plan.{role}.{key}={value!r} cannot run in {framework}: {why}")


def same_for(framework: str, layouts: dict[str, Layout], roles: tuple[str, ...], keys: tuple[str, ...],
             why: str) -> None:
    """Refuses a plan whose `roles` differ in any of `keys` (a framework with one setting for them)."""
    first = roles[0]
    for role in roles[1:]:
        for key in keys:
            if getattr(layouts[role], key) != getattr(layouts[first], key):
                raise refuse(framework, role, key, getattr(layouts[role], key),
                             f"{why} ({first} has {key}={getattr(layouts[first], key)!r})")


def frozen_follow(framework: str, layouts: dict[str, Layout], pairs: dict[str, str], why: str) -> None:
    """Refuses a frozen role whose ZeRO stage is not its trained partner's into ZeRO-3 (else 0)."""
    for frozen, trained in pairs.items():
        wanted = 3 if layouts[trained].zero == 3 else 0
        if layouts[frozen].zero != wanted:
            raise refuse(framework, frozen, "zero", layouts[frozen].zero,
                         f"{why}: with the {trained} at ZeRO-{layouts[trained].zero} it runs at ZeRO-{wanted}")


def data_parallel_only(framework: str, layouts: dict[str, Layout], why: str) -> None:
    for role in ROLES:
        for key in ("tp", "pp"):
            if getattr(layouts[role], key) > 1:
                raise refuse(framework, role, key, getattr(layouts[role], key), why)
        if layouts[role].generation_tp > 1:
            raise refuse(framework, role, "generation_tp", layouts[role].generation_tp,
                         "the harness runs no tensor-parallel generation for it")


def declared_behaviours(framework: str, arch: Any, world: int, gpus_per_node: int, lora: int) -> dict[str, set]:
    """Per workload switch, the values the framework's declared behaviours give it over its layout space
    (adapters/<framework>/plan_space.py): what a plan written for it may carry."""
    from adapters import registry

    space = registry.plan_space(framework)
    found: dict[str, set] = {}
    for point in space.points(arch, world, gpus_per_node, lora):
        for key, value in space.behaviours(point, arch, lora).items():
            found.setdefault(key, set()).add(value)
    return found


def _workload_overrides(workload: Workload, dp: int, declared: dict[str, set], framework: str) -> list[str]:
    """The run's workload keys; the global batch is split over the `dp` data-parallel ranks (tensor-parallel
    ranks share their micro-batch). A switch the framework neither sets itself (its declared behaviours) nor runs
    with a knob (its `knobs_for`) is refused by name."""
    defaults = Workload()
    for f in fields(Workload):
        value = getattr(workload, f.name)
        default = getattr(defaults, f.name)
        if f.name not in NOT_RUN or value == default or value in declared.get(f.name, ()):
            continue
        if behaviour_knobs(framework, workload) == behaviour_knobs(framework, replace(workload, **{f.name: default})):
            allowed = sorted({getattr(defaults, f.name), *declared.get(f.name, ())}, key=str)
            raise UnsupportedError(f"plan: workload.{f.name}={value!r} cannot be run: {NOT_RUN[f.name]}; allowed: "
                                   f"{', '.join(map(repr, allowed))} (the planner's default, or what the framework "
                                   "does: its plan_space.py)")
    per_step = workload.micro_batch * dp
    if workload.global_batch % per_step:
        raise UnsupportedError(f"plan: workload.global_batch={workload.global_batch} must be a multiple of "
                               f"micro_batch x data-parallel ranks = {per_step} (gradient accumulation in whole "
                               "micro-batches)")
    return [f"{RUN_WORKLOAD[k]}={getattr(workload, k)}" for k in RUN_WORKLOAD] + [
        f"grad_accum={workload.global_batch // per_step}"]


def behaviour_knobs(framework: str, workload: Workload) -> list[str]:
    """Run knobs a plan's declared behaviour asks for (the framework's plan_space.py `knobs_for`)."""
    from adapters import registry

    knobs_for = registry.plan_space(framework).knobs_for
    return knobs_for(workload) if knobs_for else []


def planned_run(path: str, framework: str) -> PlannedRun:
    """The plan at `path` as `framework`'s run: its overrides and each role's knobs, or PlanError (a bad plan) /
    UnsupportedError (a plan the framework cannot express), each naming the key."""
    from adapters import registry

    document = plan_file.read(path)
    name, arch, critic_arch, cluster, workload = plan_file.context(document)
    if not isinstance(document["model"], str):
        raise plan_file.PlanError("plan: model must name a conf/model preset to be run (an inline mapping of "
                                  "dimensions only plans)")
    if document.get("critic_model") not in (None, document["model"]):
        raise UnsupportedError(f"plan: critic_model={document['critic_model']!r}: the harness builds critic and "
                               "reward from the run's model")
    layouts, groups = plan_file.layouts_of(document["execution_plan"], arch, critic_arch, cluster)
    if len(groups) > 1:
        role = groups[1][0]
        raise refuse(framework, role, "group", "+".join(groups[1]), "every framework here places every role on "
                     "every GPU (no role on GPUs of its own)")
    knobs = registry.options_class(framework).plan_knobs(layouts)
    declared = declared_behaviours(framework, arch, cluster.gpus, cluster.gpus_per_node, workload.lora)
    workload_keys = _workload_overrides(workload, layouts["actor"].dp, declared, framework)
    overrides = [f"model={name}", "stage=ppo", f"launcher.nnodes={cluster.nodes}",
                 f"launcher.nproc={cluster.gpus_per_node}", *workload_keys,
                 *behaviour_knobs(framework, workload)]
    overrides += [f"{k}={_text(v)}" for k, v in knobs.common.items()]
    roles = [RoleKnobs(role, layouts[role].notation, knobs.per_role.get(role, {})) for role in ROLES]
    return PlannedRun(os.path.abspath(path), document, overrides, roles)


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


@dataclass(frozen=True)
class PlanKnobs:
    """A framework's answer: run-wide overrides (`common`, KEY -> value) and, per role, the knobs that express it."""

    common: dict[str, Any]
    per_role: dict[str, dict[str, Any]]


def uniform_knobs(framework: str, layouts: dict[str, Layout], frozen_rule: str | None) -> PlanKnobs:
    """For a framework with one setting for every trained model (ColossalChat's plugin, trlx's and TRL's one
    accelerate/DeepSpeed config, the reference's FSDP2 mesh): actor and critic alike, reference and reward
    following them into ZeRO-3 (else replicated); `frozen_rule` None: the caller has its own rule for them."""
    same_for(framework, layouts, ("actor", "critic"), ("tp", "pp", "zero", "offload", "recompute"),
             "one setting covers every trained model")
    if frozen_rule is not None:
        frozen_follow(framework, layouts, {"reference": "actor", "reward": "critic"}, frozen_rule)
    actor = layouts["actor"]
    common = {"zero": actor.zero, "offload": actor.offload, "grad_ckpt": actor.recompute}
    if actor.tp > 1 or actor.pp > 1:
        common.update(tp=actor.tp, pp=actor.pp)
    per_role = {role: dict(common) for role in ("actor", "critic")}
    per_role.update({role: {"zero": layouts[role].zero} for role in ("reference", "reward")})
    return PlanKnobs(common, per_role)


PLAN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf", "plan")


def expand(args: list[str], default_framework: str) -> list[str]:
    """A command line's `plan=FILE` (a path, or a plan under conf/plan by name) replaced by the overrides that run
    it and `plan_file=PATH`; a command line without one is returned as it is. Raises PlanError or
    UnsupportedError (exit 2 before launch) for a bad plan, one the framework cannot express, a sweep over
    frameworks, or an override of a key the plan sets."""
    given = [a for a in args if a.startswith("plan=")]
    if not given:
        return args
    if len(given) > 1:
        raise plan_file.PlanError(f"plan= is given {len(given)} times; a run runs one plan")
    value = given[0][len("plan="):]
    path = value if os.path.isfile(value) else os.path.join(PLAN_DIR, f"{value}.yaml")
    if not os.path.isfile(path):
        names = sorted(f[:-5] for f in os.listdir(PLAN_DIR) if f.endswith(".yaml"))
        raise plan_file.PlanError(f"plan={value!r} is neither a file nor a plan in conf/plan ({', '.join(names)})")
    rest = [a for a in args if a not in given]
    frameworks = [a.split("=", 1)[1] for a in rest if a.startswith("framework=")]
    written_for = plan_file.read(path).get("framework")  # a plan `bench.plan framework=X` wrote names X
    if not frameworks and isinstance(written_for, dict) and written_for.get("name"):
        frameworks = [str(written_for["name"])]
        rest = [*rest, f"framework={frameworks[0]}"]
    framework = frameworks[-1] if frameworks else default_framework
    if "," in framework:
        raise plan_file.PlanError(f"framework={framework}: plan=FILE runs one framework at a time (each expresses "
                                  "the plan with knobs of its own)")
    run = planned_run(path, framework)
    planned = {o.split("=", 1)[0] for o in run.overrides}  # what the plan sets, in this framework's knobs
    for arg in rest:
        key = arg.split("=", 1)[0].lstrip("+~")
        if key in planned:
            raise plan_file.PlanError(f"{arg}: the plan sets {key} (edit the plan, or run without plan=)")
    return [*rest, *run.overrides, f"plan_file={run.path}"]
