"""What a framework can run and how it behaves, as its adapter declares it (adapters/<framework>/plan_space.py).

One declaration per framework is read by the planner's search (`python -m bench.plan framework=X`), by
`bench.run plan=FILE` (the workload switches a plan may carry are the framework's own behaviours) and, through
the memory model it names in the registry, by preflight. A point of the space is a set of the harness's run
keys (`zero`, `grad_ckpt`, `framework.critic_zero_stage`, `tp`, ...); the declaration turns it into the
execution plan's role layouts and into the framework's own command line. Imports no framework.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from bench.plan.cluster import ROLES, Layout
from bench.plan.physics import Arch

Point = dict[str, Any]


@dataclass(frozen=True)
class Axis:
    """One knob the search varies: the harness's run key, the values searched, the framework's own name for it."""

    key: str
    values: tuple[Any, ...]
    upstream: str
    lora_only: bool = False  # varied only when the run has LoRA (DS-Chat's --only_optimize_lora)


@dataclass(frozen=True)
class Context:
    """What a point's command line needs besides the point: the run's shape as the plan states it."""

    model: str
    precision: str
    micro_batch: int
    grad_accum: int
    prompt_len: int
    answer_len: int
    lora: int
    nodes: int
    gpus_per_node: int


@dataclass(frozen=True)
class FrameworkSpace:
    """A framework's layout space and behaviours.

    - `axes`: the knobs searched, each with its values; a point is one value per axis.
    - `model_parallel`: the framework trains with tensor and pipeline parallelism (one tp and pp for every model),
      so the search also varies `tp` and `pp` where the model allows them.
    - `roles`: a point as the four roles' layouts over the run's GPUs (the execution plan the point is).
    - `behaviours`: the planner's workload switches this framework sets for a point on a model family and LoRA rank
      (bench.plan.cluster.Workload: what its experience maker keeps, what it offloads, its LoRA's trained set,
      trlx's hydra depth); `bench.run plan=` accepts a plan carrying exactly these.
    - `command`: the framework's own command line for a point (its launcher, script and flags).
    - `one_rollout_per_step`: the framework generates a step's prompts in one call (TRL): the micro-batch is the
      global batch over the data-parallel ranks, with no gradient accumulation.
    - `declared_only`: upstream knobs of the layout space the search does not vary, each with why.
    - `describe`: a point in the framework's own words (default: its axes' flags).
    - `excluded`: why a combination of the axes' values is outside the space (at a LoRA rank), else None.
      ZeRO-Offload without a ZeRO stage is outside every space.
    - `knobs_for`: the run overrides a plan's workload (bench.plan.cluster.Workload) asks for through a behaviour
      the framework sets with a knob (DS-Chat: LoRA training its factors alone is --only_optimize_lora).
    - `critic_model`: the framework's own flag for a critic and reward of another model, where its memory model
      predicts them so (published facts plan DS-Chat's OPT actors with a 350M critic)."""

    framework: str
    axes: tuple[Axis, ...]
    roles: Callable[[Point, int], dict[str, Layout]]
    behaviours: Callable[[Point, Arch, int], dict[str, Any]]
    command: Callable[[Point, Context], str]
    model_parallel: bool = False
    one_rollout_per_step: bool = False
    declared_only: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    describe: Callable[[Point, Context], str] | None = None
    excluded: Callable[[Point, int], str | None] | None = None  # why a point (at a LoRA rank) is not in the space
    knobs_for: Callable[[Any], list[str]] | None = None  # run overrides a plan's workload behaviours ask for
    # the upstream flag that builds critic and reward from another model, where the framework's memory model
    # counts them so (RunShape.critic_arch); None: its model predicts them as the run's model
    critic_model: str | None = None

    def points(self, arch: Arch, gpus: int, gpus_per_node: int, lora: int) -> Iterator[Point]:
        """Every point of the space for this model on `gpus` GPUs (tp inside a node dividing the query and
        K/V heads, pp dividing the blocks, tp x pp dividing the GPUs)."""
        axes = [a for a in self.axes if lora or not a.lora_only]
        shapes = model_parallel_shapes(arch, gpus, gpus_per_node) if self.model_parallel else [(1, 1)]
        for tp, pp in shapes:
            for values in itertools.product(*(a.values for a in axes)):
                point = dict(zip((a.key for a in axes), values, strict=True))
                if self.model_parallel:
                    point.update(tp=tp, pp=pp)
                if self.why_excluded(point, lora) is None:
                    yield point

    def why_excluded(self, point: Point, lora: int) -> str | None:
        stages = [v for k, v in point.items() if k in ("zero", "framework.critic_zero_stage")]
        if point.get("offload") and 0 in stages:
            return "offload needs a ZeRO stage >= 1 for every trained model"
        return self.excluded(point, lora) if self.excluded else None

    def upstream_terms(self, point: Point, ctx: Context) -> str:
        """The point in the framework's own words: its `describe`, else axis by axis (a switch by its flag when on,
        a value after its flag)."""
        if self.describe is not None:
            return self.describe(point, ctx)
        names = {a.key: a.upstream for a in self.axes}
        words = [names.get(k, k) if v is True else f"{names.get(k, k)} {_word(v)}" for k, v in point.items()
                 if v is not False]
        return " ".join(words)


def model_parallel_shapes(arch: Arch, gpus: int, gpus_per_node: int) -> list[tuple[int, int]]:
    shapes = []
    tp = 1
    while tp <= min(gpus, gpus_per_node):
        if arch.heads % tp == 0 and arch.kv_heads % tp == 0:
            pp = 1
            while tp * pp <= gpus:
                if arch.layers % pp == 0 and gpus % (tp * pp) == 0:
                    shapes.append((tp, pp))
                pp *= 2
        tp *= 2
    return shapes


def harness_overrides(point: Point) -> list[str]:
    """The point as `bench.run` overrides (KEY=VALUE)."""
    return [f"{k}={_word(v)}" for k, v in point.items()]


def uniform_roles(point: Point, gpus: int, frozen_follow: bool = True) -> dict[str, Layout]:
    """One setting for every trained model (ColossalChat's plugin, trlx's, TRL's and the reference's one config):
    actor and critic alike; the reference and reward partitioned with them at ZeRO-3 where `frozen_follow`, else
    whole on every GPU."""
    tp, pp = point.get("tp", 1), point.get("pp", 1)
    zero = point.get("zero", 0)
    trained = Layout(tp, pp, gpus // (tp * pp), zero, bool(point.get("offload", False)),
                     bool(point.get("grad_ckpt", False)))
    frozen = Layout(tp, pp, gpus // (tp * pp), 3 if frozen_follow and zero == 3 else 0)
    return {role: trained if role in ("actor", "critic") else frozen for role in ROLES}


def _word(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)
