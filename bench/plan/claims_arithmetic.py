"""Claims that arithmetic can settle: a published memory figure below what its stated configuration must hold,
cluster arithmetic that does not add up, a dtype the stated GPU lacks.

The bound for a memory figure is the least any framework can hold per GPU in the stated configuration: the
roles' weights, gradients and optimizer states under the stated ZeRO stage (bench.plan.cluster: the ZeRO
paper's bytes; DeepSpeed and the others hold more), plus the activations of the stated micro-batch with full
recomputation (the least a backward can keep), and nothing else: no cache, logits, buffers or allocator
slack. A figure below it is "implausible as stated". A published "GB" is read as 10^9 bytes (none of the
sources says GiB); bounds are stated in GB with GiB (2^30 bytes) beside them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from bench.plan.cluster import GPUS, SAFETY, Layout, Role, Workload, resident, training
from bench.plan.physics import Arch

GIB = 2 ** 30
GB = 10 ** 9
IMPLAUSIBLE, CONSISTENT = "implausible as stated", "consistent with the arithmetic"
STAGE_ROLES = {"sft": ("actor",), "rm": ("critic",), "ppo": ("actor", "critic", "reference", "reward")}
SMALL_MODEL = Arch(hidden=2048, layers=20, heads=16, vocab=50304, positions=1024)  # ~1.1 B: "a smaller critic"


@dataclass(frozen=True)
class Setting:
    """A published configuration: the model, the stage, GPUs per data-parallel group, ZeRO stage, batch."""

    arch: Arch
    stage: str
    gpus: int
    zero: int
    micro_batch: int
    seq: int
    lora: int = 0
    offload: bool = False
    critic_arch: Arch | None = None
    precision: str = "bf16"  # fp16 where the GPU has no bf16; both hold 2 bytes a value


def lower_bound(setting: Setting) -> float:
    """Bytes per GPU that the stated configuration must hold at least (see the module docstring)."""
    workload = Workload(precision=setting.precision, micro_batch=setting.micro_batch, prompt_len=setting.seq // 2,
                        answer_len=setting.seq - setting.seq // 2, lora=setting.lora)
    total, working = 0.0, 0.0
    for name in STAGE_ROLES[setting.stage]:
        arch = setting.critic_arch if (setting.critic_arch and name in ("critic", "reward")) else setting.arch
        role = Role(name, arch, setting.lora)
        zero = setting.zero if (role.trained or setting.zero == 3) else 0
        layout = Layout(dp=setting.gpus, zero=zero, offload=setting.offload and role.trained and zero >= 1,
                        recompute=True)
        total += resident(role, layout, workload).device
        if role.trained:
            t = training(role, layout, workload)
            working = max(working, t.grads + t.activations)
    return total + working


CHANGES = (("LoRA rank 8", {"lora": 8}), ("optimizer offload", {"offload": True}), ("ZeRO-3", {"zero": 3}),
           ("ZeRO-3 + LoRA rank 8", {"zero": 3, "lora": 8}), ("ZeRO-3 + offload", {"zero": 3, "offload": True}),
           ("a ~1 B critic and reward", {"critic_arch": SMALL_MODEL}))


def memory_figures(setting: Setting, figures_gb: dict[str, float]) -> tuple[str, str]:
    """(verdict, evidence) for published per-GPU peaks of one stage: implausible if any is below the bound."""
    bound = lower_bound(setting)
    low = {k: v for k, v in figures_gb.items() if v * GB < bound}
    base = (f"the stated configuration ({setting.stage.upper()}, {_describe(setting)}) must hold at least "
            f"{_both(bound)} per GPU (model states + recomputed activations, nothing else)")
    if not low:
        shown = ", ".join(f"{k} {v:g}" for k, v in figures_gb.items())
        return CONSISTENT, f"{base}; every figure ({shown} GB) is above it"
    possible = []
    for name, change in CHANGES:
        if ("critic_arch" in change and setting.stage != "ppo") or ("lora" in change and setting.lora) \
                or (change == {"offload": True} and setting.offload):
            continue
        changed = lower_bound(replace(setting, **change))
        fits = [k for k, v in low.items() if v * GB >= changed]
        possible.append(f"{name}: {_both(changed)}" + (f" (makes {', '.join(fits)} possible)" if fits else ""))
    shown = ", ".join(f"{k} {v:g} GB" for k, v in low.items())
    return IMPLAUSIBLE, f"{base}; below it: {shown}. Bounds with one change: {'; '.join(possible)}"


def _both(size: float) -> str:
    return f"{size / GB:.1f} GB ({size / GIB:.1f} GiB)"


def _describe(setting: Setting) -> str:
    parts = [f"{setting.arch.total_params / 1e9:.1f} B parameters", f"ZeRO-{setting.zero} over {setting.gpus} GPUs",
             f"micro-batch {setting.micro_batch} x {setting.seq} tokens", setting.precision]
    if setting.lora:
        parts.append(f"LoRA {setting.lora}")
    if setting.offload:
        parts.append("optimizer offload")
    return ", ".join(parts)


def fits_device(setting: Setting, gpu: str, share: float = SAFETY) -> tuple[str, str]:
    """Whether the stated configuration's bound fits `share` of a GPU's memory as torch reports it
    (bench.plan.cluster.GPUS: total_memory, somewhat below the card's nominal size): by default the share a plan
    or a run may fill, as every claim judged against a card uses."""
    card = GPUS[gpu]
    bound, usable = lower_bound(setting), share * card.total_memory_bytes
    verdict = CONSISTENT if bound <= usable else IMPLAUSIBLE
    return verdict, (f"{setting.stage.upper()}, {_describe(setting)}: at least {_both(bound)} per GPU against "
                     f"{_both(usable)} ({share:.0%} of the {gpu}'s {card.total_memory_gib:.2f} GiB as torch reports "
                     "it)")


def batch_arithmetic(global_batch: int, micro_batch: int, accumulation: int, data_parallel: int) -> tuple[str, str]:
    """global batch = micro-batch x gradient accumulation x data parallel (DeepSpeed refuses anything else)."""
    product = micro_batch * accumulation * data_parallel
    text = (f"micro-batch {micro_batch} x accumulation {accumulation} x data parallel {data_parallel} = {product}, "
            f"stated global batch {global_batch}")
    return (CONSISTENT if product == global_batch else IMPLAUSIBLE), text


def dtype_support(gpu: str, precision: str) -> tuple[str, str]:
    spec = GPUS[gpu]
    if precision == "bf16" and not spec.bf16:
        return IMPLAUSIBLE, f"{gpu} has no bf16 support (no bf16 tensor cores); fp16 or fp32 only"
    return CONSISTENT, f"{gpu} supports {precision}"
