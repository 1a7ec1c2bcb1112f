"""The execution-plan file: written by `python -m bench.plan`, read (and distrusted) by `--check`.

    model: glm-10b                 # a conf/model name, or {hidden, layers, heads, vocab, positions}
    critic_model: null             # the same for critic and reward; null = model
    cluster: {nodes: 8, gpus_per_node: 8, gpu: A100-40GB}
    workload: {micro_batch: 1, global_batch: 64, prompt_len: 512, answer_len: 512}
    execution_plan:
      actor:     {stages: [generation, inference, training], tp: 8, pp: 1, dp: 8, zero: 2, requires_grad: true}
      reference: {stages: [inference], tp: 8, pp: 1, dp: 8, requires_grad: false}
      reward:    {stages: [inference], tp: 4, pp: 1, dp: 16, requires_grad: false}
      critic:    {stages: [inference, training], tp: 8, pp: 1, dp: 8, zero: 2, requires_grad: true}

Optional per role: `offload` (ZeRO-Offload of the optimizer; with ZeRO-3 the weights too), `recompute`
(activation recomputation), `group` (roles with the same group share GPUs; default `all`: every role on
every GPU), and for the actor `generation_tp` (generate on a tensor-parallel layout of its own, as
DS-Chat's Hybrid Engine does: the weights gathered into it for the rollout). Every value is checked; an
error names the key, the value and what is allowed.
"""

from __future__ import annotations

import os
from dataclasses import asdict, fields
from typing import Any

import yaml

from bench.plan.cluster import GPUS, ROLE_PHASES, ROLES, Cluster, Layout, Workload
from bench.plan.physics import Arch

MODEL_KEYS = ("hidden", "layers", "heads", "vocab", "positions")
# optional: a Llama-style family and the dimensions its presets give (null or absent: the family's defaults)
ARCH_KEYS = {"arch": "family", "kv_heads": "kv_heads", "intermediate": "intermediate", "tie_embeddings": "tied"}
ROLE_KEYS = ("stages", "tp", "pp", "dp", "zero", "requires_grad", "offload", "recompute", "group",
             "generation_tp")
TOP_KEYS = ("model", "critic_model", "cluster", "workload", "placement", "predicted", "execution_plan", "framework")
MAX_FILE_BYTES = 1 << 20
CONF_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                              "conf", "model")


class PlanError(ValueError):
    """The plan file or a value in it is invalid; the message names it and what is allowed."""


def arch_of(model: Any, key: str = "model") -> tuple[str, Arch]:
    """(name, shape) of a conf/model name or an inline mapping of its dimensions."""
    if isinstance(model, str):
        names = sorted(f[:-5] for f in os.listdir(CONF_MODEL_DIR) if f.endswith(".yaml"))
        if model not in names:
            raise PlanError(f"{key}={model!r} is not a model in conf/model; allowed: {', '.join(names)}, or a "
                            f"mapping of {', '.join(MODEL_KEYS)}")
        with open(os.path.join(CONF_MODEL_DIR, f"{model}.yaml")) as f:
            values = yaml.safe_load(f)
        name = model
    elif isinstance(model, dict):
        values, name = model, str(model.get("name", "custom"))
    else:
        raise PlanError(f"{key}={model!r} must be a conf/model name or a mapping of {', '.join(MODEL_KEYS)}")
    if values.get("path"):  # a local checkpoint (model=checkpoint model.path=DIR): its config.json's dimensions
        values = _checkpoint_values(values, key)
    missing = [k for k in MODEL_KEYS if values.get(k) is None]
    if missing:
        raise PlanError(f"{key} lacks {', '.join(missing)}")
    optional = {field: values[k] for k, field in ARCH_KEYS.items() if values.get(k) is not None}
    try:
        return name, Arch(**{k: values[k] for k in MODEL_KEYS}, **optional)
    except (TypeError, ValueError) as err:
        raise PlanError(f"{key}: {err}") from None


def _checkpoint_values(values: dict[str, Any], key: str) -> dict[str, Any]:
    from bench.run.spec import ModelSpec, SpecError

    try:
        model = ModelSpec(**{**values, "dropout": values.get("dropout") or 0.0,
                             "lr": values.get("lr") or {"sft": 1, "rm": 1, "actor": 1, "critic": 1}})
    except (SpecError, TypeError) as err:
        raise PlanError(f"{key}: {err}") from None
    return {**values, **{k: getattr(model, k) for k in (*MODEL_KEYS, *ARCH_KEYS)}}


def _dataclass(cls: type, values: Any, key: str) -> Any:
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise PlanError(f"{key}={values!r} must be a mapping")
    allowed = [f.name for f in fields(cls)]
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise PlanError(f"{key} has unknown keys {unknown}; allowed: {', '.join(allowed)}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as err:
        raise PlanError(f"{key}: {err}") from None


def context(config: dict[str, Any]) -> tuple[str, Any, Any, Cluster, Workload]:
    """(model name, arch, critic arch, cluster, workload) from a composed config or a plan file."""
    model = preset_or_mapping(config["model"])
    name, arch = arch_of(model)
    critic = config.get("critic_model")
    critic_arch = arch_of(critic, "critic_model")[1] if critic else arch
    cluster = cluster_of(config.get("cluster"))
    workload = workload_of(config.get("workload"))
    if workload.prompt_len + workload.answer_len > arch.positions:
        raise PlanError(f"workload.prompt_len + workload.answer_len = {workload.prompt_len + workload.answer_len} "
                        f"exceeds the model's {arch.positions} positions")
    for role, rank in (("lora", workload.lora), ("critic_lora", workload.critic_lora)):
        if rank and rank >= arch.hidden:
            raise PlanError(f"workload.{role}={rank} must be below the model's hidden size {arch.hidden} (a LoRA "
                            "rank at or above it is no low-rank update)")
    if workload.hydra_layers >= arch.layers:
        raise PlanError(f"workload.hydra_layers={workload.hydra_layers} must be below the model's {arch.layers} "
                        "blocks (trlx's num_layers_unfrozen)")
    return name, arch, critic_arch, cluster, workload


def merged(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A plan file with command-line overrides (`--check plan=FILE KEY=VALUE`): a field of a preset model
    (`model.vocab=...` on `model: glm-10b`) changes the preset's values; keys a plan does not have are refused."""
    unknown = sorted(set(overrides) - set(TOP_KEYS))
    if unknown:
        raise PlanError(f"unknown override keys {unknown}; allowed beside --check: {', '.join(TOP_KEYS)}")
    out = dict(data)
    for key, value in overrides.items():
        current = out.get(key)
        if isinstance(value, dict):
            if key in ("model", "critic_model") and isinstance(current, str):
                arch_of(current, key)  # a known preset, or the error naming the allowed ones
                with open(os.path.join(CONF_MODEL_DIR, f"{current}.yaml")) as f:
                    current = {**yaml.safe_load(f), "name": current}
            if current is not None and not isinstance(current, dict):
                raise PlanError(f"{key}={current!r} in the plan has no fields to override ({sorted(value)})")
            out[key] = {**(current or {}), **value}
        else:
            out[key] = value
    return out


def preset_or_mapping(model: Any) -> Any:
    """A composed model that is its preset unchanged becomes the preset's name (plan files then say
    `model: glm-10b`); one with overridden fields stays a mapping named after what changed, so an override
    (`model=glm-10b model.heads=7`) is planned, never dropped."""
    if not isinstance(model, dict) or "name" not in model:
        return model
    path = os.path.join(CONF_MODEL_DIR, f"{model['name']}.yaml")
    if not os.path.exists(path):
        return model
    with open(path) as f:
        preset = yaml.safe_load(f)
    keys = (*MODEL_KEYS, *ARCH_KEYS, "path")
    changed = [f"model.{k}={model.get(k)}" for k in keys if model.get(k) != preset.get(k)]
    if not changed:
        return model["name"]
    return {**model, "name": f"{model['name']} ({', '.join(changed)})"}


def cluster_of(values: Any) -> Cluster:
    if isinstance(values, dict) and "gpu_mem_gb" in values:
        raise PlanError(f"cluster.gpu_mem_gb={values['gpu_mem_gb']!r} is no longer read: the limit is cluster.safety "
                        "of the GPU's memory as torch reports it (total_memory); name the GPU (cluster.gpu, one of "
                        f"{', '.join(GPUS)}) or give your own figure as cluster.gpu_memory_gib")
    return _dataclass(Cluster, values, "cluster")


def workload_of(values: Any) -> Workload:
    return _dataclass(Workload, values, "workload")


def _int(role: str, key: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise PlanError(f"execution_plan.{role}.{key}={value!r} must be an integer {bound}")
    return value


def _bool(role: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise PlanError(f"execution_plan.{role}.{key}={value!r} must be true or false")
    return value


def layouts_of(plan: Any, arch: Arch, critic_arch: Arch, cluster: Cluster
               ) -> tuple[dict[str, Layout], tuple[tuple[str, ...], ...]]:
    """Each role's layout and the groups of roles sharing GPUs, checked against the models and the cluster."""
    if not isinstance(plan, dict):
        raise PlanError(f"execution_plan={plan!r} must map each of {', '.join(ROLES)} to its layout")
    missing, unknown = [r for r in ROLES if r not in plan], sorted(set(plan) - set(ROLES))
    if missing or unknown:
        raise PlanError(f"execution_plan must have exactly the roles {', '.join(ROLES)} (missing: {missing}, "
                        f"unknown: {unknown})")
    layouts, groups = {}, {}
    for role in ROLES:
        entry = plan[role]
        if not isinstance(entry, dict):
            raise PlanError(f"execution_plan.{role}={entry!r} must be a mapping of {', '.join(ROLE_KEYS)}")
        extra = sorted(set(entry) - set(ROLE_KEYS))
        if extra:
            raise PlanError(f"execution_plan.{role} has unknown keys {extra}; allowed: {', '.join(ROLE_KEYS)}")
        stages = entry.get("stages", list(ROLE_PHASES[role]))
        if not isinstance(stages, list) or sorted(map(str, stages)) != sorted(ROLE_PHASES[role]):
            raise PlanError(f"execution_plan.{role}.stages={stages!r}: the {role} runs exactly "
                            f"{list(ROLE_PHASES[role])} in PPO")
        trained = role in ("actor", "critic")
        if "requires_grad" in entry and _bool(role, "requires_grad", entry["requires_grad"]) != trained:
            raise PlanError(f"execution_plan.{role}.requires_grad={entry['requires_grad']!r}: the {role} is "
                            f"{'trained' if trained else 'frozen'} in PPO")
        shape = critic_arch if role in ("critic", "reward") else arch
        tp = _int(role, "tp", entry.get("tp", 1), 1, cluster.gpus_per_node)
        pp = _int(role, "pp", entry.get("pp", 1), 1, shape.layers)
        dp = _int(role, "dp", entry.get("dp", 1), 1, cluster.gpus)
        if shape.heads % tp or shape.kv_heads % tp:
            raise PlanError(f"execution_plan.{role}.tp={tp} must divide the model's {shape.heads} attention heads "
                            f"and its {shape.kv_heads} K/V heads")
        zero = _int(role, "zero", entry.get("zero", 0), 0, 3)
        if not trained and zero not in (0, 3):
            raise PlanError(f"execution_plan.{role}.zero={zero}: a frozen role has no gradients or optimizer; "
                            "allowed: 0 (replicated) or 3 (weights partitioned)")
        offload = _bool(role, "offload", entry.get("offload", False))
        if offload and (not trained or zero == 0):
            raise PlanError(f"execution_plan.{role}.offload=true needs a trained role at zero >= 1")
        recompute = _bool(role, "recompute", entry.get("recompute", False))
        generation_tp = _int(role, "generation_tp", entry.get("generation_tp", 0), 0, cluster.gpus_per_node)
        if generation_tp and (role != "actor" or shape.heads % generation_tp or shape.kv_heads % generation_tp
                              or (tp * pp * dp) % generation_tp):
            raise PlanError(f"execution_plan.{role}.generation_tp={generation_tp}: only the actor generates; its "
                            f"generation tp must divide the {shape.heads} heads, the {shape.kv_heads} K/V heads and "
                            f"its {tp * pp * dp} GPUs")
        group = entry.get("group", "all")
        if not isinstance(group, str) or not group:
            raise PlanError(f"execution_plan.{role}.group={group!r} must be a name")
        layouts[role] = Layout(tp, pp, dp, zero, offload, recompute, generation_tp)
        groups.setdefault(group, []).append(role)
    used = 0
    for name, members in groups.items():
        sizes = {layouts[r].gpus for r in members}
        if len(sizes) > 1:
            shown = ", ".join(f"{r} {layouts[r].tp}x{layouts[r].pp}x{layouts[r].dp}" for r in members)
            raise PlanError(f"group {name!r}: roles sharing GPUs must span the same number of them (tp x pp x dp: "
                            f"{shown})")
        used += sizes.pop()
    if used != cluster.gpus:
        shown = "; ".join(f"{name}: {'+'.join(m)} on {layouts[m[0]].tp} x {layouts[m[0]].pp} x {layouts[m[0]].dp}"
                          for name, m in groups.items())
        raise PlanError(f"the plan's layouts span {used} GPUs (tp x pp x dp per group of roles sharing GPUs: "
                        f"{shown}); the cluster has {cluster.gpus} ({cluster.nodes} x {cluster.gpus_per_node}): "
                        "dp = GPUs / (tp x pp), or give roles on separate GPUs their own `group`")
    return layouts, tuple(tuple(m) for m in groups.values())


def read(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise PlanError(f"plan={path!r} is not a file")
    if os.path.getsize(path) > MAX_FILE_BYTES:
        raise PlanError(f"plan={path!r} is {os.path.getsize(path)} bytes; a plan file is at most {MAX_FILE_BYTES}")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except UnicodeDecodeError as err:
        raise PlanError(f"plan={path!r} is not UTF-8 text (byte {err.start}: {err.reason}); a plan is YAML") from None
    except yaml.YAMLError as err:
        raise PlanError(f"plan={path!r} is not valid YAML: {err}") from None
    if not isinstance(data, dict) or "execution_plan" not in data:
        raise PlanError(f"plan={path!r} must be a mapping with an `execution_plan` (and model, cluster, workload)")
    unknown = sorted(set(data) - set(TOP_KEYS))
    if unknown:
        raise PlanError(f"plan={path!r} has unknown keys {unknown}; allowed: {', '.join(TOP_KEYS)}")
    return data


def document(model: str | dict[str, Any], critic_model: str | dict[str, Any] | None, cluster: Cluster,
             workload: Workload, placement: str, layouts: dict[str, Layout], groups: tuple[tuple[str, ...], ...],
             predicted: dict[str, Any]) -> dict[str, Any]:
    group_of = {r: ("all" if len(groups) == 1 else "+".join(g)) for g in groups for r in g}
    plan = {}
    for role in ROLES:
        lay = layouts[role]
        entry: dict[str, Any] = {"stages": list(ROLE_PHASES[role]), "tp": lay.tp, "pp": lay.pp, "dp": lay.dp,
                                 "zero": lay.zero, "requires_grad": role in ("actor", "critic")}
        if lay.offload:
            entry["offload"] = True
        if lay.recompute:
            entry["recompute"] = True
        if lay.generation_tp:
            entry["generation_tp"] = lay.generation_tp
        if group_of[role] != "all":
            entry["group"] = group_of[role]
        plan[role] = entry
    return {"model": model, "critic_model": critic_model, "cluster": asdict(cluster), "workload": asdict(workload),
            "placement": placement, "predicted": predicted, "execution_plan": plan}


class _FlowRoles(yaml.SafeDumper):
    """Writes each role's layout on one line, as in the issue's plan format."""


def _represent_dict(dumper: yaml.SafeDumper, data: dict[str, Any]) -> yaml.Node:
    flow = "stages" in data
    return dumper.represent_mapping("tag:yaml.org,2002:map", data.items(), flow_style=flow)


_FlowRoles.add_representer(dict, _represent_dict)


def write(document_: dict[str, Any], path: str, header: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(header)
        yaml.dump(document_, f, Dumper=_FlowRoles, sort_keys=False, width=200)
