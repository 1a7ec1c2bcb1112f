"""DS-Chat's layout space and behaviours, as its step-3 script sets them (bench.plan.framework_space). Imports no
framework.

`main.py` of step3_rlhf_finetuning takes the actor's and the critic's ZeRO stage and gradient checkpointing apart;
`rlhf_engine.py` builds the reference beside the actor and the reward beside the critic, partitioned at ZeRO-3 when
their partner is (else whole); one `--offload` covers both trained engines; LoRA (`--actor_lora_dim`) wraps the
block linears and, without `--only_optimize_lora`, leaves everything else training.
"""

from __future__ import annotations

from typing import Any

from bench.plan.cluster import ROLES, Layout, Workload
from bench.plan.framework_space import Axis, Context, FrameworkSpace, Point
from bench.plan.physics import Arch


def roles(point: Point, gpus: int) -> dict[str, Layout]:
    zero = point["zero"]
    critic_zero = point["framework.critic_zero_stage"]
    offload = point["offload"]
    layouts = {
        "actor": Layout(1, 1, gpus, zero, offload, point["grad_ckpt"]),
        "critic": Layout(1, 1, gpus, critic_zero, offload, point["framework.critic_gradient_checkpointing"]),
        "reference": Layout(1, 1, gpus, 3 if zero == 3 else 0),
        "reward": Layout(1, 1, gpus, 3 if critic_zero == 3 else 0),
    }
    return {role: layouts[role] for role in ROLES}


def behaviours(point: Point, arch: Arch, lora: int) -> dict[str, Any]:
    return {"keep_experience_caches": True, "overlap_comm": True, "critic_lora": 0,
            "lora_trains": "factors" if point.get("framework.only_optimize_lora") else "unwrapped"}


def knobs_for(workload: Workload) -> list[str]:
    """A plan whose LoRA trains its factors alone runs with --only_optimize_lora; a critic LoRA rank of its own
    (the llama2 LoRA scripts' 64) runs with --critic_lora_dim."""
    knobs = ["framework.only_optimize_lora=true"] if workload.lora and workload.lora_trains == "factors" else []
    return knobs + ([f"framework.critic_lora_dim={workload.critic_lora}"] if workload.critic_lora else [])


def command(point: Point, ctx: Context) -> str:
    flags = [f"--actor_zero_stage {point['zero']}", f"--critic_zero_stage {point['framework.critic_zero_stage']}"]
    flags += ["--actor_gradient_checkpointing"] if point["grad_ckpt"] else []
    flags += ["--critic_gradient_checkpointing"] if point["framework.critic_gradient_checkpointing"] else []
    flags += ["--offload"] if point["offload"] else []
    if ctx.lora:
        flags.append(f"--actor_lora_dim {ctx.lora}")
        flags += ["--only_optimize_lora"] if point.get("framework.only_optimize_lora") else []
    flags += [f"--per_device_generation_batch_size {ctx.micro_batch}",
              f"--per_device_training_batch_size {ctx.micro_batch}",
              f"--gradient_accumulation_steps {ctx.grad_accum}", f"--max_prompt_seq_len {ctx.prompt_len}",
              f"--max_answer_seq_len {ctx.answer_len}", f"--dtype {ctx.precision}"]
    return (f"deepspeed --num_nodes {ctx.nodes} --num_gpus {ctx.gpus_per_node} "
            f"training/step3_rlhf_finetuning/main.py {' '.join(flags)}")


SPACE = FrameworkSpace(
    framework="dschat",
    axes=(Axis("zero", (0, 1, 2, 3), "--actor_zero_stage"),
          Axis("framework.critic_zero_stage", (0, 1, 2, 3), "--critic_zero_stage"),
          Axis("grad_ckpt", (False, True), "--actor_gradient_checkpointing"),
          Axis("framework.critic_gradient_checkpointing", (False, True), "--critic_gradient_checkpointing"),
          Axis("offload", (False, True), "--offload"),
          Axis("framework.only_optimize_lora", (False, True), "--only_optimize_lora", lora_only=True)),
    roles=roles,
    behaviours=behaviours,
    command=command,
    knobs_for=knobs_for,
    declared_only=(
        ("--enable_hybrid_engine, --inference_tp_size", "the Hybrid Engine's generation layout: the harness's "
         "framework.hybrid_engine runs it at tp 1 on one process, and DS-Chat's memory model does not count it"),
        ("--offload_reference_model", "not wired to a run knob"),
        ("--critic_lora_dim", "the search trains the critic whole (0, as every DS-Chat script but the llama2 LoRA "
         "ones); a plan's workload.critic_lora runs it")),
    critic_model="--critic_model_name_or_path",
)
