"""The plain-PyTorch reference's layout space (bench.plan.framework_space). Imports no framework.

One data-parallel mesh for every model: zero 0 DDP, 1 DDP with ZeroRedundancyOptimizer, 2 FSDP2 without
resharding after the forward, 3 FSDP2; activation checkpointing of the trained models; no offload.
"""

from __future__ import annotations

from typing import Any

from bench.plan.cluster import Layout
from bench.plan.framework_space import Axis, Context, FrameworkSpace, Point, harness_overrides, uniform_roles
from bench.plan.physics import Arch


def roles(point: Point, gpus: int) -> dict[str, Layout]:
    return uniform_roles(point, gpus)


def behaviours(point: Point, arch: Arch, lora: int) -> dict[str, Any]:
    return {"keep_experience_caches": False, "lora_trains": "factors"}


ENGINES = {0: "DDP", 1: "DDP + ZeroRedundancyOptimizer", 2: "FSDP2 (reshard_after_forward=False)", 3: "FSDP2"}


def describe(point: Point, ctx: Context) -> str:
    return ENGINES[point["zero"]] + (" + activation checkpointing" if point["grad_ckpt"] else "")


def command(point: Point, ctx: Context) -> str:
    # no upstream to speak for it: its own command is the harness's
    return (f"python -m bench.run framework=torch stage=ppo launcher.nnodes={ctx.nodes} "
            f"launcher.nproc={ctx.gpus_per_node} {' '.join(harness_overrides(point))}")


SPACE = FrameworkSpace(
    framework="torch",
    axes=(Axis("zero", (0, 1, 2, 3), "DDP | ZeroRedundancyOptimizer | FSDP2 (no reshard) | FSDP2"),
          Axis("grad_ckpt", (False, True), "activation checkpointing")),
    roles=roles,
    behaviours=behaviours,
    command=command,
    describe=describe,
    declared_only=(("offload", "the reference has no CPU offload"),),
)
