"""The plain-PyTorch reference on the harness's interface: the yardstick the frameworks are measured against.

No RLHF framework: the same models, data, PPO arithmetic (adapters/rl_math.py, DS-Chat's formulation),
phases and record as the adapters, on PyTorch's own data parallelism (options.LAYOUTS). Split as the
adapters are: `engines` builds, `experience` rolls out and scores, `update` trains; this module holds what
every phase shares (checkpoints between stages, state counts, teardown).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from adapters.base import Adapter, ModelState, RankContext
from adapters.reference.engines import Engines
from adapters.reference.experience import ExperienceMaker
from adapters.reference.options import LAYOUTS, ReferenceOptions
from adapters.reference.update import Update
from adapters.state_bytes import model_state
from bench.measure.params import ParamCounts
from bench.run.spec import RunSpec


class ReferenceAdapter(Engines, ExperienceMaker, Update, Adapter):
    def __init__(self, spec: RunSpec, ctx: RankContext) -> None:
        super().__init__(spec, ctx)
        self.options = ReferenceOptions.validate(spec)
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if ctx.device.type == "cuda" else "gloo")
        if ctx.device.type == "cuda":
            torch.cuda.set_device(ctx.device)
        self.models: dict[str, torch.nn.Module] = {}  # what is called: DDP wrappers, FSDP2 roots, bare modules
        self.modules: dict[str, torch.nn.Module] = {}  # the models themselves
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.scalers: dict[str, torch.amp.GradScaler] = {}
        self._counts: dict[str, ParamCounts] = {}
        self._dtypes: dict[str, str] = {}
        self._notes: list[str] = ["the plain-PyTorch reference: no RLHF framework (the yardstick)"]

    @property
    def layout_name(self) -> str:
        return "one process, no DDP" if self.ctx.world_size == 1 and self.spec.zero == 0 else LAYOUTS[self.spec.zero]

    def _full_state(self, role: str) -> dict[str, torch.Tensor]:
        """The whole model's weights in fp32 on the host, LoRA folded into the base weights (rank 0 only
        under FSDP2: the gather is collective, its result lands there)."""
        module = self.modules[role]
        if self._fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            state = module.state_dict()
        alpha = self.spec.lora_alpha_or(self.options.lora_alpha)
        return fold_lora(state, alpha / self.spec.lora if self.spec.lora else 0.0,
                         transposed=self.spec.model.arch == "gpt2")

    def save(self, stage: str, directory: str) -> str:
        role = "reward" if stage == "rm" else "actor"
        path = os.path.join(directory, f"{role}.pt")
        state = self._full_state(role)
        if self.ctx.rank == 0:
            os.makedirs(directory, exist_ok=True)
            torch.save({k: v.float().cpu().clone() for k, v in state.items()}, path + ".tmp")
            os.replace(path + ".tmp", path)
        dist.barrier()
        return path

    def params(self) -> dict[str, ParamCounts]:
        return dict(self._counts)

    def model_state(self) -> dict[str, ModelState]:
        # ZeroRedundancyOptimizer keeps this rank's share in its local optimizer (`optim`)
        return {role: model_state(module.parameters(), getattr(self.optimizers.get(role), "optim",
                                                                self.optimizers.get(role)))
                for role, module in self.modules.items()}

    def trained_optimizers(self) -> dict[str, Any]:
        return dict(self.optimizers)

    def trained_modules(self) -> dict[str, torch.nn.Module]:
        return {role: self.modules[role] for role in self.optimizers}

    def engine_knobs(self) -> dict[str, dict[str, float]]:
        clip = float(self.spec.grad_clip_or(self.options.grad_clip))  # what update.py's clip_grad_norm_ gets
        return {"grad_clip": {role: clip for role in self.optimizers}}

    def notes(self) -> list[str]:
        return list(self._notes)

    def computation_dtypes(self) -> dict[str, str]:
        return dict(self._dtypes)

    def close(self) -> None:
        self.models.clear()
        self.modules.clear()
        self.optimizers.clear()
        if dist.is_initialized():
            dist.destroy_process_group()


def fold_lora(state: dict[str, torch.Tensor], scaling: float, transposed: bool = True) -> dict[str, torch.Tensor]:
    """peft LoRA folded into plain weights under the plain model's names: W + scaling * (B @ A), transposed for
    GPT-2's Conv1D (fan_in_fan_out: weight [in, out]); a state without LoRA comes back as it is."""
    folded: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        owner, _, leaf = key.rpartition(".base_layer.")
        if owner:
            if leaf == "weight":
                a, b = state[f"{owner}.lora_A.default.weight"], state[f"{owner}.lora_B.default.weight"]
                delta = b.float() @ a.float()
                value = value + scaling * (delta.T if transposed else delta).to(value.dtype)
            key = f"{owner}.{leaf}"
        folded[key] = value
    return folded
