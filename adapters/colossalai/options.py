"""ColossalChat's knobs and the plugin choice, validated before launch (imports no framework)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from bench.run.plan_run import PlanKnobs, refuse, same_for, uniform_knobs
from bench.run.spec import (
    RunSpec,
    SpecError,
    UnsupportedError,
    checkpoint_extensions,
    normalize_extensions,
    quant_extensions,
)

OPTIMIZERS = ("hybrid_adam", "torch_adamw")
PLUGIN_CLASSES = ("TorchDDPPlugin", "LowLevelZeroPlugin", "GeminiPlugin", "HybridParallelPlugin")
# families whose transformers classes colossalai 0.5.0's shardformer has a policy for (auto_policy._POLICY_LIST);
# HybridParallelPlugin shards nothing else (GLM-4's GlmForCausalLM has none: only ChatGLM's remote code does)
SHARDFORMER_FAMILIES = ("gpt2", "llama", "qwen2", "mistral")
LORA_BIAS = ("none", "all", "lora")


@dataclass(frozen=True)
class LoraOptions:
    alpha: float = 32.0  # reaches the embedding wrapper only: coati's linear wrapper keeps LoraLinear's 32
    embedding_dropout: float = 0.0
    train_bias: str = "none"


@dataclass(frozen=True)
class PPOOptions:
    kl_coef: float = 0.1
    reward_clip: float = 5.0
    eps_clip: float = 0.2
    value_clip: float = 0.2
    vf_coef: float = 1.0
    gamma: float = 1.0
    lam: float = 0.95
    skip_threshold: float = 20.0
    ratio_max: float = 10.0
    temperature: float = 0.7
    top_k: int = 50
    rollout_seed: int | None = 41
    num_update_steps: int = 1
    num_collect_steps: int = 2
    train_batch_size: int | None = None
    logits_forward_batch_size: int = 2
    offload_inference_models: bool = True


@dataclass(frozen=True)
class PluginChoice:
    """The resolved booster plugin: its config name, class and constructor arguments."""

    name: str
    cls: str
    kwargs: dict[str, Any]

    @property
    def zero_stage(self) -> int:
        if self.cls == "LowLevelZeroPlugin":
            return int(self.kwargs["stage"])
        if self.cls == "GeminiPlugin":
            return 3
        if self.cls == "HybridParallelPlugin":
            return int(self.kwargs["zero_stage"])
        return 0


@dataclass(frozen=True)
class ColossalOptions:
    #: Options the prerequisite reward model (fp32, ZeRO-0, no LoRA) never reads: not part of its cache key.
    prerequisite_ignores: ClassVar[tuple[str, ...]] = ("ppo", "critic_from_rm", "lora", "initial_scale")
    auto_plugin: dict[str, str]
    plugins: dict[str, dict[str, Any]]
    optimizer: str = "hybrid_adam"
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    initial_scale: float = 2.0**16
    critic_from_rm: bool = False
    warmup_steps: int | None = None
    lora: LoraOptions = field(default_factory=LoraOptions)
    ppo: PPOOptions = field(default_factory=PPOOptions)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ColossalOptions:
        data = dict(data)
        data.pop("default_precision", None)  # the config group's default for the common `precision` knob
        try:
            options = cls(
                **{
                    **data,
                    "auto_plugin": dict(data["auto_plugin"]),
                    "plugins": {k: dict(v) for k, v in data["plugins"].items()},
                    "betas": tuple(data.get("betas", (0.9, 0.95))),
                    "lora": LoraOptions(**dict(data.get("lora", {}))),
                    "ppo": PPOOptions(**dict(data.get("ppo", {}))),
                }
            )
        except (TypeError, KeyError) as err:
            raise SpecError(f"framework (colossalai): {err}") from None
        if options.optimizer not in OPTIMIZERS:
            raise SpecError(
                f"framework.optimizer={options.optimizer!r} is not allowed; choose one of: {', '.join(OPTIMIZERS)}"
            )
        if options.lora.train_bias not in LORA_BIAS:
            raise SpecError(
                f"framework.lora.train_bias={options.lora.train_bias!r} is not allowed; "
                f"choose one of: {', '.join(LORA_BIAS)}"
            )
        if options.ppo.logits_forward_batch_size < 1:
            raise SpecError(f"framework.ppo.logits_forward_batch_size={options.ppo.logits_forward_batch_size} "
                            "must be >= 1")
        warmup = options.warmup_steps
        if warmup is not None and (isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0):
            raise SpecError(f"framework.warmup_steps={options.warmup_steps!r} must be null (int(0.025 x the stage's "
                            "steps), as upstream) or an integer >= 0")
        for name in ("num_collect_steps", "train_batch_size"):
            value = getattr(options.ppo, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise SpecError(f"framework.ppo.{name}={value!r} must be an integer >= 1"
                                + (" or null (the harness's batch)" if name == "train_batch_size" else ""))
        if options.ppo.num_update_steps < 1:
            raise SpecError(f"framework.ppo.num_update_steps={options.ppo.num_update_steps} must be >= 1")
        for name, plugin in options.plugins.items():
            if plugin.get("class") not in PLUGIN_CLASSES:
                raise SpecError(
                    f"framework.plugins.{name}.class={plugin.get('class')!r} is not allowed; "
                    f"choose one of: {', '.join(PLUGIN_CLASSES)}"
                )
        return options

    def train_batch_size(self, spec: RunSpec) -> int:
        """Samples per PPO training step (--train_batch_size); null = the harness's batch, as train_ppo.sh passes
        --train_batch_size equal to --experience_batch_size."""
        return self.ppo.train_batch_size or spec.batch

    def ppo_optimizer_steps(self, spec: RunSpec) -> int:
        """Optimizer steps of a PPO stage: per episode num_update_steps passes over ceil-free minibatches of the
        buffer (drop_last), an optimizer step every grad_accum of them (the counter runs across episodes)."""
        per_pass = self.ppo.num_collect_steps * spec.batch // self.train_batch_size(spec)
        return -(-spec.steps["ppo"] * self.ppo.num_update_steps * per_pass // spec.grad_accum)

    def resolve_plugin(self, spec: RunSpec) -> PluginChoice:
        """The plugin this run boosts with, from `plugin` (or the auto_plugin table) and the common knobs."""
        name = spec.plugin
        if name == "auto":
            name = "3d" if spec.tp > 1 or spec.pp > 1 else self._auto_name(spec)
        if name not in self.plugins:
            allowed = ", ".join(["auto", *self.plugins])
            raise SpecError(f"plugin={spec.plugin!r} is not allowed; choose one of: {allowed}")
        kwargs = dict(self.plugins[name])
        cls = kwargs.pop("class")
        if cls != "HybridParallelPlugin" and (spec.tp > 1 or spec.pp > 1):
            raise SpecError(f"tp={spec.tp}/pp={spec.pp} need plugin=3d (HybridParallelPlugin), not plugin={name}")
        if cls == "HybridParallelPlugin":
            if spec.zero > 2:
                raise SpecError(f"plugin={name} takes zero 0, 1 or 2 as its zero_stage, not zero={spec.zero}")
            kwargs.update(tp_size=spec.tp, pp_size=spec.pp, zero_stage=spec.zero, cpu_offload=spec.offload)
        choice = PluginChoice(name=name, cls=cls, kwargs=kwargs)
        if choice.zero_stage != spec.zero:
            raise SpecError(
                f"plugin={name} is ZeRO stage {choice.zero_stage} but zero={spec.zero}; set zero={choice.zero_stage} "
                "or plugin=auto"
            )
        if spec.offload and not (kwargs.get("cpu_offload") or kwargs.get("placement_policy") == "auto"):
            raise UnsupportedError(f"plugin={name} has no CPU offload; offload=true needs zero1_cpu, zero2_cpu, "
                                   "gemini_auto or 3d with zero >= 1")
        return choice

    def _auto_name(self, spec: RunSpec) -> str:
        key = f"z{spec.zero}"
        if spec.precision != "fp32" and f"{key}_mixed" in self.auto_plugin:
            key += "_mixed"
        if spec.offload:
            key += "_offload"
        if key not in self.auto_plugin:
            raise UnsupportedError(f"no colossalai plugin for zero={spec.zero} precision={spec.precision} "
                                   f"offload={spec.offload} (framework.auto_plugin has no {key!r})")
        return self.auto_plugin[key]

    @classmethod
    def plan_knobs(cls, layouts: dict[str, Any]) -> PlanKnobs:
        """ColossalChat's train_ppo.py boosts all four models with one plugin (the critic's and reward's differ
        only in their shard policy): one tp, pp, ZeRO stage and offload for every role, the frozen models
        partitioned only under ZeRO-3 (Gemini); --grad_checkpoint covers actor and critic alike."""
        for role in ("actor", "critic", "reference", "reward"):
            if layouts[role].generation_tp:
                raise refuse("colossalai", role, "generation_tp", layouts[role].generation_tp,
                             "ColossalChat generates on the training layout")
        same_for("colossalai", layouts, ("actor", "critic", "reference", "reward"), ("tp", "pp"),
                 "one plugin boosts every model")
        return uniform_knobs("colossalai", layouts, "one plugin boosts every model")

    @classmethod
    def harness_extensions(cls, spec: RunSpec) -> list[dict[str, str]]:
        """Knobs of this run ColossalChat's own scripts cannot run."""
        options = cls.from_dict(spec.framework_options)
        plugin = options.resolve_plugin(spec)
        found = []
        if spec.precision == "fp32":
            found.append({"knob": "precision=fp32",
                          "reason": "ColossalChat's --mixed_precision takes fp16 or bf16 only"})
        if plugin.cls == "LowLevelZeroPlugin" and plugin.zero_stage == 1:
            found.append({"knob": f"plugin={plugin.name}", "reason": "no ColossalChat script offers ZeRO-1"})
        elif plugin.cls == "TorchDDPPlugin" and "ppo" in spec.stages:
            found.append({"knob": f"plugin={plugin.name}",
                          "reason": "train_ppo.py's --plugin choices are gemini, gemini_auto, zero2, zero2_cpu, 3d"})
        if options.optimizer == "torch_adamw":
            found.append({"knob": "framework.optimizer=torch_adamw", "reason": "ColossalChat always builds HybridAdam"})
        return (found + checkpoint_extensions(spec, "ColossalChat", upstream_saves=True)
                + quant_extensions(spec, "ColossalChat") + normalize_extensions(spec, "ColossalChat"))

    @classmethod
    def validate(cls, spec: RunSpec) -> ColossalOptions:
        options = cls.from_dict(spec.framework_options)
        plugin = options.resolve_plugin(spec)
        buffer = options.ppo.num_collect_steps * spec.batch
        if "ppo" in spec.stages and options.train_batch_size(spec) > buffer:
            raise SpecError(f"framework.ppo.train_batch_size={options.ppo.train_batch_size} exceeds the buffer of "
                            f"num_collect_steps x batch = {buffer} samples: coati's loader drops the last partial "
                            "minibatch, so nothing would train")
        if plugin.cls == "TorchDDPPlugin" and spec.grad_clip:
            raise UnsupportedError(f"grad_clip={spec.grad_clip} with plugin={plugin.name}: TorchDDPPlugin takes no "
                                   "max_norm and ColossalChat's ddp path clips nothing (use a ZeRO plugin)")
        if plugin.cls == "TorchDDPPlugin" and spec.precision != "fp32":
            raise UnsupportedError(
                f"plugin={plugin.name} (TorchDDPPlugin) has no precision control and colossalai 0.5.0's Booster bf16 "
                f"is a stub, so precision={spec.precision} would silently train fp32; use plugin=auto (3d at tp=1)"
            )
        if plugin.cls == "GeminiPlugin" and spec.lora:
            raise UnsupportedError("ColossalChat rejects LoRA with Gemini: 'LoRA is not supported in GeminiPlugin'")
        if spec.ds.allgather_bucket_size is not None:
            raise UnsupportedError(f"ds.allgather_bucket_size={spec.ds.allgather_bucket_size}: ColossalAI's ZeRO has "
                                   "no all-gather bucket (its plugins gather each parameter shard whole)")
        if spec.ds.set_knobs() and not (plugin.cls == "LowLevelZeroPlugin" or plugin.zero_stage > 0):
            raise UnsupportedError(f"{', '.join(spec.ds.set_knobs())} with plugin={plugin.name} ({plugin.cls}): only "
                                   "ColossalAI's ZeRO (LowLevelZeroPlugin, HybridParallelPlugin at zero_stage >= 1) "
                                   "has a reduce bucket and overlapped reduction")
        if spec.grad_accum > 1 and spec.pp > 1:
            raise UnsupportedError(f"grad_accum={spec.grad_accum} with pp={spec.pp}: ColossalChat's pipeline SFT "
                                   "path steps the optimizer after every batch (accumulation_steps is ignored there)")
        if spec.grad_accum > 1 and plugin.name == "gemini_auto":
            raise UnsupportedError(f"grad_accum={spec.grad_accum} with plugin=gemini_auto: ColossalChat raises "
                                   "ValueError (placement_policy auto has no gradient accumulation)")
        if plugin.cls == "GeminiPlugin" and spec.precision == "fp32":
            raise UnsupportedError("GeminiPlugin trains in fp16 or bf16 only (precision=fp32 given)")
        if plugin.cls == "HybridParallelPlugin":
            if spec.model.arch not in SHARDFORMER_FAMILIES:
                raise UnsupportedError(
                    f"plugin {plugin.name} (HybridParallelPlugin) on a {spec.model.arch} model: colossalai 0.5.0's "
                    "shardformer has no policy for its classes (get_autopolicy raises NotImplementedError; "
                    f"policies exist for {', '.join(SHARDFORMER_FAMILIES)} among ours). Use zero=1 or 2 "
                    "(LowLevelZeroPlugin) or precision=fp32 at zero=0 (TorchDDPPlugin)")
            if spec.tp > 1 and (spec.model.heads % spec.tp or spec.model.kv_heads % spec.tp):
                raise SpecError(f"tp={spec.tp} must divide model.heads={spec.model.heads} and model.kv_heads="
                                f"{spec.model.kv_heads} (shardformer's policies assert both: each rank keeps whole "
                                "query and K/V heads)")
            if spec.zero > 0 and spec.precision == "fp32":
                raise UnsupportedError("HybridParallelPlugin with zero_stage > 0 needs precision bf16 or fp16 "
                                       "(colossalai asserts it)")
            if spec.lora and (spec.tp > 1 or spec.pp > 1):
                raise UnsupportedError(f"LoRA with tp={spec.tp} pp={spec.pp}: colossalai's HybridParallelPlugin "
                                       "supports LoRA only at tp=1, and its pipeline policy cannot split a LoRA model")
            if spec.pp > 1 and any(stage != "sft" for stage in spec.stages):
                raise UnsupportedError(
                    f"pp={spec.pp} in {'/'.join(spec.stages)}: ColossalChat runs a pipeline only in SFT "
                    "(booster.execute_pipeline); its RM and PPO trainers call the models directly"
                )
        return options


def bucket_in_mi(values: int) -> int:
    """ds.reduce_bucket_size as the plugins take it (`reduce_bucket_size_in_m`, `zero_bucket_size_in_m`): whole Mi
    values (2^20), the nearest, at least 1."""
    return max(1, round(values / 2**20))
