"""The planner's search: layouts per role, placements of roles on GPUs, and the plans that fit.

A placement splits the cluster's GPUs evenly among groups of colocated roles: all four roles on all GPUs
(`colocated`, as DS-Chat and ColossalChat run), actor + reference and critic + reward apart (`split`), or each
role on its own quarter (`separate`). In each group every role gets a layout (tp x pp x dp = the group's GPUs;
tp inside a node and dividing the heads; pp dividing the layers; a ZeRO stage, 0 or 3 for frozen roles;
recomputation for trained roles; optimizer offload only in the offload variants; for the actor, a tensor-
parallel generation layout of its own inside a node, as DS-Chat's Hybrid Engine gathers ZeRO-3 shards for
the rollout). Per role only layouts on
the Pareto front of (resident bytes, each phase's working set, seconds) survive, the fastest few of them;
the product over a group's roles is then checked phase by phase against the limit (cluster.safety x the
device) and the host memory of a node, and ranked by the summed phase times (bench.plan.cost).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from bench.plan.cluster import (
    GB,
    PHASES,
    ROLE_PHASES,
    ROLES,
    TRANSIENT,
    Cluster,
    Layout,
    Role,
    Workload,
    experience_keep,
    host_bytes,
    parked,
    phase_terms,
    resident,
)
from bench.plan.cost import phase_seconds
from bench.plan.physics import Arch, Terms

PLACEMENTS = {
    "colocated": (ROLES,),
    "split": (("actor", "reference"), ("critic", "reward")),
    "separate": tuple((r,) for r in ROLES),
}
FRONT_CAP = 8  # layouts kept per role after Pareto pruning (the fastest, plus the leanest)
GIB = 2 ** 30


@dataclass(frozen=True)
class Option:
    layout: Layout
    resident: float
    working: tuple[float, ...]  # per phase in PHASES: what the role adds while it runs it (0 if it does not)
    keep: float  # experience outputs alive through the other forwards
    seconds: float
    host: float  # offloaded bytes per GPU in host memory


@dataclass
class GroupResult:
    roles: tuple[str, ...]
    gpus: int
    phases: dict[str, Terms]  # per GPU of the group
    host_per_gpu: float

    @property
    def peak(self) -> float:
        return max(t.device for t in self.phases.values())


@dataclass
class Plan:
    placement: str
    layouts: dict[str, Layout]
    roles: dict[str, Role]
    groups: list[GroupResult]
    seconds: dict[str, float]  # per phase, summed over roles
    limit: float
    host_limit: float
    gpus_per_node: int

    @property
    def step_seconds(self) -> float:
        return sum(self.seconds.values())

    @property
    def peak(self) -> float:
        return max(g.peak for g in self.groups)

    @property
    def host_per_node(self) -> float:
        return max(g.host_per_gpu for g in self.groups) * self.gpus_per_node

    @property
    def fits(self) -> bool:
        return self.peak <= self.limit and self.host_per_node <= self.host_limit

    def overflows(self) -> list[str]:
        """Why the plan does not fit, one line per group and phase over the limit."""
        lines = []
        for group in self.groups:
            for phase, terms in group.phases.items():
                if terms.device > self.limit:
                    biggest = sorted(((v, k) for k, v in terms.as_dict().items() if k != "host"), reverse=True)[:3]
                    parts = ", ".join(f"{k} {v / GIB:.1f}" for v, k in biggest)
                    lines.append(f"{'+'.join(group.roles)} in {phase}: {terms.device / GIB:.1f} GiB per GPU > "
                                 f"{self.limit / GIB:.1f} GiB limit, over by {(terms.device - self.limit) / GIB:.1f} "
                                 f"GiB (largest: {parts})")
        if self.host_per_node > self.host_limit:
            lines.append(f"host memory: {self.host_per_node / GIB:.0f} GiB per node of offloaded states > "
                         f"{self.host_limit / GIB:.0f} GiB limit")
        return lines


def make_roles(arch: Arch, workload: Workload, critic_arch: Arch | None = None) -> dict[str, Role]:
    critic = critic_arch or arch
    critic_lora = workload.lora if workload.critic_lora is None else workload.critic_lora
    rank = {"actor": workload.lora, "critic": critic_lora}
    if workload.hydra_layers >= arch.layers:
        raise ValueError(f"workload.hydra_layers={workload.hydra_layers} must be below the model's {arch.layers} "
                         "blocks (trlx's num_layers_unfrozen)")
    hydra = {n: workload.hydra_layers for n in ("actor", "critic", "reference")}
    return {name: Role(name, arch if hydra.get(name) or name not in ("critic", "reward") else critic,
                       rank.get(name, 0), workload.lora_trains, hydra.get(name, 0)) for name in ROLES}


def evaluate(placement: str, roles: dict[str, Role], layouts: dict[str, Layout], groups: tuple[tuple[str, ...], ...],
             workload: Workload, cluster: Cluster) -> Plan:
    results = []
    for names in groups:
        pairs = [(roles[n], layouts[n]) for n in names]
        phases = {p: phase_terms(pairs, p, workload) for p in PHASES if any(p in ROLE_PHASES[n] for n in names)}
        host = sum(host_bytes(r, lay, workload) for r, lay in pairs)
        results.append(GroupResult(names, layouts[names[0]].gpus, phases, host))
    seconds = {p: sum(phase_seconds(roles[n], layouts[n], workload, cluster, p) for n in layouts) for p in PHASES}
    return Plan(placement, dict(layouts), dict(roles), results, seconds, cluster.limit_bytes,
                cluster.safety * cluster.host_mem_gb * GB, cluster.gpus_per_node)


def divides_heads(arch: Arch, tp: int) -> bool:
    """Tensor parallelism splits whole heads: tp must divide the query heads and the K/V heads (Megatron's and
    colossalai's shardformer rule for grouped-query attention)."""
    return arch.heads % tp == 0 and arch.kv_heads % tp == 0


def _powers(limit: int) -> list[int]:
    out, value = [], 1
    while value <= limit:
        out.append(value)
        value *= 2
    return out


def layouts_for(role: Role, gpus: int, workload: Workload, cluster: Cluster, offload: bool) -> Iterator[Layout]:
    arch = role.arch
    for tp in _powers(min(cluster.gpus_per_node, gpus)):
        if not divides_heads(arch, tp):
            continue
        for pp in _powers(gpus // tp):
            if arch.layers % pp or gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            if workload.global_batch % (dp * workload.micro_batch):
                continue  # every replica takes a whole number of micro-batches of the step's prompts
            zeros = (0, 1, 2, 3) if role.trained else (0, 3)
            for zero in zeros:
                for recompute in ((False, True) if role.trained else (False,)):
                    for off in ((False, True) if offload and role.trained and zero >= 1 else (False,)):
                        if zero and dp == 1 and not off:
                            continue  # nothing to partition over; ZeRO-Offload still moves the states to the host
                        for gen_tp in _generation_tps(role, tp, pp, gpus, cluster):
                            yield Layout(tp, pp, dp, zero, off, recompute, gen_tp)


def _generation_tps(role: Role, tp: int, pp: int, gpus: int, cluster: Cluster) -> list[int]:
    """The actor may generate on a tensor-parallel layout of its own inside a node (the Hybrid Engine):
    0 (its training layout) or a tp that divides the heads and differs from that layout."""
    if role.name != "actor":
        return [0]
    extra = [t for t in _powers(min(cluster.gpus_per_node, gpus)) if divides_heads(role.arch, t) and gpus % t == 0
             and (t, 1) != (tp, pp)]
    return [0, *extra]


def _option(role: Role, layout: Layout, workload: Workload, cluster: Cluster) -> Option:
    working = tuple(TRANSIENT[p](role, layout, workload).device if p in ROLE_PHASES[role.name] else 0.0
                    for p in PHASES)
    keep = experience_keep(role, layout, workload).device if "inference" in ROLE_PHASES[role.name] else 0.0
    seconds = sum(phase_seconds(role, layout, workload, cluster, p) for p in PHASES)
    held = resident(role, layout, workload)
    return Option(layout, held.device, working, keep, seconds, host_bytes(role, layout, workload))


def _vector(o: Option) -> tuple[float, ...]:
    return (o.seconds, o.resident, *o.working, o.keep)


def front(role: Role, gpus: int, workload: Workload, cluster: Cluster, offload: bool) -> list[Option]:
    """The layouts no other layout beats in every phase's bytes and in time, the fastest FRONT_CAP of them
    plus the leanest. Sorted by (seconds, bytes...), a layout can only be dominated by one before it."""
    options = sorted((_option(role, lay, workload, cluster) for lay in layouts_for(role, gpus, workload, cluster,
                                                                                   offload)), key=_vector)
    pareto: list[Option] = []
    for option in options:
        mine = _vector(option)
        if not any(all(x <= y for x, y in zip(_vector(p), mine, strict=True)) for p in pareto):
            pareto.append(option)
    kept = pareto[:FRONT_CAP]
    leanest = min(pareto, key=lambda o: o.resident + max(o.working), default=None)
    if leanest is not None and leanest not in kept:
        kept.append(leanest)
    return kept


@dataclass
class SearchResult:
    plans: list[Plan]  # the fitting plans found, fastest first (the best per placement)
    rejected: list[Plan]  # per placement the leanest plan when none fitted, and the uniform reference layouts
    evaluated: int
    seconds: float
    variant: str = "as asked"
    notes: list[str] = field(default_factory=list)
    gpus: int = 0  # the cluster's GPUs the search laid the roles over

    @property
    def best(self) -> Plan | None:
        return self.plans[0] if self.plans else None


def _group_phase_bytes(options: tuple[Option, ...], names: tuple[str, ...], roles: dict[str, Role],
                       workload: Workload) -> float:
    """The worst phase of a group for one choice of options (what phase_terms adds, from the cached parts)."""
    worst = 0.0
    for i, phase in enumerate(PHASES):
        running = [o.working[i] for o, n in zip(options, names, strict=True) if phase in ROLE_PHASES[n]]
        if not running:
            continue
        base = sum(o.resident for o, n in zip(options, names, strict=True)
                   if not (phase == "training" and parked(roles[n], workload)))
        kept = sum(o.keep for o, n in zip(options, names, strict=True)
                   if phase == "inference" and phase in ROLE_PHASES[n])
        worst = max(worst, base + kept + max(running))
    return worst


def search(arch: Arch, workload: Workload, cluster: Cluster, offload: bool = False,
           critic_arch: Arch | None = None, variant: str = "as asked") -> SearchResult:
    start = time.perf_counter()
    roles = make_roles(arch, workload, critic_arch)
    plans, rejected, evaluated = [], [], 0
    # trlx's hydra: value head and branch run on the actor's own GPUs and shards, so only the colocated
    # placement, with critic and reference sharded as the actor is (a plan file may still give the reward
    # model GPUs of its own, as trlx's examples do)
    placements = {"colocated": PLACEMENTS["colocated"]} if workload.hydra_layers else PLACEMENTS
    for placement, groups in placements.items():
        if cluster.gpus % len(groups):
            continue
        per_group = cluster.gpus // len(groups)
        fronts = {n: front(roles[n], per_group, workload, cluster, offload) for g in groups for n in g}
        if any(not f for f in fronts.values()):
            continue
        chosen: dict[str, Option] = {}
        leanest: dict[str, Option] = {}
        for names in groups:
            best, lean = None, None
            for combo in itertools.product(*(fronts[n] for n in names)):
                if workload.hydra_layers and not _hydra_shards(combo, names):
                    continue
                evaluated += 1
                peak = _group_phase_bytes(combo, names, roles, workload)
                seconds = sum(o.seconds for o in combo)
                host = sum(o.host for o in combo)
                if lean is None or peak < lean[0]:
                    lean = (peak, combo)
                if peak <= cluster.limit_bytes and host * cluster.gpus_per_node <= cluster.safety * \
                        cluster.host_mem_gb * GB and (best is None or seconds < best[0]):
                    best = (seconds, combo)
            leanest.update(zip(names, lean[1], strict=True))
            if best is not None:
                chosen.update(zip(names, best[1], strict=True))
        if len(chosen) == len(ROLES):
            plans.append(evaluate(placement, roles, {n: o.layout for n, o in chosen.items()}, groups, workload,
                                  cluster))
        else:
            rejected.append(evaluate(placement, roles, {n: o.layout for n, o in leanest.items()}, groups, workload,
                                     cluster))
    rejected += uniform_plans(roles, workload, cluster)
    plans.sort(key=lambda p: p.step_seconds)
    return SearchResult(plans, [p for p in rejected if not p.fits], evaluated, time.perf_counter() - start, variant,
                        gpus=cluster.gpus)


def _hydra_shards(combo: tuple[Option, ...], names: tuple[str, ...]) -> bool:
    """Under trlx's hydra the critic (the value head) and the reference (the branch) are sharded as the actor."""
    shape = {n: (o.layout.tp, o.layout.pp, o.layout.dp) for n, o in zip(names, combo, strict=True)}
    return all(shape[n] == shape["actor"] for n in ("critic", "reference") if n in shape)


def uniform_plans(roles: dict[str, Role], workload: Workload, cluster: Cluster) -> list[Plan]:
    """The layouts a team tries first: every role data-parallel over all GPUs at one ZeRO stage."""
    out = []
    gpus = cluster.gpus
    if workload.global_batch % (gpus * workload.micro_batch):
        return out
    for zero in (0, 2, 3):
        layouts = {n: Layout(1, 1, gpus, zero if (roles[n].trained or zero == 3) and gpus > 1 else 0)
                   for n in ROLES}
        out.append(replace(evaluate("colocated", roles, layouts, PLACEMENTS["colocated"], workload, cluster),
                           placement=f"colocated, all ZeRO-{zero}"))
    return out


VARIANTS = (("offload", {"offload": True}), ("LoRA 8", {"lora": 8}), ("LoRA 64", {"lora": 64}),
            ("LoRA 8 + offload", {"lora": 8, "offload": True}), ("LoRA 64 + offload", {"lora": 64, "offload": True}))


def plan_with_variants(arch: Arch, workload: Workload, cluster: Cluster, critic_arch: Arch | None = None
                       ) -> list[SearchResult]:
    """The search as asked; when nothing fits full fine-tuning, the offload and LoRA variants too."""
    results = [search(arch, workload, cluster, critic_arch=critic_arch)]
    if results[0].plans:
        return results
    for name, change in VARIANTS:
        if workload.lora and "lora" in change:
            continue
        w = replace(workload, lora=change.get("lora", workload.lora))
        results.append(search(arch, w, cluster, offload=change.get("offload", False), critic_arch=critic_arch,
                              variant=name))
    return results
