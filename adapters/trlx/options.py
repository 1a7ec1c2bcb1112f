"""Trlx's knobs, validated before launch (imports no framework)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from adapters.lora_targets import require_peft_default
from bench.run.plan_run import PlanKnobs, data_parallel_only, refuse, same_for, uniform_knobs
from bench.run.spec import (
    RunSpec,
    SpecError,
    UnsupportedError,
    checkpoint_extensions,
    normalize_extensions,
    quant_extensions,
    refuse_comm_knobs,
    require_data_parallel_only,
)

REFERENCES = ("auto", "hydra", "full", "peft")
# families trlx's hf_get_branch_class has a hydra branch for (GPTModelBranch, LlamaModelBranch); any other raises
# "Unsupported architecture" when the reference is built
BRANCH_FAMILIES = ("gpt2", "llama")
SCALE_REWARD = ("ignored", "running", "ref")


@dataclass(frozen=True)
class LoraOptions:
    alpha: float = 32.0
    dropout: float = 0.1


@dataclass(frozen=True)
class PPOOptions:
    init_kl_coef: float = 0.001
    target: float | None = None
    horizon: int = 10000
    gamma: float = 1.0
    lam: float = 0.95
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 1.0
    scale_reward: str = "running"
    cliprange_reward: float = 10.0
    ppo_epochs: int = 4
    num_rollouts: int | None = None
    top_k: int = 0
    top_p: float = 1.0


def default_layers_unfrozen(arch: str) -> int:
    """num_layers_unfrozen when the config leaves it null: the hh example's 2 where trlx has a hydra branch for
    the family, else trlx's ModelConfig default -1 (every layer trains against a full reference copy: the only
    full-tuning path trlx offers a family without a branch class)."""
    return 2 if arch in BRANCH_FAMILIES else -1


@dataclass(frozen=True)
class TrlxOptions:
    #: Options the prerequisite reward model (fp32, ZeRO-0, no LoRA) never reads: not part of its cache key.
    prerequisite_ignores: ClassVar[tuple[str, ...]] = ("ppo", "reference", "num_layers_unfrozen", "lora",
                                                          "reward_batch_size", "reward_device")
    reference: str = "auto"
    num_layers_unfrozen: int | None = None  # null: default_layers_unfrozen(arch)
    optimizer: str = "adamw"
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 1e-6
    rm_unfrozen_fraction: float | None = 0.3
    reward_batch_size: int = 48
    reward_device: str | None = None
    scheduler_t_max: float = 1e12
    scheduler_eta_min: float | None = None
    rm_warmup_steps: int = 0
    lora: LoraOptions = field(default_factory=LoraOptions)
    ppo: PPOOptions = field(default_factory=PPOOptions)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrlxOptions:
        data = dict(data)
        data.pop("default_precision", None)  # the config group's default for the common `precision` knob
        try:
            options = cls(**{**data, "betas": tuple(data.get("betas", (0.9, 0.95))),
                             "lora": LoraOptions(**dict(data.get("lora", {}))),
                             "ppo": PPOOptions(**dict(data.get("ppo", {})))})
        except TypeError as err:
            raise SpecError(f"framework (trlx): {err}") from None
        if options.reference not in REFERENCES:
            raise SpecError(f"framework.reference={options.reference!r} is not allowed; "
                            f"choose one of: {', '.join(REFERENCES)}")
        if not options.scheduler_t_max > 0:
            raise SpecError(f"framework.scheduler_t_max={options.scheduler_t_max!r} must be > 0")
        if options.scheduler_eta_min is not None and not options.scheduler_eta_min >= 0:
            raise SpecError(f"framework.scheduler_eta_min={options.scheduler_eta_min!r} must be null (the learning "
                            "rate: a constant rate, as trlx's configs) or >= 0")
        if isinstance(options.rm_warmup_steps, bool) or not isinstance(options.rm_warmup_steps, int) \
                or options.rm_warmup_steps < 0:
            raise SpecError(f"framework.rm_warmup_steps={options.rm_warmup_steps!r} must be an integer >= 0")
        if options.optimizer != "adamw":
            raise SpecError(f"framework.optimizer={options.optimizer!r} is not allowed; choose one of: adamw")
        if options.ppo.scale_reward not in SCALE_REWARD:
            raise SpecError(f"framework.ppo.scale_reward={options.ppo.scale_reward!r} is not allowed; "
                            f"choose one of: {', '.join(SCALE_REWARD)}")
        if options.ppo.ppo_epochs < 1:
            raise SpecError(f"framework.ppo.ppo_epochs={options.ppo.ppo_epochs} must be >= 1")
        if isinstance(options.reward_batch_size, bool) or not isinstance(options.reward_batch_size, int) \
                or options.reward_batch_size < 1:
            raise SpecError(f"framework.reward_batch_size={options.reward_batch_size!r} must be an integer >= 1")
        fraction = options.rm_unfrozen_fraction
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                     or not 0 < fraction <= 1):
            raise SpecError(f"framework.rm_unfrozen_fraction={fraction!r} must be null (train every layer) or a "
                            "number in (0, 1]")
        device = options.reward_device
        if device is not None and not (isinstance(device, str) and (device == "cpu" or device == "cuda" or (
                device.startswith("cuda:") and device[5:].isdigit()))):
            raise SpecError(f"framework.reward_device={device!r} is not allowed; choose null (rank 0's training "
                            "device), cpu or cuda:N")
        return options

    def num_rollouts(self, spec: RunSpec) -> int:
        """Rollouts per rank a learning phase trains on: `ppo.num_rollouts`, or upstream's ratio to the optimizer
        step's samples (default_ppo_config: 128 rollouts, batch_size 32) with train.batch_size = batch x
        grad_accum: 4 x batch x grad_accum."""
        return self.ppo.num_rollouts or 4 * spec.batch * spec.grad_accum

    def reference_mode(self, lora: int) -> str:
        """auto follows trlx: peft with LoRA, else a hydra branch, or a full copy at num_layers_unfrozen=-1."""
        if self.reference == "auto":
            return "peft" if lora else "full" if self.num_layers_unfrozen == -1 else "hydra"
        return self.reference

    @classmethod
    def plan_knobs(cls, layouts: dict[str, Any]) -> PlanKnobs:
        """trlx trains one model, the policy with its value head (AutoModelForCausalLMWithHydraValueHead), under
        one accelerate/DeepSpeed config: actor and critic share a layout; the reference (a hydra branch, or a
        frozen copy) and the reward function stay outside DeepSpeed, whole on every rank."""
        data_parallel_only("trlx", layouts, "trlx trains with data parallelism only (accelerate with DeepSpeed)")
        same_for("trlx", layouts, ("actor", "critic"), ("zero", "offload", "recompute"),
                 "the critic is the policy's value head: one model, one engine")
        for role in ("reference", "reward"):
            if layouts[role].zero:
                raise refuse("trlx", role, "zero", layouts[role].zero, "trlx keeps it outside DeepSpeed, whole on "
                             "every rank (zero: 0)")
        knobs = uniform_knobs("trlx", layouts, None)
        return PlanKnobs(knobs.common, {**knobs.per_role, "critic": {"the policy's value head": "(the actor's)"}})

    @classmethod
    def harness_extensions(cls, spec: RunSpec) -> list[dict[str, str]]:
        """Knobs of this run trlx's own trainers cannot run."""
        found = []
        if spec.grad_ckpt:
            found.append({"knob": "grad_ckpt=true", "reason": "trlx's trainers have no gradient-checkpointing knob"})
        if spec.grad_clip and spec.zero == 0:
            found.append({"knob": f"grad_clip={spec.grad_clip} at zero=0", "reason": "trlx clips only through "
                          "DeepSpeed's gradient_clipping; its DDP path calls no clip (the harness clips there)"})
        return (found + checkpoint_extensions(spec, "trlx", upstream_saves=True)
                + quant_extensions(spec, "trlx") + normalize_extensions(spec, "trlx", ("none", "running")))

    @classmethod
    def validate(cls, spec: RunSpec) -> TrlxOptions:
        options = cls.from_dict(spec.framework_options)
        arch = spec.model.arch
        if options.num_layers_unfrozen is None:
            options = dataclasses.replace(options, num_layers_unfrozen=default_layers_unfrozen(arch))
        require_data_parallel_only(spec, "trlx", "accelerate trainers have no tensor or pipeline parallelism; only "
                                   "its NeMo trainers do")
        require_peft_default(spec, "trlx")
        if spec.zero == 0:
            refuse_comm_knobs(spec, "trlx at zero=0 trains through accelerate's DDP, not DeepSpeed")
        rollouts, per_step = options.ppo.num_rollouts, spec.batch * spec.grad_accum
        if rollouts is not None and (isinstance(rollouts, bool) or not isinstance(rollouts, int) or rollouts < 1
                                     or rollouts % per_step):
            raise SpecError(f"framework.ppo.num_rollouts={rollouts!r} must be null (4 x batch x grad_accum, "
                            f"upstream's ratio) or a positive multiple of batch x grad_accum = {per_step}: whole "
                            "minibatches (train.batch_size) of whole generate calls (chunk_size = batch)")
        mode = options.reference_mode(spec.lora)
        if mode == "peft" and not spec.lora:
            raise UnsupportedError("framework.reference=peft needs lora > 0: the reference is the policy with its "
                                   "LoRA adapters disabled")
        if spec.lora and mode != "peft":
            raise UnsupportedError(f"framework.reference={mode} with lora={spec.lora}: with peft trlx ignores "
                                   "num_layers_unfrozen and disables the adapters for the reference (use peft)")
        if mode == "hydra" and "ppo" in spec.stages and arch not in BRANCH_FAMILIES:
            raise UnsupportedError(
                f"framework.num_layers_unfrozen={options.num_layers_unfrozen} asks for a hydra reference, and trlx's "
                f"hf_get_branch_class has no branch for the {arch} family (it raises \"Unsupported architecture\"; "
                f"branches exist for {', '.join(BRANCH_FAMILIES)} among ours): use num_layers_unfrozen=-1 (a full "
                "reference copy) or LoRA (the peft reference)")
        if mode == "hydra" and not 0 < options.num_layers_unfrozen < spec.model.layers:
            raise SpecError(f"framework.num_layers_unfrozen={options.num_layers_unfrozen} must be between 1 and "
                            f"{spec.model.layers - 1} for the hydra reference (model.layers={spec.model.layers}); "
                            "-1 trains every layer against a full reference copy")
        if spec.reference.quant != "none" and mode == "peft":
            raise UnsupportedError(f"reference.quant={spec.reference.quant}: with LoRA trlx's reference is the policy "
                                   "with its adapters disabled, no weights of its own to quantize (quantize the "
                                   "reward, or set lora=0)")
        if spec.reference.quant != "none" and mode == "hydra" and spec.zero == 3:
            raise UnsupportedError(f"reference.quant={spec.reference.quant} at zero=3: the hydra branch lives in the "
                                   "policy DeepSpeed partitions, and ZeRO-3 cannot partition bitsandbytes weights "
                                   "(use zero <= 2)")
        if spec.offload:
            raise UnsupportedError("offload with trlx is not wired in this harness yet (accelerate's "
                                   "offload_optimizer_device needs DeepSpeed's CPU Adam instead of trlx's AdamW)")
        return options
