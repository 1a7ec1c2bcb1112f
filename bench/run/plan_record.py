"""What a `plan=FILE` run's record keeps of its plan: the plan itself, the knobs that expressed each role, and per
role and phase what the planner predicts beside what the run measured.

Planned: `bench.plan`'s own model of the plan as written (bench.plan.cluster: the ZeRO paper's model states, the
phase working sets), per GPU, with no calibration (it predicts GPUs). Measured: per role, the bytes of parameters
and optimizer states the role's engine holds (the record's model_state, read from the engines' tensors; the
busiest rank); per phase, the phase's growth over the post-import baseline (the record's memory method: host RSS
on a CPU, the allocator's peak on a GPU; max over ranks). A role with no engine of its own (trlx's value head and
hydra reference live in the policy's engine) has no measured state.
"""

from __future__ import annotations

from typing import Any

from bench.plan import plan_file
from bench.plan.cluster import resident
from bench.plan.search import evaluate, make_roles
from bench.results.record import ResultRecord
from bench.run.plan_run import planned_run

# the record's model_state keys for the planner's roles, and the record's phase for the planner's
STATE_KEYS = {"actor": "actor", "critic": "critic", "reference": "ref", "reward": "reward"}
PHASES = {"generation": "generation", "inference": "experience", "training": "training"}
METHOD = ("planned: bench.plan's model of the plan as written (model states as the ZeRO paper, the phases' working "
          "sets), per GPU, uncalibrated; measured: per role the parameter and optimizer-state bytes its engine holds "
          "(model_state, busiest rank), per phase the growth over the post-import baseline (max over ranks, the "
          "record's memory method); error = (planned - measured) / measured")


def _error(planned: float, measured: float | None) -> float | None:
    return None if not measured else round((planned - measured) / measured, 4)


def plan_entry(path: str, framework: str, record: ResultRecord) -> dict[str, Any]:
    run = planned_run(path, framework)
    document = run.document
    _, arch, critic_arch, cluster, workload = plan_file.context(document)
    layouts, groups = plan_file.layouts_of(document["execution_plan"], arch, critic_arch, cluster)
    roles = make_roles(arch, workload, critic_arch)
    plan = evaluate("as written", roles, layouts, groups, workload, cluster)
    stage = record.stages.get("ppo")
    state = (stage.model_state if stage else None) or {}
    phases = ((stage.memory if stage else None) or {}).get("phases") or {}
    per_role = []
    for knobs in run.roles:
        terms = resident(roles[knobs.role], layouts[knobs.role], workload)
        planned = terms.params + terms.optimizer + terms.lora
        held = state.get(STATE_KEYS[knobs.role]) or {}
        ranks = [p + o for p, o in zip(held.get("param_bytes_per_rank") or [],
                                       held.get("optimizer_state_bytes_per_rank") or [], strict=False)]
        measured = max(ranks) if ranks else None
        per_role.append({"role": knobs.role, "layout": knobs.layout, "knobs": knobs.knobs,
                         "planned_state_bytes": round(planned), "measured_state_bytes": measured,
                         "error": _error(planned, measured)})
    group = plan.groups[0]
    per_phase = []
    for phase, recorded in PHASES.items():
        measured = (phases.get(recorded) or {}).get("growth_over_baseline_bytes")
        planned = group.phases[phase].device
        per_phase.append({"phase": recorded, "planned_bytes": round(planned), "measured_growth_bytes": measured,
                          "error": _error(planned, measured)})
    entry = {"file": run.path, "document": document, "overrides": run.overrides, "method": METHOD,
             "roles": per_role, "phases": per_phase}
    written_for = document.get("framework") or {}
    if isinstance(written_for, dict) and written_for.get("name") == framework:
        entry["framework_phases"] = framework_phases(document, stage)
    return entry


FRAMEWORK_METHOD = ("planned: the framework's own memory model (adapters/<framework>/memory.py), which wrote the plan "
                    "(`bench.plan framework=X`), for this run on its own device, physics without calibration (the "
                    "plan file's figures are the same model on a GPU); measured: each phase's growth over the "
                    "post-import baseline (max over ranks); error = (planned - measured) / measured")


def framework_phases(document: dict[str, Any], stage: Any) -> dict[str, Any]:
    """Per phase of a plan `bench.plan framework=X` wrote, run by X: X's model for this run beside the growth."""
    memory = (stage.memory if stage else None) or {}
    predicted = (memory.get("prediction") or {}).get("phases") or {}
    measured = memory.get("phases") or {}
    gpu = (document.get("predicted") or {}).get("phase_gib_per_gpu") or {}
    rows = []
    for phase, entry in predicted.items():
        grown = (measured.get(phase) or {}).get("growth_over_baseline_bytes")
        rows.append({"phase": phase, "planned_bytes": entry["physics_total_bytes"], "measured_growth_bytes": grown,
                     "error": _error(entry["physics_total_bytes"], grown), "planned_gib_per_gpu": gpu.get(phase)})
    return {"method": FRAMEWORK_METHOD, "phases": rows}
