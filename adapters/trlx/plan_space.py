"""trlx's layout space and behaviours (bench.plan.framework_space). Imports no framework.

trlx trains one model, the policy with its value head, under one accelerate config (configs/accelerate/ddp.yaml,
zero2-bf16.yaml, zero3.yaml); the reference (a hydra branch on the policy's
trunk, or a frozen copy) and the reward stay outside DeepSpeed, whole on every rank. Its hydra depth is
`model.num_layers_unfrozen` (the hh example's 2 where trlx has a branch class for the family).
"""

from __future__ import annotations

from typing import Any

from adapters.trlx.options import default_layers_unfrozen
from bench.plan.cluster import Layout
from bench.plan.framework_space import Axis, Context, FrameworkSpace, Point, uniform_roles
from bench.plan.physics import Arch


def roles(point: Point, gpus: int) -> dict[str, Layout]:
    return uniform_roles(point, gpus, frozen_follow=False)


def behaviours(point: Point, arch: Arch, lora: int) -> dict[str, Any]:
    # peft's reference is the adapter-disabled policy: no branch under LoRA
    return {"hydra_layers": 0 if lora else max(default_layers_unfrozen(arch.family), 0), "overlap_comm": False}


def describe(point: Point, ctx: Context) -> str:
    config = {0: "ddp.yaml", 2: f"zero2-{'fp16' if ctx.precision == 'fp16' else 'bf16'}.yaml",
              3: "zero3.yaml"}[point["zero"]]
    return f"configs/accelerate/{config}"


def command(point: Point, ctx: Context) -> str:
    return (f"accelerate launch --num_machines {ctx.nodes} --num_processes {ctx.nodes * ctx.gpus_per_node} "
            f"--config_file {describe(point, ctx)} examples/hh/ppo_hh.py  # train.batch_size="
            f"{ctx.micro_batch}, train.seq_length={ctx.prompt_len + ctx.answer_len}, "
            f"method.gen_kwargs.max_new_tokens={ctx.answer_len}" + (f", peft_config.r={ctx.lora}" if ctx.lora else ""))


SPACE = FrameworkSpace(
    framework="trlx",
    axes=(Axis("zero", (0, 2, 3), "configs/accelerate/{ddp,zero2-*,zero3}.yaml"),),
    roles=roles,
    behaviours=behaviours,
    command=command,
    describe=describe,
    declared_only=(("ZeRO-1", "trlx ships no ZeRO-1 accelerate config"),
                   ("offload_optimizer_device: cpu", "not wired in this harness (it needs DeepSpeed's CPU Adam in "
                    "place of trlx's AdamW)"),
                   ("gradient checkpointing", "trlx's trainers have no knob for it")),
)
