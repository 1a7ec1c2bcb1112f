"""DS-Chat's knobs, validated before launch (imports no framework)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from adapters.lora_targets import suffixes
from bench.run.families import family
from bench.run.plan_run import PlanKnobs, data_parallel_only, frozen_follow, same_for
from bench.run.spec import (
    RunSpec,
    SpecError,
    UnsupportedError,
    checkpoint_extensions,
    normalize_extensions,
    quant_extensions,
    require_data_parallel_only,
)

OPTIMIZERS = ("fused_adam", "torch_adamw")
SCHEDULERS = ("cosine", "linear", "constant", "constant_with_warmup")  # --lr_scheduler_type (transformers')


# --*_lora_module_name's value for each family's block list, as DS-Chat's scripts pass it: "decoder.layers." for
# OPT, "layers." for Llama; "h." is GPT-2's (the GLM stand-in) equivalent
FAMILY_MODULE_NAME = {"gpt2": "h."}
LLAMA_MODULE_NAME = "layers."


def pad_is_eos(arch: str) -> bool:
    """Whether DS-Chat's tokenizer pads with its EOS: dschat/utils/utils.py `get_tokenizer` sets pad = EOS for
    every model path but a Llama one ("llama" in the path), which gets a [PAD] token of its own."""
    return arch != "llama"


def lora_module_names(targets: tuple[str, ...] | None, default: str, arch: str = "gpt2") -> tuple[str, ...]:
    """The substrings that select `targets` (lora_targets meanings) the way DS-Chat's --*_lora_module_name does:
    one where a single substring selects exactly those modules (the default for all of them, the attention
    or MLP prefix -- GPT-2's "attn.", Llama's "self_attn.", "mlp." -- or a module's own qualified suffix); else
    one per module."""
    modules = family(arch).distinct_modules
    chosen = suffixes(targets, arch) if targets is not None else list(modules)
    if set(chosen) == set(modules):
        return (default,)
    if len(chosen) == 1:
        return (chosen[0],)
    for prefix in dict.fromkeys(m.split(".")[0] + "." for m in modules):
        if {m for m in modules if m.startswith(prefix)} == set(chosen):
            return (prefix,)
    return tuple(chosen)


@dataclass(frozen=True)
class PPOOptions:
    kl_ctl: float = 0.1
    clip_reward_value: float = 5.0
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    ppo_epochs: int = 1
    do_sample: bool = True
    top_k: int = 0
    temperature: float = 1.0


@dataclass(frozen=True)
class DSChatOptions:
    #: Options the prerequisite reward model (fp32, ZeRO-0, no LoRA) never reads: not part of its cache key.
    prerequisite_ignores: ClassVar[tuple[str, ...]] = (
        "ppo", "hybrid_engine", "lora_module_name", "lora_lr", "only_optimize_lora", "fp16_loss_scale_window",
        "fix_fp16_zero0_loss_scale", "compute_fp32_loss", "actor_dropout", "critic_dropout", "critic_lora_dim",
        "critic_zero_stage", "critic_gradient_checkpointing")
    optimizer: str = "fused_adam"
    hybrid_engine: bool = False
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    gradient_clipping: float = 1.0
    fp16_loss_scale_window: int = 100
    lora_module_name: str | None = None  # null: the family's block list (FAMILY_MODULE_NAME)
    lora_lr: float = 5e-4
    only_optimize_lora: bool = False
    critic_lora_dim: int = 0
    critic_zero_stage: int | None = None  # --critic_zero_stage; null: `zero` (as --actor_zero_stage)
    critic_gradient_checkpointing: bool | None = None  # --critic_gradient_checkpointing; null: `grad_ckpt`
    actor_dropout: float | None = 0.0
    critic_dropout: float | None = None
    compute_fp32_loss: bool = False
    fix_fp16_zero0_loss_scale: bool = False
    lr_scheduler_type: str = "cosine"
    num_warmup_steps: dict[str, int | None] = field(default_factory=lambda: {"sft": 0, "rm": 0, "ppo": None})
    ppo: PPOOptions = field(default_factory=PPOOptions)

    def critic_stage(self, zero: int) -> int:
        """The critic's ZeRO stage (upstream's reward engine follows it into ZeRO-3, as the reference the actor)."""
        return zero if self.critic_zero_stage is None else self.critic_zero_stage

    def critic_checkpointing(self, grad_ckpt: bool) -> bool:
        return grad_ckpt if self.critic_gradient_checkpointing is None else self.critic_gradient_checkpointing

    def module_name(self, arch: str) -> str:
        """--*_lora_module_name: the option, else the family's block list as the scripts pass it."""
        return self.lora_module_name or FAMILY_MODULE_NAME.get(arch, LLAMA_MODULE_NAME)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DSChatOptions:
        data = dict(data)
        data.pop("default_precision", None)  # the config group's default for the common `precision` knob
        try:
            ppo = PPOOptions(**dict(data.pop("ppo", {})))
            warmup = {"sft": 0, "rm": 0, "ppo": None, **dict(data.pop("num_warmup_steps", None) or {})}
            options = cls(**{**data, "betas": tuple(data.get("betas", (0.9, 0.95))), "ppo": ppo,
                             "num_warmup_steps": warmup})
        except TypeError as err:
            raise SpecError(f"framework (dschat): {err}") from None
        if options.optimizer not in OPTIMIZERS:
            raise SpecError(
                f"framework.optimizer={options.optimizer!r} is not allowed; choose one of: {', '.join(OPTIMIZERS)}"
            )
        if not isinstance(options.fix_fp16_zero0_loss_scale, bool):
            raise SpecError(f"framework.fix_fp16_zero0_loss_scale={options.fix_fp16_zero0_loss_scale!r} must be "
                            "true or false")
        for name in ("only_optimize_lora", "compute_fp32_loss"):
            if not isinstance(getattr(options, name), bool):
                raise SpecError(f"framework.{name}={getattr(options, name)!r} must be true or false")
        if isinstance(options.critic_lora_dim, bool) or not isinstance(options.critic_lora_dim, int) \
                or options.critic_lora_dim < 0:
            raise SpecError(f"framework.critic_lora_dim={options.critic_lora_dim!r} must be an integer >= 0")
        stage = options.critic_zero_stage
        if stage is not None and (isinstance(stage, bool) or stage not in (0, 1, 2, 3)):
            raise SpecError(f"framework.critic_zero_stage={stage!r}: allowed null (the run's zero), 0, 1, 2 or 3")
        if options.critic_gradient_checkpointing not in (None, True, False):
            raise SpecError(f"framework.critic_gradient_checkpointing={options.critic_gradient_checkpointing!r}: "
                            "allowed null (the run's grad_ckpt), true or false")
        for name in ("actor_dropout", "critic_dropout"):
            value = getattr(options, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 <= value < 1):
                raise SpecError(f"framework.{name}={value!r} must be null (keep the model's) or a number in [0, 1)")
        if options.lr_scheduler_type not in SCHEDULERS:
            raise SpecError(f"framework.lr_scheduler_type={options.lr_scheduler_type!r} is not allowed; choose one "
                            f"of: {', '.join(SCHEDULERS)}")
        for stage, value in options.num_warmup_steps.items():
            if stage not in ("sft", "rm", "ppo"):
                raise SpecError(f"framework.num_warmup_steps.{stage}: no such stage; it takes sft, rm and ppo")
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise SpecError(f"framework.num_warmup_steps.{stage}={value!r} must be null (upstream's) or an "
                                "integer >= 0")
        if options.ppo.ppo_epochs < 1:
            raise SpecError(f"framework.ppo.ppo_epochs={options.ppo.ppo_epochs} must be >= 1")
        return options

    @classmethod
    def plan_knobs(cls, layouts: dict[str, Any]) -> PlanKnobs:
        """An execution plan's layouts as DS-Chat's step-3 flags (rlhf_engine.py): --actor_zero_stage and
        --critic_zero_stage apart, the reference and reward engines following them into ZeRO-3 (else 0), one
        --offload for both trained models, gradient checkpointing per trained model; no training TP or PP, and
        every engine spans every GPU."""
        data_parallel_only("dschat", layouts, "DS-Chat trains without tensor or pipeline parallelism (its only TP "
                           "is the Hybrid Engine's inference TP, which the harness runs at 1)")
        same_for("dschat", layouts, ("actor", "critic"), ("offload",), "DS-Chat's --offload covers actor and critic")
        frozen_follow("dschat", layouts, {"reference": "actor", "reward": "critic"}, "DS-Chat's eval engines "
                      "follow the trained ones")
        actor, critic = layouts["actor"], layouts["critic"]
        common = {"zero": actor.zero, "offload": actor.offload, "grad_ckpt": actor.recompute,
                  "framework.critic_zero_stage": critic.zero,
                  "framework.critic_gradient_checkpointing": critic.recompute}
        return PlanKnobs(common, {
            "actor": {"zero (--actor_zero_stage)": actor.zero, "grad_ckpt (--actor_gradient_checkpointing)":
                      actor.recompute, "offload (--offload)": actor.offload},
            "critic": {"framework.critic_zero_stage (--critic_zero_stage)": critic.zero,
                       "framework.critic_gradient_checkpointing (--critic_gradient_checkpointing)": critic.recompute,
                       "offload (--offload)": critic.offload},
            "reference": {"ZeRO stage (follows the actor's)": layouts["reference"].zero},
            "reward": {"ZeRO stage (follows the critic's)": layouts["reward"].zero}})

    @classmethod
    def harness_extensions(cls, spec: RunSpec) -> list[dict[str, str]]:
        """Knobs of this run DS-Chat's own scripts cannot run."""
        options = cls.from_dict(spec.framework_options)
        found = []
        if spec.lora and len(lora_module_names(spec.lora_target_set, options.module_name(spec.model.arch),
                                               spec.model.arch)) > 1:
            found.append({"knob": f"lora_targets={spec.lora_targets}", "reason": "--actor_lora_module_name is one "
                          "substring; no single one selects these layers (the harness converts each by its name)"})
        if spec.lora and spec.lora_alpha is not None:
            found.append({"knob": f"lora_alpha={spec.lora_alpha}", "reason": "no DS-Chat script passes "
                          "convert_linear_layer_to_lora's lora_scaling (upstream's alpha is 1)"})
        if spec.precision == "fp32":
            found.append({"knob": "precision=fp32", "reason": "DS-Chat's --dtype takes fp16 or bf16 only"})
        if options.optimizer == "torch_adamw":
            found.append({"knob": "framework.optimizer=torch_adamw",
                          "reason": "DS-Chat always builds FusedAdam (DeepSpeedCPUAdam with --offload)"})
        return (found + checkpoint_extensions(spec, "DS-Chat", upstream_saves=False)
                + quant_extensions(spec, "DS-Chat") + normalize_extensions(spec, "DS-Chat"))

    @classmethod
    def validate(cls, spec: RunSpec) -> DSChatOptions:
        options = cls.from_dict(spec.framework_options)
        require_data_parallel_only(spec, "dschat", "trains without tensor or pipeline parallelism; its only TP is "
                                   "the Hybrid Engine's inference TP during generation")
        if (options.hybrid_engine and spec.offload and spec.zero == 2 and spec.lora == 0
                and "ppo" in spec.stages):
            # DS-Chat's step-3 main.py refuses this exact combination with a ValueError.
            raise UnsupportedError(
                "dschat refuses hybrid_engine + offload + zero=2 without LoRA "
                "('unsupported due to training instability'); use lora > 0, zero=3 or no offload"
            )
        return options
