"""The reference's knobs, validated before launch (imports nothing heavy).

ZeRO stages map to PyTorch's own sharding: 0 = DDP (a bare module on one rank), 1 = DDP with
ZeroRedundancyOptimizer (optimizer state sharded), 2 = FSDP2 `fully_shard` with reshard_after_forward=False
(parameters stay gathered from forward to backward, as ZeRO-2 keeps them whole), 3 = FSDP2 `fully_shard`
(parameters gathered per block and freed after it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from bench.run.plan_run import PlanKnobs, data_parallel_only, uniform_knobs
from bench.run.spec import RunSpec, SpecError, UnsupportedError, refuse_comm_knobs, require_data_parallel_only

LAYOUTS = {0: "DDP", 1: "DDP + ZeroRedundancyOptimizer", 2: "FSDP2 fully_shard(reshard_after_forward=False)",
           3: "FSDP2 fully_shard"}


@dataclass(frozen=True)
class PPOOptions:
    kl_coef: float = 0.1
    clip_reward_value: float = 5.0
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    ppo_epochs: int = 1
    temperature: float = 1.0
    top_k: int = 0


@dataclass(frozen=True)
class ReferenceOptions:
    #: Options the prerequisite reward model (fp32, ZeRO-0, no LoRA) never reads: not part of its cache key.
    prerequisite_ignores: ClassVar[tuple[str, ...]] = ("ppo", "lora_alpha")
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    initial_scale: float = 2.0**16
    lora_alpha: float = 32.0
    ppo: PPOOptions = field(default_factory=PPOOptions)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReferenceOptions:
        data = dict(data)
        data.pop("default_precision", None)  # the config group's default for the common `precision` knob
        try:
            options = cls(**{**data, "betas": tuple(data.get("betas", (0.9, 0.95))),
                             "ppo": PPOOptions(**dict(data.get("ppo", {})))})
        except TypeError as err:
            raise SpecError(f"framework (torch): {err}") from None
        if options.ppo.ppo_epochs < 1:
            raise SpecError(f"framework.ppo.ppo_epochs={options.ppo.ppo_epochs} must be >= 1")
        if options.grad_clip < 0:
            raise SpecError(f"framework.grad_clip={options.grad_clip} must be >= 0 (0 = no clipping)")
        return options

    @classmethod
    def plan_knobs(cls, layouts: dict[str, Any]) -> PlanKnobs:
        """The reference trains on one data-parallel mesh (DDP, or FSDP2 at ZeRO >= 2) for every model."""
        data_parallel_only("torch", layouts, "the plain-PyTorch reference has data parallelism only (DDP, FSDP2)")
        return uniform_knobs("torch", layouts, "one mesh for every model")

    @classmethod
    def harness_extensions(cls, spec: RunSpec) -> list[dict[str, str]]:
        """None: the reference has no upstream whose scripts could refuse a knob."""
        return []

    @classmethod
    def validate(cls, spec: RunSpec) -> ReferenceOptions:
        options = cls.from_dict(spec.framework_options)
        require_data_parallel_only(spec, "the plain-PyTorch reference", "has data parallelism only (DDP, FSDP2)")
        refuse_comm_knobs(spec, "the plain-PyTorch reference trains through DDP or FSDP2, not DeepSpeed")
        if spec.offload:
            raise UnsupportedError("offload=true: the plain-PyTorch reference has no CPU offload (FSDP2's "
                                   "CPUOffloadPolicy would be a different memory layout than the engines' offload)")
        if spec.checkpoint.every or spec.resume:
            raise UnsupportedError("checkpoint.every / resume: the plain-PyTorch reference saves each stage's model "
                                   "at its end only (no mid-stage checkpoints yet)")
        if spec.precision == "fp16" and spec.zero >= 2:
            raise UnsupportedError(f"precision=fp16 with zero={spec.zero}: the reference scales fp16 losses with "
                                   "torch.amp.GradScaler, which it runs under DDP only (zero 0 or 1)")
        return options
