"""TRL's knobs, validated before launch (imports nothing heavy).

The common knobs map onto TRL's training arguments (PPOConfig, GRPOConfig, SFTConfig, RewardConfig) and
accelerate's DeepSpeed plugin; what TRL's trainers have no way to run is refused here, naming why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from adapters.lora_targets import require_peft_default
from bench.run.plan_run import PlanKnobs, data_parallel_only, uniform_knobs
from bench.run.spec import RunSpec, SpecError, UnsupportedError, refuse_comm_knobs, require_data_parallel_only

KL_ESTIMATORS = ("k1", "k3")
STOP_TOKENS = ("eos", None)
GRPO_LOSSES = ("grpo", "bnpo", "dr_grpo")


@dataclass(frozen=True)
class LoraOptions:
    alpha: float = 32.0
    dropout: float = 0.05


@dataclass(frozen=True)
class PPOOptions:
    num_ppo_epochs: int = 4
    num_mini_batches: int = 1
    kl_coef: float = 0.05
    kl_estimator: str = "k1"
    cliprange: float = 0.2
    vf_coef: float = 0.1
    cliprange_value: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    whiten_rewards: bool = False
    temperature: float = 0.7
    stop_token: str | None = "eos"
    missing_eos_penalty: float | None = None


@dataclass(frozen=True)
class GRPOOptions:
    num_generations: int = 4
    beta: float = 0.0
    num_iterations: int = 1
    epsilon: float = 0.2
    loss_type: str = "bnpo"
    scale_rewards: bool = True
    temperature: float = 1.0


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"framework.{name}={value!r} must be an integer >= 1")


@dataclass(frozen=True)
class TrlOptions:
    #: Options the prerequisite reward model (fp32, ZeRO-0, no LoRA) never reads: not part of its cache key.
    prerequisite_ignores: ClassVar[tuple[str, ...]] = ("ppo", "grpo", "lora")
    lora: LoraOptions = field(default_factory=LoraOptions)
    ppo: PPOOptions = field(default_factory=PPOOptions)
    grpo: GRPOOptions = field(default_factory=GRPOOptions)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrlOptions:
        data = dict(data)
        data.pop("default_precision", None)  # the config group's default for the common `precision` knob
        try:
            options = cls(lora=LoraOptions(**dict(data.pop("lora", {}))), ppo=PPOOptions(**dict(data.pop("ppo", {}))),
                          grpo=GRPOOptions(**dict(data.pop("grpo", {}))), **data)
        except TypeError as err:
            raise SpecError(f"framework (trl): {err}") from None
        ppo, grpo = options.ppo, options.grpo
        for name, value in (("ppo.num_ppo_epochs", ppo.num_ppo_epochs), ("ppo.num_mini_batches", ppo.num_mini_batches),
                            ("grpo.num_generations", grpo.num_generations),
                            ("grpo.num_iterations", grpo.num_iterations)):
            _positive_int(name, value)
        if grpo.num_generations < 2:
            raise SpecError(f"framework.grpo.num_generations={grpo.num_generations} must be >= 2: GRPO's advantage "
                            "is a reward relative to the other answers of its group")
        if ppo.kl_estimator not in KL_ESTIMATORS:
            raise SpecError(f"framework.ppo.kl_estimator={ppo.kl_estimator!r} is not allowed; choose one of: k1, k3")
        if ppo.stop_token not in STOP_TOKENS:
            raise SpecError(f"framework.ppo.stop_token={ppo.stop_token!r} is not allowed; choose eos or null")
        if grpo.loss_type not in GRPO_LOSSES:
            raise SpecError(f"framework.grpo.loss_type={grpo.loss_type!r} is not allowed; choose one of: "
                            f"{', '.join(GRPO_LOSSES)}")
        return options

    @classmethod
    def plan_knobs(cls, layouts: dict[str, Any]) -> PlanKnobs:
        """TRL's PPOTrainer prepares policy and value model together (PolicyAndValueWrapper) with one accelerate
        config; reference and reward join DeepSpeed only at ZeRO-3 (prepare_deepspeed), else stay whole."""
        data_parallel_only("trl", layouts, "TRL trains with data parallelism only (accelerate DDP or DeepSpeed)")
        return uniform_knobs("trl", layouts, "TRL prepares its frozen models for DeepSpeed only at ZeRO-3")

    @classmethod
    def harness_extensions(cls, spec: RunSpec) -> list[dict[str, str]]:
        """None: every knob TRL cannot run is refused (validate) rather than added by the harness."""
        return []

    @classmethod
    def validate(cls, spec: RunSpec) -> TrlOptions:
        options = cls.from_dict(spec.framework_options)
        require_data_parallel_only(spec, "TRL", "trains with data parallelism only (accelerate DDP or DeepSpeed ZeRO)")
        require_peft_default(spec, "TRL")
        refuse_comm_knobs(spec, "TRL takes DeepSpeed's bucket settings only from a DeepSpeed config file, which this "
                                "harness does not write for it (accelerate's plugin defaults run)")
        rollout = [s for s in spec.stages if s in ("ppo", "grpo")]
        if spec.grad_accum > 1 and rollout:
            raise UnsupportedError(
                f"grad_accum={spec.grad_accum} with stage {rollout[0]}: TRL generates all of a step's "
                "per_device_train_batch_size x gradient_accumulation_steps prompts in one generation call, so its "
                "micro-batches have no rollouts of their own to measure; use grad_accum=1 and a larger batch")
        if spec.grad_ckpt and "ppo" in spec.stages:
            raise UnsupportedError("grad_ckpt=true with PPO: TRL's PPOTrainer runs its own loop and never enables "
                                   "gradient checkpointing (TrainingArguments.gradient_checkpointing is ignored there)")
        if spec.lora and spec.zero == 3 and "rm" in spec.stages:
            raise UnsupportedError(
                "lora with zero=3 and an RM stage: RewardTrainer's peft model (task SEQ_CLS, the score head in "
                "modules_to_save) fails in DeepSpeed 0.19.8's ZeRO-3 set-up (stage3.py defragment: trainable "
                "partitions of two dtypes); run the RM at zero<=2, or without LoRA")
        if spec.checkpoint.every or spec.resume:
            raise UnsupportedError("checkpoint.every / resume: not wired for TRL yet (its trainers save through "
                                   "save_strategy, which this harness leaves off)")
        for role in ("reference", "reward"):
            if getattr(spec, role).quant != "none":
                raise UnsupportedError(f"{role}.quant={getattr(spec, role).quant}: not wired for TRL (its trainers "
                                       "build their frozen models themselves)")
        if spec.reward.normalize not in (None, "none"):
            raise UnsupportedError(f"reward.normalize={spec.reward.normalize}: TRL's PPO takes the reward model's "
                                   "score as it is (its whiten_rewards whitens per-token rewards, framework.ppo."
                                   "whiten_rewards); leave it null")
        return options
