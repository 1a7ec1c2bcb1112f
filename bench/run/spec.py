"""The typed run spec: validated dataclasses built from the Hydra config.

Every check here runs before anything is launched, so a bad override costs nothing and the
message names the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.measure.trend import MIN_POINTS, first_fitted_step
from bench.run.families import ARCHS, MEANINGS, MODEL_TYPES, Family, family

PRECISIONS = ("fp32", "bf16", "fp16")
ZERO_STAGES = (0, 1, 2, 3)
STAGES = ("sft", "rm", "ppo", "grpo")
# grpo: group-relative policy optimisation with the synthetic preferred-token reward (no critic, no reward model);
# only frameworks that ship it run it (registry.stage_support)
STAGE_CHOICES = {"sft": ("sft",), "rm": ("rm",), "ppo": ("ppo",), "grpo": ("grpo",),
                 "pipeline": ("sft", "rm", "ppo")}
# Stages that roll out: generation, experience and training phases each step
ROLLOUT_STAGES = ("ppo", "grpo")
WANDB_MODES = ("off", "online", "offline")
PREFLIGHT_MODES = ("off", "on", "shrink")
DEVICES = ("auto", "cpu", "cuda")
# Run tags the report acts on. forced-failure: the run is meant to fail (a forced divergence); it shows in
# the stability table and is never evidence for a claim, a decision or a figure of trained runs.
TAGS = ("forced-failure",)
# Token ids the synthetic data reserves (pad, eos) plus room for a preferred subset.
MIN_VOCAB = 64
# The largest mmap threshold glibc takes on a 64-bit host (malloc.c: DEFAULT_MMAP_THRESHOLD_MAX, 4 Mi x
# sizeof(long)); a larger MALLOC_MMAP_THRESHOLD_ is ignored, which would leave the record naming a setting that
# never ran.
MMAP_THRESHOLD_MAX = 32 * 2**20


class SpecError(ValueError):
    """A configuration value is invalid; nothing was launched."""


class UnsupportedError(SpecError):
    """Every value is valid but the framework cannot run this combination."""


def require_data_parallel_only(spec: RunSpec, framework: str, why: str) -> None:
    """For frameworks whose trainers have no plugin choice and no tensor or pipeline parallelism."""
    if spec.plugin != "auto":
        raise SpecError(f"plugin={spec.plugin!r} is a colossalai knob; {framework} takes plugin=auto")
    if spec.tp > 1 or spec.pp > 1:
        raise UnsupportedError(f"{framework} {why} (tp={spec.tp}, pp={spec.pp})")


def checkpoint_extensions(spec: RunSpec, framework: str, upstream_saves: bool) -> list[dict[str, str]]:
    """Checkpoint knobs a framework's own scripts cannot run: saving mid-run and resuming where its scripts
    save only at the end, and overlapping the write with training (no framework does on the CPU)."""
    found = []
    if not upstream_saves and (spec.checkpoint.every or spec.resume):
        found.append({"knob": "checkpoint.every / resume", "reason": f"{framework}'s scripts save only at the "
                      "end and cannot resume; the harness saves and loads through the engine's own call"})
    if spec.checkpoint.every and spec.checkpoint.background:
        found.append({"knob": "checkpoint.async=true", "reason": "no asynchronous save that runs here (DeepSpeed's "
                      "fast checkpoint engines need its async-I/O op, ColossalAI's use_async needs tensornvme, "
                      "accelerate has none): the harness snapshots the framework's writes to host memory and "
                      "writes them in a background thread"})
    return found


def quant_extensions(spec: RunSpec, framework: str) -> list[dict[str, str]]:
    """reference.quant / reward.quant: no framework quantizes its frozen roles (adapters/quantize.py)."""
    return [{"knob": f"{role}.quant={getattr(spec, role).quant}",
             "reason": f"{framework} keeps its frozen {role} model in the run's precision; the harness stores its "
                       f"linear weights in 8 or 4 bits with {spec.quant_library}"}
            for role in ("reference", "reward") if getattr(spec, role).quant != "none"]


def refuse_comm_knobs(spec: RunSpec, why: str) -> None:
    """Any ds.* knob set for an engine that has none: the error names them and says why."""
    if spec.ds.set_knobs():
        raise UnsupportedError(f"{', '.join(f'{k}={v}' for k, v in spec.ds.set_knobs().items())}: {why}")


def normalize_extensions(spec: RunSpec, framework: str, upstream: tuple[str, ...] = ("none",)
                         ) -> list[dict[str, str]]:
    """reward.normalize beyond what the framework offers (`upstream`; adapters/reward_norm.py)."""
    mode = spec.reward.normalize
    if mode is None or mode in upstream:
        return []
    how = ("minus the mean, over the std of the RM stage's scores on held-out pairs" if mode == "zscore"
           else "over the running std of every score seen, as trlx's scale_reward=running")
    return [{"knob": f"reward.normalize={mode}",
             "reason": f"{framework} offers {' or '.join(upstream)}; the harness scales the RM's score {how}"}]


def _choice(name: str, value: Any, allowed: tuple) -> Any:
    if value not in allowed:
        shown = ", ".join(str(a) for a in allowed)
        raise SpecError(f"{name}={value!r} is not allowed; choose one of: {shown}")
    return value


def _int(name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{name}={value!r} must be an integer")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"between {low} and {high}"
        raise SpecError(f"{name}={value} is not allowed; it must be {bound}")
    return value


def _positive_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise SpecError(f"{name}={value!r} must be a positive number")
    return float(value)


def _checkpoint_config(path: Any) -> dict[str, Any]:
    """config.json of the local checkpoint at model.path, refused unless its architecture is one of ARCHS."""
    if path == "???":  # OmegaConf's mandatory value, left unset: model=checkpoint without model.path
        raise SpecError("model=checkpoint needs model.path=DIR, a local Hugging Face checkpoint directory "
                        "(config.json and weights)")
    if not isinstance(path, str) or not os.path.isdir(path):
        raise SpecError(f"model.path={path!r} is not a directory; give a local Hugging Face checkpoint "
                        "directory (config.json and weights) or leave it null for a model built from model.*")
    config_file = os.path.join(path, "config.json")
    try:
        with open(config_file) as f:
            config = json.load(f)
        model_type = config.get("model_type")
    except FileNotFoundError:
        raise SpecError(f"model.path={path!r} holds no config.json; it must be a Hugging Face checkpoint "
                        "directory") from None
    except (OSError, ValueError, AttributeError) as err:
        raise SpecError(f"model.path={path!r}: config.json cannot be read as a JSON object ({err})") from None
    if model_type not in MODEL_TYPES:
        raise SpecError(f"model.path={path!r} holds model_type={model_type!r}; the adapters support "
                        f"{', '.join(MODEL_TYPES)}")
    return config


def _checkpoint_dims(config: dict[str, Any]) -> dict[str, Any]:
    """The model.* dimensions a checkpoint's config.json sets, under our names (transformers' defaults where
    the file leaves a key out, as from_pretrained fills them)."""
    arch = MODEL_TYPES[config["model_type"]]
    if arch == "gpt2":
        hidden = config.get("n_embd", 768)
        return {"arch": arch, "hidden": hidden, "layers": config.get("n_layer", 12), "heads": config.get("n_head", 12),
                "kv_heads": None, "intermediate": config.get("n_inner") or 4 * hidden,
                "vocab": config.get("vocab_size", 50257), "positions": config.get("n_positions", 1024),
                "tie_embeddings": config.get("tie_word_embeddings", True)}
    heads = config.get("num_attention_heads")
    return {"arch": arch, "hidden": config.get("hidden_size"), "layers": config.get("num_hidden_layers"),
            "heads": heads, "kv_heads": config.get("num_key_value_heads") or heads,
            "intermediate": config.get("intermediate_size"), "vocab": config.get("vocab_size"),
            "positions": config.get("max_position_embeddings"),
            "tie_embeddings": config.get("tie_word_embeddings", family(arch).tied_default)}


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise SpecError(f"{name}={value!r} must be true or false")
    return value


# model.* keys a checkpoint at model.path sets: null takes the checkpoint's, a value must equal it
CHECKPOINT_KEYS = ("arch", "hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "positions",
                   "tie_embeddings")


@dataclass(frozen=True)
class ModelSpec:
    """A model built from its dimensions (random weights) or a local checkpoint (model.path). Family defaults
    (bench.run.families) fill kv_heads (= heads), intermediate (GPT-2: 4 x hidden) and tie_embeddings."""

    name: str
    path: str | None
    hidden: int | None
    layers: int | None
    heads: int | None
    vocab: int | None
    positions: int | None
    dropout: float
    lr: dict[str, float]
    arch: str | None = "gpt2"
    kv_heads: int | None = None
    intermediate: int | None = None
    tie_embeddings: bool | None = None

    def __post_init__(self) -> None:
        if self.path is not None:
            self._take_checkpoint_dims()
        _choice("model.arch", self.arch, ARCHS)
        traits = family(self.arch)
        defaults = {"kv_heads": self.heads, "tie_embeddings": traits.tied_default,
                    "intermediate": 4 * self.hidden if self.arch == "gpt2" and isinstance(self.hidden, int) else None}
        for key, value in defaults.items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        for key in ("hidden", "layers", "heads", "positions", "kv_heads"):
            _int(f"model.{key}", getattr(self, key), 1)
        if self.intermediate is None:
            raise SpecError(f"model.intermediate=null: the {self.arch} family has no default MLP width; give one")
        _int("model.intermediate", self.intermediate, 1)
        _int("model.vocab", self.vocab, MIN_VOCAB)
        _bool("model.tie_embeddings", self.tie_embeddings)
        if self.hidden % self.heads:
            raise SpecError(f"model.heads={self.heads} must divide model.hidden={self.hidden}")
        if self.heads % self.kv_heads:
            raise SpecError(f"model.kv_heads={self.kv_heads} must divide model.heads={self.heads}")
        if self.arch == "gpt2" and self.kv_heads != self.heads:
            raise SpecError(f"model.kv_heads={self.kv_heads}: the gpt2 family has no grouped-query attention; "
                            f"leave it null (= model.heads={self.heads})")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)):
            raise SpecError(f"model.dropout={self.dropout!r} must be a number in [0, 1)")
        if not 0.0 <= self.dropout < 1.0:
            raise SpecError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.dropout and not traits.residual_dropout:
            raise SpecError(f"model.dropout={self.dropout}: the {self.arch} family has no dropout in its residual "
                            "stream (its configs train without); set model.dropout=0")
        missing = {"sft", "rm", "actor", "critic"} - set(self.lr)
        if missing:
            raise SpecError(f"model.lr lacks {sorted(missing)}; it needs sft, rm, actor and critic")
        for role, value in self.lr.items():
            _positive_float(f"model.lr.{role}", value)

    def _take_checkpoint_dims(self) -> None:
        """Fills the null keys from the checkpoint's config.json and refuses a value that differs from it (a
        preset's dimensions would otherwise describe a model that is not the one loaded)."""
        dims = _checkpoint_dims(_checkpoint_config(self.path))
        for key in CHECKPOINT_KEYS:
            given = getattr(self, key)
            if given is None:
                object.__setattr__(self, key, dims[key])
            elif dims[key] is not None and given != dims[key]:
                raise SpecError(
                    f"model.{key}={given!r} differs from the checkpoint's {dims[key]!r} (model.path={self.path}): "
                    f"the checkpoint sets the model's dimensions; use model=checkpoint (every dimension null) or "
                    f"give the checkpoint's own")

    @property
    def family(self) -> Family:
        return family(self.arch)


@dataclass(frozen=True)
class LauncherSpec:
    nproc: int = 1  # ranks on each node
    threads_per_rank: int = 1
    timeout_s: float = 1800.0
    stall_s: float = 900.0
    device: str = "auto"
    nnodes: int = 1  # nodes, one torchrun agent each; > 1: c10d rendezvous (bench.run.nodes fills the three below)
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_timeout_s: float = 600.0  # how long an agent waits for the others to join

    def __post_init__(self) -> None:
        _int("launcher.nproc", self.nproc, 1)
        _int("launcher.nnodes", self.nnodes, 1)
        _positive_float("launcher.rdzv_timeout_s", self.rdzv_timeout_s)
        _int("launcher.threads_per_rank", self.threads_per_rank, 1)
        _positive_float("launcher.timeout_s", self.timeout_s)
        _positive_float("launcher.stall_s", self.stall_s)
        _choice("launcher.device", self.device, DEVICES)
        if self.nnodes > 1 and None in (self.node_rank, self.rdzv_endpoint, self.rdzv_id):
            raise SpecError(f"launcher.nnodes={self.nnodes} without its place (node_rank, rdzv_endpoint, rdzv_id): "
                            "build the spec with spec_from_config, which reads them (bench.run.nodes)")

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    @property
    def node(self) -> int:
        """This node's rank (0 on one node)."""
        return self.node_rank or 0


@dataclass(frozen=True)
class StabilitySpec:
    stop_after_nonfinite: int = 5
    skip_storm_len: int = 5
    skip_rate_storm: float = 0.25

    def __post_init__(self) -> None:
        _int("stability.stop_after_nonfinite", self.stop_after_nonfinite, 1)
        _int("stability.skip_storm_len", self.skip_storm_len, 2)
        if isinstance(self.skip_rate_storm, bool) or not isinstance(self.skip_rate_storm, (int, float)) \
                or not 0 < self.skip_rate_storm <= 1:
            raise SpecError(f"stability.skip_rate_storm={self.skip_rate_storm!r} must be a number in (0, 1]")


# Phases that run once per step, where a planted leak can sit.
STEP_PHASES = ("generation", "experience", "training", "onload", "offload")


@dataclass(frozen=True)
class CommSpec:
    """DeepSpeed's ZeRO communication knobs (config group `ds`); None keeps each framework's own setting.
    Bucket sizes count values (elements), as DeepSpeed's config does."""

    allgather_bucket_size: int | None = None
    reduce_bucket_size: int | None = None
    overlap_comm: bool | None = None

    def __post_init__(self) -> None:
        for name in ("allgather_bucket_size", "reduce_bucket_size"):
            value = getattr(self, name)
            if isinstance(value, float) and value.is_integer():  # 5e8, as DeepSpeed's own configs write it
                object.__setattr__(self, name, int(value))
            if getattr(self, name) is not None:
                _int(f"ds.{name}", getattr(self, name), 1)
        if self.overlap_comm is not None:
            _bool("ds.overlap_comm", self.overlap_comm)

    def set_knobs(self) -> dict[str, int | bool]:
        """The knobs the config sets, by their config names (ds.*)."""
        return {f"ds.{k}": v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class DebugSpec:
    """Test-only knobs: a planted leak keeps `leak_mib_per_step` MiB alive per step in `leak_phase`, so that a
    test can check that a soak run finds it, in the right phase, at the right slope."""

    leak_mib_per_step: float = 0.0
    leak_phase: str = "training"

    def __post_init__(self) -> None:
        value = self.leak_mib_per_step
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise SpecError(f"debug.leak_mib_per_step={value!r} must be a number >= 0")
        _choice("debug.leak_phase", self.leak_phase, STEP_PHASES)


@dataclass(frozen=True)
class CheckpointSpec:
    """`checkpoint.every` steps, the trained models' weights and optimizer states through the framework's own
    save; `background` (config key `checkpoint.async`) writes them in a background thread."""

    every: int = 0
    background: bool = False

    def __post_init__(self) -> None:
        _int("checkpoint.every", self.every, 0)
        _bool("checkpoint.async", self.background)


# LoRA target layers of a transformer block, named by what they compute (bench.run.families MEANINGS: q, k, v,
# o, gate, up, down); `lora_targets` takes one of LORA_TARGET_SETS or a list of meanings and LORA_TARGET_GROUPS.
LORA_TARGET_NAMES = MEANINGS
LORA_TARGET_GROUPS = {"qkv": ("q", "k", "v"), "attn_out": ("o",), "mlp_in": ("gate", "up"), "mlp_out": ("down",)}
LORA_TARGET_SETS = {"all": MEANINGS, "attention": ("q", "k", "v", "o"), "mlp": ("gate", "up", "down"),
                    "qkv": ("q", "k", "v")}


def lora_target_set(targets: Any, arch: str = "gpt2") -> tuple[str, ...] | None:
    """The meanings `lora_targets` adapts in a block of `arch`, in MEANINGS order; None = the framework's default.
    A set or group takes the meanings the family has (GPT-2's MLP has no gate); a meaning named alone must
    exist, and a module that computes several (GPT-2's c_attn: q, k, v; GLM-4's gate_up_proj) is adapted
    whole or not at all."""
    if targets is None:
        return None
    traits = family(arch)
    if isinstance(targets, str):
        _choice("lora_targets", targets, tuple(LORA_TARGET_SETS))
        return tuple(m for m in LORA_TARGET_SETS[targets] if m in traits.modules)
    names = (*LORA_TARGET_NAMES, *LORA_TARGET_GROUPS)
    if not isinstance(targets, (list, tuple)) or not targets:
        raise SpecError(f"lora_targets={targets!r} must be null (the framework's default), one of "
                        f"{sorted(LORA_TARGET_SETS)} or a non-empty list of {list(names)}")
    chosen: list[str] = []
    for name in targets:
        _choice("lora_targets", name, names)
        if name in LORA_TARGET_GROUPS:
            chosen += [m for m in LORA_TARGET_GROUPS[name] if m in traits.modules]
        elif name not in traits.modules:
            raise SpecError(f"lora_targets={list(targets)!r}: the {arch} family has no {name!r} map; it has "
                            f"{', '.join(traits.meanings)}")
        else:
            chosen.append(name)
    if len(set(chosen)) != len(chosen):
        raise SpecError(f"lora_targets={list(targets)!r} names a layer twice")
    for meaning in chosen:
        fused = traits.fused_with(meaning)
        if not set(fused) <= set(chosen):
            raise SpecError(f"lora_targets={list(targets)!r}: the {arch} family computes {', '.join(fused)} in one "
                            f"module ({traits.modules[meaning]}); name all of them or none")
    return tuple(m for m in MEANINGS if m in chosen)


QUANT_MODES = ("none", "int8", "nf4")
# torchao: pure-torch weight-only int8 and NF4 tensors, their allocations torch's own (the default);
# bitsandbytes: LLM.int8 / Linear4bit, whose CPU int8 path holds memory outside torch (docs/knobs.md, quantized
# frozen roles)
QUANT_LIBRARIES = ("torchao", "bitsandbytes")


@dataclass(frozen=True)
class FrozenRoleSpec:
    """Knobs of a frozen PPO role (config groups `reference` and `reward`): `quant` stores its linear weights in
    8 or 4 bits (with `quant_library`, adapters/quantize.py), a harness extension in every framework."""

    quant: str = "none"


# none: the RM score as it is; zscore: minus the mean, over the std of the RM stage's scores on held-out pairs;
# running: over the running std of every score PPO has seen (trlx's scale_reward="running", no mean subtracted)
NORMALIZE_MODES = ("none", "zscore", "running")


@dataclass(frozen=True)
class RewardSpec(FrozenRoleSpec):
    """The reward role: its `quant`, and `normalize`, what PPO does to the RM's score before the framework's
    own clipping (NORMALIZE_MODES); None keeps each framework's upstream default (trlx: framework.ppo.
    scale_reward; DS-Chat and ColossalChat: none)."""

    normalize: str | None = None


@dataclass(frozen=True)
class InitSpec:
    """Where PPO's models start. Without `sft`, PPO starts from a cached prerequisite SFT model unless
    `sft_prerequisite` is false (then from random base weights); without `rm`, from a prerequisite RM."""

    sft: str | None = None
    rm: str | None = None
    sft_prerequisite: bool = True

    def __post_init__(self) -> None:
        _bool("init.sft_prerequisite", self.sft_prerequisite)
        for key in ("sft", "rm"):
            path = getattr(self, key)
            if path is not None and not (isinstance(path, str) and os.path.isfile(path)):
                raise SpecError(f"init.{key}={path!r} is not a file; give the checkpoint file a stage saved "
                                f"(<run>/{key}/checkpoint/*.pt) or leave it null")


@dataclass(frozen=True)
class RunSpec:
    framework: str
    framework_options: dict[str, Any]
    stage: str
    model: ModelSpec
    precision: str = "fp32"
    zero: int = 0
    lora: int = 0
    lora_targets: str | tuple[str, ...] | None = None  # which block layers get LoRA (lora_target_set)
    lora_alpha: float | None = None  # LoRA scaling numerator (scaling = alpha / rank); None: the framework's
    batch: int = 4
    grad_accum: int = 1  # micro-batches per optimizer step on each data-parallel rank
    global_batch: int | None = None  # stated samples per optimizer step: checked = batch x grad_accum x data parallel
    prompt_len: int = 16
    answer_len: int = 16
    steps: dict[str, int] = field(default_factory=lambda: {"sft": 20, "rm": 30, "ppo": 10, "grpo": 10})
    warmup_steps: int = 2
    lr: float | None = None
    seed: int = 1234
    grad_ckpt: bool = False
    grad_clip: float | None = None  # max global gradient L2 norm of every trained model; None: the framework's
    offload: bool = False
    plugin: str = "auto"
    tp: int = 1
    pp: int = 1
    wandb: str = "off"
    tags: tuple[str, ...] = ()
    soak: bool = False
    memory_budget_gb: float | None = None
    memory_release_every: int | None = None  # None: every run in a soak (its figure is per step), else 4
    memory_mmap_threshold: int | None = None  # bytes: glibc's mmap threshold fixed for the ranks; None: glibc's own
    preflight: str = "off"  # on: refuse a run predicted not to fit; shrink: halve the batch until it fits
    verbose: bool = False  # the ranks' own output on the terminal too (it is always in each stage's worker.log)
    debug: DebugSpec = field(default_factory=DebugSpec)
    ds: CommSpec = field(default_factory=CommSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    resume: bool = False
    init: InitSpec = field(default_factory=InitSpec)
    reference: FrozenRoleSpec = field(default_factory=FrozenRoleSpec)
    reward: RewardSpec = field(default_factory=RewardSpec)
    quant_library: str = "torchao"  # which library quantizes the frozen roles (QUANT_LIBRARIES)
    launcher: LauncherSpec = field(default_factory=LauncherSpec)
    stability: StabilitySpec = field(default_factory=StabilitySpec)

    def __post_init__(self) -> None:
        # in this order: the first refusal a user meets is the same whichever checks follow it
        for check in (self._check_knobs, self._check_layout, self._check_steps, self._check_lengths_and_lora,
                      self._check_frozen_roles):
            check()

    def _check_knobs(self) -> None:
        """Each scalar knob's type and range, the tags and the plugin's name."""
        _choice("stage", self.stage, tuple(STAGE_CHOICES))
        _choice("precision", self.precision, PRECISIONS)
        _choice("zero", self.zero, ZERO_STAGES)
        _int("lora", self.lora, 0)
        _int("batch", self.batch, 1)
        _int("grad_accum", self.grad_accum, 1)
        _int("prompt_len", self.prompt_len, 2)
        _int("answer_len", self.answer_len, 2)
        _int("warmup_steps", self.warmup_steps, 0)
        _int("seed", self.seed, 0)
        _bool("grad_ckpt", self.grad_ckpt)
        if self.grad_clip is not None and (isinstance(self.grad_clip, bool) or not isinstance(self.grad_clip, (
                int, float)) or self.grad_clip < 0):
            raise SpecError(f"grad_clip={self.grad_clip!r} must be a number >= 0 (0 = no clipping) or null (the "
                            "framework's upstream default)")
        _bool("offload", self.offload)
        _choice("wandb", self.wandb, WANDB_MODES)
        _choice("preflight", self.preflight, PREFLIGHT_MODES)
        if not isinstance(self.tags, (list, tuple)):
            raise SpecError(f"tags={self.tags!r} must be a list, e.g. tags=[forced-failure]")
        for tag in self.tags:
            _choice("tags", tag, TAGS)
        if not isinstance(self.plugin, str) or not self.plugin:
            raise SpecError(f"plugin={self.plugin!r} must be a name (auto = chosen from zero, precision, offload)")

    def _check_layout(self) -> None:
        """tp x pp against the ranks, the heads and the blocks; stages over nodes; the global batch."""
        _int("tp", self.tp, 1)
        _int("pp", self.pp, 1)
        if self.launcher.world_size % (self.tp * self.pp):
            nodes = (f" x launcher.nnodes={self.launcher.nnodes} = {self.launcher.world_size} ranks"
                     if self.launcher.nnodes > 1 else "")
            raise SpecError(f"tp={self.tp} x pp={self.pp} must divide launcher.nproc={self.launcher.nproc}{nodes} "
                            "(data parallelism takes the remaining factor)")
        if self.launcher.nnodes > 1 and len(self.stages) > 1:
            raise UnsupportedError(
                f"stage={self.stage} with launcher.nnodes={self.launcher.nnodes}: a stage's checkpoint reaches the "
                "next stage as a file on the node that saved it; run the stages one by one (stage=sft, stage=rm, "
                "then stage=ppo with init.sft=FILE init.rm=FILE readable on every node)")
        if self.model.heads % self.tp:
            raise SpecError(f"tp={self.tp} must divide model.heads={self.model.heads}")
        if self.pp > self.model.layers:
            raise SpecError(f"pp={self.pp} exceeds model.layers={self.model.layers}: a pipeline stage would be empty")
        if self.global_batch is not None:
            _int("global_batch", self.global_batch, 1)
            if self.global_batch != self.effective_global_batch:
                # DeepSpeed's own config check: train_batch_size = micro batch x accumulation x world size
                raise SpecError(
                    f"global_batch={self.global_batch} is not batch {self.batch} x grad_accum {self.grad_accum} x "
                    f"{self.data_parallel} data-parallel rank(s) = {self.effective_global_batch}; change one of them "
                    "(or leave global_batch null)")

    def _check_steps(self) -> None:
        """The learning rate, each stage's steps against the warm-up, the memory settings, soak's fit."""
        if self.lr is not None:
            _positive_float("lr", self.lr)
        for stage in self.stages:
            steps = _int(f"steps ({stage})", self.steps.get(stage), 1)
            if steps <= self.warmup_steps:
                raise SpecError(
                    f"steps={steps} for {stage} leaves no measured step after warmup_steps={self.warmup_steps}"
                )
        _bool("soak", self.soak)
        _bool("resume", self.resume)
        _bool("verbose", self.verbose)
        if self.memory_budget_gb is not None:
            _positive_float("memory_budget_gb", self.memory_budget_gb)
        if self.memory_release_every is not None:
            _int("memory_release_every", self.memory_release_every, 1)
        if self.memory_mmap_threshold is not None:
            _int("memory_mmap_threshold", self.memory_mmap_threshold, 0, MMAP_THRESHOLD_MAX)
        if self.soak:
            for stage in self.stages:
                fitted = self.steps[stage] - first_fitted_step(self.warmup_steps, self.steps[stage])
                if fitted < MIN_POINTS:
                    raise SpecError(
                        f"soak=true needs at least {MIN_POINTS} fitted steps per stage; steps={self.steps[stage]} "
                        f"for {stage} with warmup_steps={self.warmup_steps} leaves {fitted} (the fit starts after "
                        "warm-up and the first tenth of the run)")

    def _check_lengths_and_lora(self) -> None:
        """Prompt + answer against the positions; LoRA's rank, targets and alpha; offload's ZeRO."""
        if self.prompt_len + self.answer_len > self.model.positions:
            raise SpecError(
                f"prompt_len + answer_len = {self.prompt_len + self.answer_len} exceeds "
                f"model.positions={self.model.positions}"
            )
        lora_target_set(self.lora_targets, self.model.arch)
        if self.lora_alpha is not None:
            _positive_float("lora_alpha", self.lora_alpha)
        for key in ("lora_targets", "lora_alpha"):
            if getattr(self, key) is not None and not self.lora:
                raise SpecError(f"{key}={getattr(self, key)!r} shapes LoRA adapters; lora=0 trains without them "
                                "(set lora to a rank > 0, or leave it null)")
        if self.lora and self.lora >= self.model.hidden:
            raise SpecError(f"lora={self.lora} must be smaller than model.hidden={self.model.hidden}")
        if self.offload and self.zero == 0:
            raise UnsupportedError("offload=true needs zero >= 1: ZeRO-Offload moves ZeRO-partitioned state")

    def _check_frozen_roles(self) -> None:
        """Quantized and normalized frozen PPO roles, only where PPO runs."""
        _choice("quant_library", self.quant_library, QUANT_LIBRARIES)
        for role in ("reference", "reward"):
            quant = getattr(self, role).quant
            _choice(f"{role}.quant", quant, QUANT_MODES)
            if quant != "none" and "ppo" not in self.stages:
                raise SpecError(f"{role}.quant={quant} quantizes a frozen PPO role; stage={self.stage} runs no PPO "
                                "(use stage=ppo or stage=pipeline, or leave it none)")
        if self.reward.normalize is not None:
            _choice("reward.normalize", self.reward.normalize, NORMALIZE_MODES)
            if "ppo" not in self.stages:
                raise SpecError(f"reward.normalize={self.reward.normalize} scales PPO's rewards; stage={self.stage} "
                                "runs no PPO (use stage=ppo or stage=pipeline, or leave it null)")

    @property
    def data_parallel(self) -> int:
        return self.launcher.world_size // (self.tp * self.pp)

    @property
    def effective_global_batch(self) -> int:
        """Samples (prompts, in PPO) per optimizer step over all data-parallel ranks."""
        return self.batch * self.grad_accum * self.data_parallel

    @property
    def stages(self) -> tuple[str, ...]:
        return STAGE_CHOICES[self.stage]

    @property
    def release_every(self) -> int:
        """How often (at least) a phase started above its own floor gets the freed heap handed back first
        (bench.measure.memory): every run in a soak, whose figure is the per-step peak; else every 4th, which
        keeps the refault it costs within the harness's budget (docs/performance.md, "the harness's own cost")."""
        if self.memory_release_every is not None:
            return self.memory_release_every
        return 1 if self.soak else 4

    @property
    def lora_target_set(self) -> tuple[str, ...] | None:
        """The block's maps LoRA adapts (meanings, LORA_TARGET_NAMES); None: each framework's upstream default."""
        return lora_target_set(self.lora_targets, self.model.arch)

    def lora_alpha_or(self, upstream: float) -> float:
        """The LoRA alpha a framework applies: `lora_alpha` where set, else its upstream default."""
        return upstream if self.lora_alpha is None else float(self.lora_alpha)

    def grad_clip_or(self, upstream: float) -> float:
        """The clipping threshold a framework applies: `grad_clip` where set, else its upstream default
        (0 = no clipping)."""
        return upstream if self.grad_clip is None else float(self.grad_clip)

    def stage_lr(self, role: str) -> float:
        """Learning rate of a trained role (sft, rm, actor, critic); `lr` overrides the main one."""
        main_role = {"sft": "sft", "rm": "rm", "actor": "actor"}
        if self.lr is not None and role in main_role:
            return self.lr
        return float(self.model.lr[role])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunSpec:
        data = dict(data)
        data["model"] = ModelSpec(**data["model"])
        data["init"] = InitSpec(**data.get("init") or {})
        data["launcher"] = LauncherSpec(**data.get("launcher") or {})
        data["stability"] = StabilitySpec(**data.get("stability") or {})
        data["tags"] = tuple(data.get("tags") or ())
        if isinstance(data.get("lora_targets"), list):
            data["lora_targets"] = tuple(data["lora_targets"])
        data["debug"] = DebugSpec(**data.get("debug") or {})
        data["ds"] = CommSpec(**data.get("ds") or {})
        data["checkpoint"] = CheckpointSpec(**data.get("checkpoint") or {})
        data["reference"] = FrozenRoleSpec(**data.get("reference") or {})
        data["reward"] = RewardSpec(**data.get("reward") or {})
        return cls(**data)

    def replace(self, **changes: Any) -> RunSpec:
        return dataclasses.replace(self, **changes)


def _targets(value: Any) -> str | tuple[str, ...] | None:
    """A config list (Hydra's ListConfig) as a tuple, so the frozen spec stays hashable."""
    return tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else value


def spec_from_config(cfg: Mapping[str, Any], env: Mapping[str, str] | None = None, check: bool = True) -> RunSpec:
    """Build and validate a RunSpec from a resolved config mapping (the Hydra config as a dict); `env`: where a
    node's place over several nodes is read (default this process's environment: SLURM_* under SLURM); `check`
    false builds it without the framework's option check and installed extras (the planner checks each layout it
    tries, on a machine that need not have the framework)."""
    from adapters import registry

    framework = dict(cfg["framework"])
    name = _choice("framework", framework.pop("name"), registry.names())
    framework.pop("default_precision", None)  # already resolved into `precision` by the config
    stage = _choice("stage", cfg["stage"]["name"], tuple(STAGE_CHOICES))
    steps = dict(cfg["stage_steps"])
    if cfg.get("steps") is not None:  # this run's stages only: a prerequisite RM keeps its own default
        steps.update({s: cfg["steps"] for s in STAGE_CHOICES[stage]})
    model = dict(cfg["model"])
    model["lr"] = dict(model["lr"])
    spec = RunSpec(
        framework=name,
        framework_options=framework,
        stage=stage,
        model=ModelSpec(**model),
        precision=cfg["precision"],
        zero=cfg["zero"],
        lora=cfg["lora"],
        lora_targets=_targets(cfg.get("lora_targets")),
        lora_alpha=cfg.get("lora_alpha"),
        batch=cfg["batch"],
        grad_accum=cfg.get("grad_accum", 1),
        global_batch=cfg.get("global_batch"),
        prompt_len=cfg["prompt_len"],
        answer_len=cfg["answer_len"],
        steps=steps,
        warmup_steps=cfg["warmup_steps"],
        lr=cfg.get("lr"),
        seed=cfg["seed"],
        grad_ckpt=cfg["grad_ckpt"],
        grad_clip=cfg.get("grad_clip"),
        offload=cfg["offload"],
        plugin=cfg["plugin"],
        tp=cfg["tp"],
        pp=cfg["pp"],
        wandb=cfg.get("wandb", "off"),
        tags=tuple(cfg.get("tags") or ()),
        soak=cfg.get("soak", False),
        memory_budget_gb=cfg.get("memory_budget_gb"),
        memory_release_every=cfg.get("memory_release_every"),
        memory_mmap_threshold=cfg.get("memory_mmap_threshold"),
        preflight=cfg.get("preflight", "off"),
        verbose=cfg.get("verbose", False),
        debug=DebugSpec(**dict(cfg.get("debug") or {})),
        ds=CommSpec(**dict(cfg.get("ds") or {})),
        checkpoint=CheckpointSpec(every=(cfg.get("checkpoint") or {}).get("every", 0),
                                  background=(cfg.get("checkpoint") or {}).get("async", False)),
        resume=cfg.get("resume", False),
        init=InitSpec(**dict(cfg.get("init") or {})),
        reference=FrozenRoleSpec(**dict(cfg.get("reference") or {})),
        quant_library=cfg.get("quant_library", "torchao"),
        reward=RewardSpec(**dict(cfg.get("reward") or {})),
        launcher=placed_launcher(dict(cfg["launcher"]), os.environ if env is None else env),
        stability=StabilitySpec(**dict(cfg["stability"])),
    )
    registry.check_stages(name, spec.stages)
    if check:
        registry.options_class(name).validate(spec)
        _require_extras(spec)
    return spec


def placed_launcher(launcher: dict[str, Any], env: Mapping[str, str]) -> LauncherSpec:
    """The launcher's keys with this node's place in a run over several nodes filled in (bench.run.nodes)."""
    from bench.run.nodes import place

    nnodes = launcher.get("nnodes", 1)
    _int("launcher.nnodes", nnodes, 1)
    found = place(nnodes, launcher.get("node_rank"), launcher.get("rdzv_endpoint"), launcher.get("rdzv_id"), env)
    if found is not None:
        launcher.update(node_rank=found.node_rank, rdzv_endpoint=found.rdzv_endpoint, rdzv_id=found.rdzv_id)
    return LauncherSpec(**launcher)


def _require_extras(spec: RunSpec) -> None:
    from bench.run import extras

    if spec.framework in extras.FRAMEWORK_EXTRAS:
        extras.require(extras.FRAMEWORK_EXTRAS[spec.framework], f"framework={spec.framework}")
    quantized = [role for role in ("reference", "reward") if getattr(spec, role).quant != "none"]
    if quantized and spec.quant_library == "bitsandbytes":
        extras.require(extras.BITSANDBYTES, f"quant_library=bitsandbytes ({', '.join(quantized)} quantized)")
