"""ColossalChat's layout space and behaviours, as train_ppo.py sets them (bench.plan.framework_space). Imports no
framework.

One booster plugin boosts all four models (`--plugin`: zero2, zero2_cpu, gemini, gemini_auto, 3d with `--tp`; its
`--pp` pipelines SFT only); the frozen models are partitioned only under Gemini (ZeRO-3); `--grad_checkpoint`
covers actor and critic. Its experience maker keeps only the logits, the reference and reward go to the host while
the others train, and the 3d plugin gathers whole-vocabulary logits on every tensor-parallel rank
(parallel_output=False).
"""

from __future__ import annotations

from typing import Any

from bench.plan.cluster import Layout
from bench.plan.framework_space import Axis, Context, FrameworkSpace, Point, uniform_roles
from bench.plan.physics import Arch


def roles(point: Point, gpus: int) -> dict[str, Layout]:
    return uniform_roles(point, gpus)


def behaviours(point: Point, arch: Arch, lora: int) -> dict[str, Any]:
    return {"keep_experience_caches": False, "offload_inference_models": True, "parallel_output": False,
            "overlap_comm": False}


def excluded(point: Point, lora: int) -> str | None:
    if point.get("pp", 1) > 1:
        return "ColossalChat runs a pipeline only in SFT (booster.execute_pipeline); its PPO trainer calls the models"
    if point["zero"] == 3 and (point.get("tp", 1) > 1 or point.get("pp", 1) > 1):
        return "Gemini (ZeRO-3) has no tensor or pipeline parallelism; the 3d plugin takes ZeRO 0-2"
    if point["zero"] == 3 and lora:
        return "ColossalChat rejects LoRA with Gemini"
    if point.get("tp", 1) > 1 and lora:
        return "the 3d plugin takes LoRA at tp 1 only"
    return None


def plugin(point: Point, mixed: bool) -> str:
    """The plugin ColossalChat boosts with for a point (conf/framework/colossalai.yaml's auto_plugin)."""
    if point.get("tp", 1) > 1 or point.get("pp", 1) > 1 or (point["zero"] == 0 and mixed):
        return "3d"
    name = {0: "ddp", 2: "zero2", 3: "gemini"}[point["zero"]]
    if point["offload"]:
        name = "gemini_auto" if point["zero"] == 3 else f"{name}_cpu"
    return name


def describe(point: Point, ctx: Context) -> str:
    name = plugin(point, ctx.precision != "fp32")
    flags = [f"--plugin {name}"]
    if name == "3d":
        flags += [f"--tp {point.get('tp', 1)}", f"--pp {point.get('pp', 1)}", f"--zero_stage {point['zero']}"]
        flags += ["--zero_cpu_offload"] if point["offload"] else []
    flags += ["--grad_checkpoint"] if point["grad_ckpt"] else []
    return " ".join(flags)


def command(point: Point, ctx: Context) -> str:
    flags = [describe(point, ctx)]
    flags += [f"--lora_rank {ctx.lora}"] if ctx.lora else []
    flags += [f"--mixed_precision {ctx.precision}", f"--experience_batch_size {ctx.micro_batch}",
              f"--train_batch_size {ctx.micro_batch}", f"--max_seq_len {ctx.answer_len}",
              f"--max_length {ctx.prompt_len + ctx.answer_len}"]
    return (f"colossalai run --nproc_per_node {ctx.gpus_per_node} --num_nodes {ctx.nodes} train_ppo.py "
            f"{' '.join(flags)}")


SPACE = FrameworkSpace(
    framework="colossalai",
    axes=(Axis("zero", (0, 2, 3), "--plugin (3d, zero2, gemini: its ZeRO stage)"),
          Axis("grad_ckpt", (False, True), "--grad_checkpoint"),
          Axis("offload", (False, True), "--plugin *_cpu / gemini_auto")),
    roles=roles,
    behaviours=behaviours,
    command=command,
    model_parallel=True,
    describe=describe,
    excluded=excluded,
    declared_only=(("ZeRO-1", "train_ppo.py offers it only as --plugin 3d --zero_stage 1, which the harness's "
                    "plugin choice does not reach from a plan"),
                   ("--sp, --sp_mode", "sequence parallelism: not modelled")),
)
