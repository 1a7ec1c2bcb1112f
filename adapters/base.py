"""The interface every framework adapter implements.

The core owns the step loop and measures every phase the same way for every framework; an adapter
only builds its framework's models and engines and performs one step of work per call. PPO is split
into its three phases (rollout generation, experience inference, training) so each can be measured.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.measure.flops import Attention
from bench.measure.params import ParamCounts
from bench.run.data import PreferenceBatch, PromptBatch, SFTBatch
from bench.run.models import model_config
from bench.run.spec import RunSpec, UnsupportedError


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def _finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


@dataclass
class TrainOutput:
    """One optimisation step of every model trained in that phase, keyed by role."""

    losses: dict[str, float]
    tokens: int  # real (non-pad) tokens this rank trained on
    samples: int
    grad_norms: dict[str, float | None] = field(default_factory=dict)
    skipped: dict[str, bool] = field(default_factory=dict)  # optimizer step skipped on overflow
    loss_scales: dict[str, float | None] = field(default_factory=dict)  # fp16 dynamic loss scale
    metrics: dict[str, float] = field(default_factory=dict)

    def record(self, role: str, loss: float, grad_norm: float | None, skipped: bool,
               loss_scale: float | None) -> None:
        """One optimizer step of `role`. A phase that steps a role several times (PPO epochs, update passes)
        keeps any skip and any non-finite loss or norm of every step; otherwise the last step's values."""
        steps, skips = f"optimizer_steps/{role}", f"skipped_steps/{role}"
        self.metrics[steps] = self.metrics.get(steps, 0) + 1
        self.metrics[skips] = self.metrics.get(skips, 0) + int(skipped)
        if role in self.losses:
            if not _finite(self.losses[role]):
                loss = self.losses[role]
            if not _finite(self.grad_norms.get(role)):
                grad_norm = self.grad_norms[role]
            skipped = skipped or self.skipped[role]
        self.losses[role] = loss
        self.grad_norms[role] = grad_norm
        self.skipped[role] = skipped
        self.loss_scales[role] = loss_scale

    def accumulate(self, role: str, loss: float) -> None:
        """A micro-batch of `role` whose gradients were accumulated without an optimizer step."""
        self.losses[role] = loss


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside wrappers (accelerate's AcceleratedOptimizer, colossalai's OptimizerWrapper and
    ZeRO optimizers, DeepSpeed's engines and ZeRO optimizers), or None."""
    for _ in range(4):
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None) or getattr(optimizer, "optim", None)
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


def optimizer_step_count(optimizer: Any) -> int:
    """How many steps a torch optimizer has taken (the largest `step` in its state), found inside wrappers."""
    optimizer = torch_optimizer(optimizer)
    if optimizer is None:
        return 0
    inner = getattr(optimizer, "optim", None)
    if not optimizer.state and isinstance(inner, torch.optim.Optimizer):
        optimizer = inner  # torch's ZeroRedundancyOptimizer keeps its rank's shard, and its steps, in the local one
    steps = [float(state["step"]) for state in optimizer.state.values() if "step" in state]
    return int(max(steps)) if steps else 0


def current_lr(optimizer: Any) -> float | None:
    """The learning rate the optimizer's next step applies to its first parameter group (the main weights; a
    LoRA group with a rate of its own comes later), read from the optimizer a scheduler writes to."""
    optimizer = torch_optimizer(optimizer)
    return float(optimizer.param_groups[0]["lr"]) if optimizer is not None and optimizer.param_groups else None


def merge_micro(outs: list[TrainOutput]) -> TrainOutput:
    """One optimizer step from its micro-batches' outputs (grad_accum): tokens and samples summed, each role's
    loss the mean over its micro-batches (a non-finite one kept), its gradient norm, skip and loss scale from
    the micro-batch that stepped it; optimizer and skipped step counts summed, other metrics averaged."""
    if len(outs) == 1:
        return outs[0]
    merged = TrainOutput(losses={}, tokens=sum(o.tokens for o in outs), samples=sum(o.samples for o in outs))
    for role in dict.fromkeys(role for o in outs for role in o.losses):
        losses = [o.losses[role] for o in outs if role in o.losses]
        merged.losses[role] = next((v for v in losses if not _finite(v)), sum(losses) / len(losses))
        stepped = [o for o in outs if role in o.grad_norms]
        if stepped:
            merged.grad_norms[role] = stepped[-1].grad_norms[role]
            merged.skipped[role] = any(o.skipped[role] for o in stepped)
            merged.loss_scales[role] = stepped[-1].loss_scales[role]
    for key in dict.fromkeys(k for o in outs for k in o.metrics):
        values = [o.metrics[key] for o in outs if key in o.metrics]
        counted = key.startswith(("optimizer_steps/", "skipped_steps/"))
        merged.metrics[key] = sum(values) if counted else sum(values) / len(values)
    return merged


@dataclass
class Rollout:
    sequences: torch.Tensor  # [B, prompt_len + generated]
    attention_mask: torch.Tensor
    prompt_len: int
    prompt_tokens: int  # real prompt tokens
    generated_tokens: int  # real generated tokens (up to and including EOS)

    @property
    def samples(self) -> int:
        return int(self.sequences.shape[0])

    @property
    def real_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def tokens(self) -> int:
        """Tokens that went through the model while generating: each prompt token once (prefill),
        each generated token once (KV cache)."""
        return self.prompt_tokens + self.generated_tokens

    @property
    def answers(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sequences[:, self.prompt_len :], self.attention_mask[:, self.prompt_len :]


@dataclass
class Experience:
    """What the experience-inference phase produced; `payload` is framework-specific."""

    payload: Any
    reward: float  # mean reward-model score on this rank
    kl: float | None  # mean per-token KL estimate to the reference (None: the stage computes none here, GRPO)
    value: float | None  # mean critic value (None: no critic, GRPO)
    tokens: int  # real tokens run through each inference model
    samples: int


@dataclass
class ModelState:
    """Bytes this rank holds for one model, read from the engine's own tensors (not estimated)."""

    param_bytes: int
    optimizer_state_bytes: int
    trainable_param_bytes: int
    accelerator_bytes: int = 0  # of parameters and optimizer state, the bytes on an accelerator (not the host)
    device: str | None = None  # set when the model lives on a device of its own (not the rank's)

    def as_dict(self) -> dict[str, int | str]:
        state: dict[str, int | str] = {
            "param_bytes": self.param_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "trainable_param_bytes": self.trainable_param_bytes,
            "accelerator_bytes": self.accelerator_bytes,
        }
        if self.device is not None:
            state["device"] = self.device
        return state


class Adapter(ABC):
    """One framework's RLHF pipeline structure on its real engine library."""

    #: Which roles' parameters each phase multiplies through (for the shared FLOPs formula). The default
    #: is the four-model PPO layout (separate actor, reference, critic and reward models).
    phase_roles: dict[str, dict[str, tuple[str, ...]]] = {
        "sft": {"training": ("actor",)},
        "rm": {"training": ("reward",), "evaluation": ("reward",)},
        "ppo": {
            "generation": ("actor",),
            "experience": ("actor", "ref", "critic", "reward"),
            "training": ("actor", "critic"),
        },
    }

    def __init__(self, spec: RunSpec, ctx: RankContext) -> None:
        self.spec = spec
        self.ctx = ctx
        self.quantized: dict[str, Any] = {}  # role -> adapters.quantize.QuantizedRole, filled by setup()
        self.reward_scaling: Any = None  # adapters.reward_norm.RewardScaling of a PPO stage (set_reward_scaling)
        self._micro: dict[str, int] = {}  # micro-batches each trained role has run (grad_accum)
        if spec.reference.quant != "none" or spec.reward.quant != "none":
            # imported here, in the worker's `imports` phase: the library's own resident bytes (torchao's ~80
            # MiB of modules and kernel libraries, bitsandbytes' ~40) are an import, not what quantizing saves or costs
            from adapters.quantize import import_library

            import_library(spec.quant_library)

    @abstractmethod
    def setup(self, stage: str, init: dict[str, str]) -> None:
        """Build the stage's models and engines; `init` maps "sft"/"rm" to checkpoint files."""

    # reward.normalize where the config leaves it null: DS-Chat and ColossalChat take the RM's score as it is
    upstream_reward_normalize = "none"
    # the field of the framework's PPO options that counts its update's passes over a step's rollouts
    update_passes_option: str = "ppo_epochs"

    def update_passes(self) -> int:
        """Passes the framework's PPO update makes over each step's rollouts, as its own option sets them."""
        return int(getattr(self.options.ppo, self.update_passes_option))

    def set_reward_scaling(self, init: dict[str, str]) -> None:
        """What make_experience does to the RM's scores (reward.normalize, adapters/reward_norm.py); the loop
        calls it after a PPO stage's setup."""
        from adapters.reward_norm import reward_scaling

        self.reward_scaling = reward_scaling(self.spec, init, self.upstream_reward_normalize)

    #: PPO with grad_accum: False = each rollout's update runs right after it, the optimizers stepping on the
    #: last (DS-Chat, coati); True = all of a step's rollouts first, then their update (trlx's learn)
    updates_after_all_rollouts = False

    def rollouts_per_step(self) -> int:
        """Prompt batches (of `batch` prompts each) a PPO step generates and scores: grad_accum, one per
        micro-batch, unless the framework collects a rollout buffer of its own (coati's num_collect_steps,
        trlx's num_rollouts)."""
        return self.spec.grad_accum

    def ends_accumulation(self, role: str) -> bool:
        """Counts a micro-batch of `role`: whether it completes grad_accum of them, so the optimizer steps.
        Engines that count micro-batches themselves (DeepSpeed's gradient_accumulation_steps) need not ask."""
        self._micro[role] = self._micro.get(role, 0) + 1
        return self._micro[role] % self.spec.grad_accum == 0

    @abstractmethod
    def sft_step(self, batch: SFTBatch) -> TrainOutput:
        """One SFT micro-batch (grad_accum of them make an optimizer step); the trained role is named "actor"
        (the model PPO will start from)."""

    @abstractmethod
    def rm_step(self, batch: PreferenceBatch) -> TrainOutput:
        """One pairwise reward-model micro-batch; the trained role is named "reward"."""

    @abstractmethod
    def rm_scores(self, batch: PreferenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The reward model's end scores of the chosen and of the rejected sequences, in eval mode, no
        gradient (fp32, any device): the RM stage's held-out accuracy and score statistics."""

    @abstractmethod
    def generate(self, batch: PromptBatch) -> Rollout: ...

    @abstractmethod
    def make_experience(self, rollout: Rollout) -> Experience: ...

    @abstractmethod
    def ppo_train(self, experiences: list[Experience]) -> TrainOutput:
        """The update over `experiences`: one rollout's (updates_after_all_rollouts False), or all of a step's."""

    @abstractmethod
    def save(self, stage: str, directory: str) -> str:
        """Write the stage's trained model as a checkpoint the next stage loads; returns the file."""

    def save_checkpoint(self, stage: str, directory: str) -> None:
        """Every trained model's weights and optimizer states into `directory`, through the framework's own
        checkpoint call (collective: every rank calls it). Each rank's random states are the core's."""
        raise UnsupportedError(f"{type(self).__name__} cannot save checkpoints during a stage")

    def load_checkpoint(self, stage: str, directory: str) -> None:
        """What save_checkpoint wrote, into the models and optimizers setup() built."""
        raise UnsupportedError(f"{type(self).__name__} cannot resume from a checkpoint")

    @abstractmethod
    def params(self) -> dict[str, ParamCounts]:
        """Parameter counts per role of the current stage."""

    @abstractmethod
    def model_state(self) -> dict[str, ModelState]:
        """Per-role bytes of parameters and optimizer state held by this rank."""

    @property
    def data_parallel_rank(self) -> int:
        """Which batch this rank draws: ranks that split one model (TP/PP) must see the same data."""
        return self.ctx.rank

    def layout(self) -> dict[str, int]:
        """This rank's coordinates in the parallel layout (data-parallel rank, and TP/PP ranks where used)."""
        return {"data_parallel_rank": self.data_parallel_rank}

    def attention(self) -> dict[str, Attention]:
        """Per role, the attention layers a token crosses and their width (for the FLOPs formula). Every
        role is the run's model unless an adapter says otherwise."""
        config = model_config(self.spec.model)
        shape = Attention(layers=config.num_hidden_layers, hidden=config.hidden_size)
        return {role: shape for role in self.params()}

    @property
    def model_parallel_size(self) -> int:
        """Ranks one model replica is split over (TP x PP); each does 1/this of a replica's FLOPs."""
        return 1

    #: Whether PPO moves its inference-only models between host and device (then `shuttle` is measured
    #: as the phases "onload", before rollout, and "offload", before the update).
    shuttles_models: bool = False

    def shuttle(self, direction: str) -> dict[str, int]:
        """Move the inference-only models ("onload" to the device, "offload" to the host); returns
        {"bytes_moved": ...}."""
        raise NotImplementedError(f"{type(self).__name__} does not shuttle models")

    def notes(self) -> list[str]:
        """Facts a reader of the record must know (fallbacks taken, features unavailable here)."""
        return []

    def probe_points(self) -> dict[str, torch.nn.Module]:
        """Modules whose first forward in PPO marks a moment worth a census of live tensors: "reward_call"
        (upstream's experience maker calling the reward model) and, where it sets the peak, others."""
        return {}

    def computation_dtypes(self) -> dict[str, str]:
        """The dtype each loss-side computation used (log-probs, values, losses), as last seen."""
        return {}

    def engine_knobs(self) -> dict[str, dict[str, float]]:
        """The common knobs as the built engines apply them, read back from the engines (not the config), per
        knob and trained role: `grad_clip` (0 = no clipping)."""
        return {}

    def trained_optimizers(self) -> dict[str, Any]:
        """The optimizers of the trained roles (any wrapper: optimizer_step_count finds the torch one inside)."""
        return {}

    def learning_rates(self) -> dict[str, float]:
        """Per trained role, the learning rate its next optimizer step applies (current_lr): the loop records it
        at each step's start, so a schedule shows in the step records."""
        rates = {role: current_lr(optimizer) for role, optimizer in self.trained_optimizers().items()}
        return {role: rate for role, rate in rates.items() if rate is not None}

    def accumulation(self) -> dict[str, dict[str, int]]:
        """grad_accum as the engines ran it, per trained role: the micro-batches run and the optimizer steps the
        optimizer itself counted (its state's `step`)."""
        return {"micro_batches": dict(self._micro),
                "optimizer_steps": {role: optimizer_step_count(opt) for role, opt in self.trained_optimizers().items()}}

    def trained_modules(self) -> dict[str, torch.nn.Module]:
        """The models this stage trains, by role (engine wrappers are fine: only their module tree is read)."""
        return {}

    def lora_knobs(self) -> dict[str, dict[str, Any]]:
        """lora_targets and lora_alpha as the built models carry them (adapters.lora_targets.lora_layout)."""
        from adapters.lora_targets import lora_layout

        return lora_layout(self.trained_modules()) if self.spec.lora else {}

    def quantized_roles(self) -> dict[str, dict[str, Any]]:
        """Per frozen role held in 8 or 4 bits on this rank (reference.quant, reward.quant): what
        adapters.quantize.quantize_role measured."""
        return {role: entry.as_dict() for role, entry in self.quantized.items()}

    def upstream_defects(self) -> list[dict[str, str]]:
        """Known defects of the upstream engine this run hits: id, where, effect, and how the run handles it."""
        return []

    @abstractmethod
    def close(self) -> None:
        """Release engines and process groups."""
