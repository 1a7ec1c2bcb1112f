"""TRL's layout space and behaviours (bench.plan.framework_space). Imports no framework.

`accelerate launch --config_file examples/accelerate_configs/{multi_gpu,deepspeed_zero1,2,3}.yaml` sets one
engine for the policy and value model (PolicyAndValueWrapper); the reference and reward join DeepSpeed only at
ZeRO-3 (prepare_deepspeed), else stay whole on every rank. PPOTrainer generates all of a step's prompts on a rank
in one call (per_device_train_batch_size x gradient_accumulation_steps), so a plan's micro-batch is the global
batch over the data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from bench.plan.cluster import Layout
from bench.plan.framework_space import Axis, Context, FrameworkSpace, Point, uniform_roles
from bench.plan.physics import Arch


def roles(point: Point, gpus: int) -> dict[str, Layout]:
    layouts = uniform_roles(point, gpus)
    if point["zero"] == 3:  # ds3_gather_for_generation: the whole policy gathered once for the rollout
        layouts["actor"] = replace(layouts["actor"], generation_tp=1)
    return layouts


def behaviours(point: Point, arch: Arch, lora: int) -> dict[str, Any]:
    return {"overlap_comm": False}


def describe(point: Point, ctx: Context) -> str:
    config = "multi_gpu.yaml" if point["zero"] == 0 else f"deepspeed_zero{point['zero']}.yaml"
    return f"examples/accelerate_configs/{config}"


def command(point: Point, ctx: Context) -> str:
    flags = [f"--per_device_train_batch_size {ctx.micro_batch}", "--gradient_accumulation_steps 1",
             f"--response_length {ctx.answer_len}"]
    flags += [f"--{ctx.precision}"] if ctx.precision != "fp32" else []
    flags += [f"--use_peft --lora_r {ctx.lora}"] if ctx.lora else []
    return (f"accelerate launch --num_machines {ctx.nodes} --num_processes {ctx.nodes * ctx.gpus_per_node} "
            f"--config_file {describe(point, ctx)} examples/scripts/ppo/ppo.py {' '.join(flags)}")


SPACE = FrameworkSpace(
    framework="trl",
    axes=(Axis("zero", (0, 1, 2, 3), "examples/accelerate_configs/{multi_gpu,deepspeed_zero1,2,3}.yaml"),),
    roles=roles,
    behaviours=behaviours,
    command=command,
    describe=describe,
    one_rollout_per_step=True,
    declared_only=(("offload", "TRL's accelerate configs offload nothing; the harness writes no DeepSpeed file for "
                    "it"),
                   ("gradient checkpointing", "PPOTrainer never enables it (the harness refuses grad_ckpt with PPO)")),
)
