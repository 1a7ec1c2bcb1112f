"""Trlx's SFT, RM and PPO on the real accelerate library (with its DeepSpeed plugin for ZeRO).

Split the way trlx is: `engines` builds each stage's models (trainer __init__, get_arch, the examples'
reward models), `experience` is make_experience and the reward function, `update` is learn / loss. PPO
arithmetic follows trlx: scores clipped to +-10, then scaled by the running std, per-token k1 KL with a
fixed (or adaptive) coefficient, the score on the last response token, GAE with advantages whitened across
ranks, clipped policy and value losses in one joint loss, `ppo_epochs` passes per rollout. Where the
re-creation still differs from upstream is declared in the trlx fidelity table (docs/frameworks/trlx.md).
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from adapters.base import Adapter, ModelState, RankContext
from adapters.comm_knobs import deepspeed_comm, deepspeed_comm_knobs
from adapters.deepspeed_cpu import allow_fp16
from adapters.deepspeed_state import held_bytes, zero3_masters
from adapters.state_bytes import model_state
from adapters.trlx.engines import Engines
from adapters.trlx.experience import ExperienceMaker
from adapters.trlx.models import PolicyWithValueHead
from adapters.trlx.options import TrlxOptions
from adapters.trlx.update import Update
from bench.measure.flops import Attention
from bench.measure.params import ParamCounts
from bench.run.spec import RunSpec, UnsupportedError

MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


# A resumed trlx PPO run loses state its save never wrote (see upstream_defects).
RESUME_DEFECT = "trlx-save-state-drops-running-moments-and-kl-controller"
MINIBATCH_DEFECT = "trlx-deepspeed-minibatch-steps-every-micro-batch"
MINIBATCH_DEFECT_WHERE = ("trlx/trainer/accelerate_base_trainer.py learn() and _accumulate (accelerator.backward per "
                          "micro-batch, opt.step() per minibatch) with accelerate's DeepSpeedEngineWrapper.backward")
RESUME_DEFECT_WHERE = ("trlx accelerate_base_trainer.py save()/load() = accelerator.save_state/load_state; "
                       "accelerate_ppo_trainer.py running_moments and kl_ctl are plain attributes, never registered "
                       "for checkpointing")


UPSTREAM_CLIP = 1.0  # trlx's configs/accelerate/zero*.yaml: gradient_clipping 1.0 (its trainers call no clip)

class TrlxAdapter(Engines, ExperienceMaker, Update, Adapter):
    updates_after_all_rollouts = True  # learn(): make_experience(num_rollouts) first, then the passes over them

    def rollouts_per_step(self) -> int:
        """num_rollouts in generate calls of chunk_size = batch prompts (a step is one learning phase)."""
        return self.options.num_rollouts(self.spec) // self.spec.batch
    phase_roles = {
        "sft": {"training": ("actor",)},
        "rm": {"training": ("reward",), "evaluation": ("reward",)},
        # One shared trunk: rollout, scoring and update all run through the policy; the reference adds
        # its own branch (or copy), the reward model runs once per rollout.
        "ppo": {"generation": ("actor",), "experience": ("actor", "ref", "reward"), "training": ("actor",)},
    }

    def __init__(self, spec: RunSpec, ctx: RankContext) -> None:
        super().__init__(spec, ctx)
        self.options = TrlxOptions.validate(spec)
        _check_reward_device(self.options.reward_device)
        if ctx.device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

        plugin = None
        if spec.zero > 0:
            # zero3_init_flag stays off (trlx's zero3.yaml sets it): see the trlx fidelity table
            # (docs/frameworks/trlx.md).
            plugin = DeepSpeedPlugin(zero_stage=spec.zero, gradient_accumulation_steps=1,
                                     gradient_clipping=spec.grad_clip_or(UPSTREAM_CLIP),
                                     zero3_init_flag=False, zero3_save_16bit_model=spec.zero == 3)
            plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = spec.batch
            # ds.* where set (trlx's accelerate yamls set none: DeepSpeed's defaults)
            plugin.deepspeed_config["zero_optimization"].update(deepspeed_comm(spec, ctx.device))
            if spec.precision == "fp16":  # trlx PR #279: DeepSpeed's fp16 autocast broke its forward
                plugin.deepspeed_config["fp16"] = {"enabled": True, "auto_cast": False}
        on_cpu = ctx.device.type == "cpu"
        # Without an accelerator Accelerate picks no process-group backend: DeepSpeed needs gloo named, and
        # plain DDP is only built (MULTI_CPU) when Accelerate is told it runs on the CPU.
        handlers = [InitProcessGroupKwargs(backend="gloo")] if on_cpu else []
        self.accelerator = Accelerator(mixed_precision=MIXED_PRECISION[spec.precision], deepspeed_plugin=plugin,
                                       kwargs_handlers=handlers, cpu=on_cpu and plugin is None)
        self.deepspeed = plugin is not None
        self._notes: list[str] = [self._engine_note()]
        # Every engine library the run will use is imported now, inside the measured `imports` phase.
        if plugin is not None:
            fp16_note = allow_fp16(ctx.device, spec.precision)
            if fp16_note:
                self._notes.append(fp16_note)
        if spec.lora or self.options.reference_mode(spec.lora) == "peft":
            import peft  # noqa: F401
        self.model: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self._stage = ""
        self.role = "actor"
        self.ref_model: torch.nn.Module | None = None
        self.reward_model: torch.nn.Module | None = None
        self._counts: dict[str, ParamCounts] = {}
        self._dtypes: dict[str, str] = {}
        self._resumed_ppo = False
        self._kl_coef = self.options.ppo.init_kl_coef

    def _engine_note(self) -> str:
        if self.deepspeed:
            return f"engine: accelerate {self.accelerator.distributed_type.value} with DeepSpeed ZeRO-{self.spec.zero}"
        return f"engine: accelerate {self.accelerator.distributed_type.value} (no DeepSpeed; zero=0)"

    def attention(self) -> dict[str, Attention]:
        """The hydra reference re-runs the whole trunk, then its branch's blocks (forward_hydra)."""
        shapes = super().attention()
        if "ref" in shapes and self.options.reference_mode(self.spec.lora) == "hydra":
            shape = shapes["ref"]
            shapes["ref"] = Attention(layers=shape.layers + self.options.num_layers_unfrozen, hidden=shape.hidden)
        return shapes

    @property
    def _unwrapped(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model)

    # ----------------------------------------------------------------- state
    def save(self, stage: str, directory: str) -> str:
        role = "reward" if stage == "rm" else "actor"
        path = os.path.join(directory, f"{role}.pt")
        module = self._unwrapped
        gather = nullcontext()
        if self.spec.zero == 3:
            import deepspeed

            gather = deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
        with gather:
            if self.ctx.rank == 0:
                if stage == "rm":
                    state = {f"transformer.{k}": v for k, v in _lm_state(module.transformer).items()}
                    state.update({f"v_head.{k}": v for k, v in module.v_head.state_dict().items()})
                else:
                    state = _lm_state(module.base_model if isinstance(module, PolicyWithValueHead) else module)
                os.makedirs(directory, exist_ok=True)
                torch.save({k: v.float().cpu().clone() for k, v in state.items()}, path + ".tmp")
                os.replace(path + ".tmp", path)
        self.accelerator.wait_for_everyone()
        return path

    def save_checkpoint(self, stage: str, directory: str) -> None:
        """trlx's save(): accelerator.save_state (models, optimizer, random states; DeepSpeed's
        save_checkpoint underneath at ZeRO > 0). Overlapped with training, weights go through torch.save:
        safetensors, accelerate's default, has no hook to snapshot them."""
        self.accelerator.save_state(directory, safe_serialization=not self.spec.checkpoint.background)

    def load_checkpoint(self, stage: str, directory: str) -> None:
        """trlx's load(): accelerator.load_state. Like trlx, it does not restore the reward-scaling running
        moments nor the KL controller: they were never saved (a finding, see upstream_defects)."""
        self.accelerator.load_state(directory)
        self._resumed_ppo = stage == "ppo"

    def upstream_defects(self) -> list[dict[str, str]]:
        found = []
        if self._resumed_ppo:
            found.append({"id": RESUME_DEFECT, "where": RESUME_DEFECT_WHERE,
                          "effect": ("a resumed PPO run restarts the running mean and std that scale its rewards "
                                     "(scale_reward=running) and an adaptive KL coefficient: its steps after the "
                                     "resume are not those of an uninterrupted run"),
                          "handling": "run as upstream"})
        if self.deepspeed and self.spec.grad_accum > 1 and self.role == "actor":
            found.append({"id": MINIBATCH_DEFECT, "where": MINIBATCH_DEFECT_WHERE,
                          "effect": (f"minibatch_size splits each batch into {self.spec.grad_accum} micro-batches, "
                                     "but accelerate's DeepSpeed backward steps the engine after each of them (trlx "
                                     "sets no gradient_accumulation_steps): an optimizer step per micro-batch, "
                                     "none accumulated"),
                          "handling": "run as upstream: the steps' optimizer_steps count them"})
        return found

    def params(self) -> dict[str, ParamCounts]:
        return dict(self._counts)

    def model_state(self) -> dict[str, ModelState]:
        engine = self.model
        inner = self.optimizer.optimizer if hasattr(self.optimizer, "optimizer") else self.optimizer
        if self.deepspeed:
            inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        masters = zero3_masters(engine.optimizer) if self.deepspeed else ()
        states = {self.role: model_state(self._unwrapped.parameters(), inner, held=held_bytes, masters=masters)}
        if self.ref_model is not None:
            states["ref"] = model_state(self.ref_model.parameters(), None)
        if self.reward_model is not None:  # its own line in the memory breakdown
            states["reward_fn"] = model_state(self.reward_model.parameters(), None)
            states["reward_fn"].device = str(self.reward_device)
        return states

    @property
    def upstream_reward_normalize(self) -> str:
        """trlx's scale_reward: running, ref (over the first rollout's std) or ignored (none)."""
        scale = self.options.ppo.scale_reward
        return "none" if scale == "ignored" else scale

    def trained_optimizers(self) -> dict[str, Any]:
        return {self.role: self.optimizer} if self.optimizer is not None else {}

    def accumulation(self) -> dict[str, dict[str, int]]:
        if not self.deepspeed or self.model is None:
            return super().accumulation()
        return {"micro_batches": {self.role: int(self.model.micro_steps)},  # DeepSpeed's own counts
                "optimizer_steps": {self.role: int(self.model.global_steps)}}

    def trained_modules(self) -> dict[str, torch.nn.Module]:
        return {self.role: self.model} if self.model is not None else {}

    def engine_knobs(self) -> dict[str, dict[str, float]]:
        """DeepSpeed's own clipping, read from the engine; under DDP the update's own clip (0: none, as trlx)."""
        if self.model is None:
            return {}
        if not self.deepspeed:  # the update's own clip (0: none, as trlx)
            return {"grad_clip": {self.role: float(self.spec.grad_clip or 0.0)}}
        return {"grad_clip": {self.role: float(self.model.gradient_clipping())},
                **deepspeed_comm_knobs({self.role: self.model})}

    def notes(self) -> list[str]:
        return list(self._notes)

    def probe_points(self) -> dict[str, torch.nn.Module]:
        """The reward function's model (rank 0, called first) and the reference: the hydra branch, or the
        full copy (the peft reference is the policy's own call, not a module of its own)."""
        points: dict[str, torch.nn.Module] = {}
        if self.reward_model is not None:
            points["reward_call"] = self.reward_model.transformer
        if self.ref_model is not None:
            points["reference_call"] = self.ref_model
        elif self.model is not None and getattr(self._unwrapped, "frozen_head", None) is not None:
            points["reference_call"] = self._unwrapped.frozen_head
        return points

    def computation_dtypes(self) -> dict[str, str]:
        return dict(self._dtypes)

    def close(self) -> None:
        self.model = self.optimizer = self.ref_model = self.reward_model = None
        if dist.is_initialized():
            dist.destroy_process_group()


def _check_reward_device(device: str | None) -> None:
    if device is None or not device.startswith("cuda"):
        return
    index = int(device.partition(":")[2] or 0)
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= visible:
        raise UnsupportedError(f"framework.reward_device={device} but this machine shows {visible} CUDA device(s); "
                               "use null (rank 0's training device), cpu, or an existing cuda:N")


def _lm_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weights under the plain model's names; peft LoRA deltas are folded into their base weights."""
    if not hasattr(model, "get_base_model"):
        return {k: v.detach() for k, v in model.state_dict().items()}
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {name: m.get_delta_weight("default") for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    state = {}
    for key, value in base.state_dict().items():
        if "lora_" in key:
            continue
        owner, _, leaf = key.rpartition(".base_layer.")
        if owner and leaf == "weight" and owner in deltas:
            value = value + deltas[owner].to(value.dtype)
        state[key.replace(".base_layer.", ".")] = value.detach()
    return state


