"""ColossalChat's SFT, RM and PPO on the real colossalai Booster.

Split the way coati is: `engines` builds models, plugins and boosters (the training scripts),
`experience` is NaiveExperienceMaker, `update` the trainers' steps. This module holds what every phase
shares: the parallel layout, full-vocabulary logits, the model shuttle, checkpoints and state counts.
Where the re-creation still differs from coati (positions skip left padding in every forward; the reward
model reads the stop token; the critic sees the rollout's left-padded layout) is declared in the
ColossalChat fidelity table (docs/frameworks/colossalai.md).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from adapters.base import Adapter, ModelState, RankContext
from adapters.colossalai import schedule
from adapters.colossalai.engines import Engines
from adapters.colossalai.experience import ExperienceMaker
from adapters.colossalai.lora import merged_state_dict
from adapters.colossalai.options import ColossalOptions, PluginChoice
from adapters.colossalai.update import Update
from adapters.state_bytes import model_state
from bench.measure.params import ParamCounts
from bench.run.spec import RunSpec, UnsupportedError

GEMINI_ON_CPU = (
    "GeminiPlugin (zero=3) needs CUDA: its chunk manager moves every chunk to the GPU "
    "(colossalai/zero/gemini/chunk/manager.py asserts 'each chunk should first be moved to CUDA'; "
    "placement_policy=auto fails with 'Torch not compiled with CUDA enabled')"
)


class ColossalAdapter(Engines, ExperienceMaker, Update, Adapter):
    update_passes_option = "num_update_steps"  # PPOTrainer's passes over its buffer (train_ppo.sh: 1)

    def __init__(self, spec: RunSpec, ctx: RankContext) -> None:
        super().__init__(spec, ctx)
        self.options = ColossalOptions.validate(spec)
        self.plugin = self.options.resolve_plugin(spec)
        self._notes: list[str] = [f"plugin: {self.plugin.name} = {self._describe(self.plugin)}"]
        if self.plugin.cls == "GeminiPlugin" and ctx.device.type != "cuda":
            raise UnsupportedError(GEMINI_ON_CPU)
        if ctx.device.type == "cpu":
            from adapters.colossalai import cpu_compat

            self._notes.append("CPU compatibility fixes (colossalai 0.5.0): " + "; ".join(cpu_compat.apply()))
        import colossalai
        from colossalai.booster import Booster

        self._booster_cls = Booster
        colossalai.launch_from_torch(seed=spec.seed)
        if self.options.optimizer == "hybrid_adam":  # HybridAdam's kernels, JIT-built on first use
            from colossalai.kernel.kernel_loader import CPUAdamLoader, FusedOptimizerLoader

            CPUAdamLoader().load()
            if ctx.device.type == "cuda":
                FusedOptimizerLoader().load()
        # The plugin builds the process-group mesh: the data-parallel rank is read from its own groups.
        self._plugin = self._make_plugin()
        self.models: dict[str, Any] = {}
        self.optimizers: dict[str, Any] = {}
        self.boosters: dict[str, Any] = {}
        self.schedulers: dict[str, Any] = {}  # trained role -> its LR scheduler (stepped after its optimizer)
        self._counts: dict[str, ParamCounts] = {}
        self._dtypes: dict[str, str] = {}
        self._on_device = True
        self.shuttles_models = False

    @staticmethod
    def _describe(plugin: PluginChoice) -> str:
        args = ", ".join(f"{k}={v}" for k, v in plugin.kwargs.items())
        return f"{plugin.cls}({args})"

    # ----------------------------------------------------------------- parallel layout
    @property
    def model_parallel_size(self) -> int:
        return self.spec.tp * self.spec.pp

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index in its plugin's data-parallel group (colossalai 0.5.0 lays HybridParallelPlugin's
        mesh out as (dp, pp, tp) by default; the groups are the truth, whatever the order). The other plugins
        are data-parallel only."""
        group = getattr(self._plugin, "dp_group", None)
        return dist.get_group_rank(group, dist.get_rank()) if group is not None else self.ctx.rank

    def layout(self) -> dict[str, int]:
        layout = {"data_parallel_rank": self.data_parallel_rank}
        for axis in ("pp", "tp"):
            group = getattr(self._plugin, f"{axis}_group", None)
            if group is not None:
                layout[f"{axis}_rank"] = dist.get_group_rank(group, dist.get_rank())
        return layout

    # ----------------------------------------------------------------- building
    # ----------------------------------------------------------------- shared by every phase
    def _logits(self, role: str, **inputs: Any) -> tuple[torch.Tensor, Any]:
        """Full-vocabulary logits of an LM role. colossalai 0.5.0's GPT-2 policy builds its TP LM head with
        gather_output=False whatever parallel_output says, so vocabulary shards are gathered here
        (differentiably, as a gathering LM head would)."""
        out = self.models[role](**inputs)
        logits = out.logits
        if self.spec.tp > 1 and logits.shape[-1] != self.spec.model.vocab:
            from colossalai.shardformer.layer._operation import gather_forward_split_backward

            logits = gather_forward_split_backward(logits, -1, self.boosters[role].plugin.tp_group)
            logits = logits[..., : self.spec.model.vocab]
        return logits, getattr(out, "past_key_values", None)

    @property
    def _inference_models(self) -> list[torch.nn.Module]:
        return [self.models[role] for role in ("ref", "reward") if role not in self.quantized]

    def shuttle(self, direction: str) -> dict[str, int]:
        target = self.ctx.device if direction == "onload" else torch.device("cpu")
        moved = 0
        for model in self._inference_models:
            for tensor in [*model.parameters(), *model.buffers()]:
                if tensor.device != target:
                    moved += tensor.numel() * tensor.element_size()
            model.to(target)
        return {"bytes_moved": moved}

    def save(self, stage: str, directory: str) -> str:
        role = "reward" if stage == "rm" else "actor"  # PPO keeps the RLHF-trained actor
        path = os.path.join(directory, f"{role}.pt")
        model = self.models[role]
        if self.model_parallel_size > 1 or self.plugin.cls == "GeminiPlugin":
            gathered = os.path.join(directory, f"{role}.gathered.pt")
            if self.ctx.rank == 0:
                os.makedirs(directory, exist_ok=True)
            dist.barrier()
            self.boosters[role].save_model(model, gathered, shard=False)
            dist.barrier()
            if self.ctx.rank == 0:
                state = torch.load(gathered, map_location="cpu", weights_only=True)
                os.remove(gathered)
        elif self.ctx.rank == 0:
            state = merged_state_dict(model.unwrap())
        if self.ctx.rank == 0:
            os.makedirs(directory, exist_ok=True)
            torch.save({k: v.float().cpu().clone() for k, v in state.items()}, path + ".tmp")
            os.replace(path + ".tmp", path)
        dist.barrier()
        return path

    def save_checkpoint(self, stage: str, directory: str) -> None:
        """coati's save_checkpoint (coati/utils/ckpt_io.py) per trained model: the booster's sharded save of
        the model ("modeling"), of the optimizer ("optimizer") and the LR scheduler ("lr_scheduler")."""
        for role, optimizer in self.optimizers.items():
            base = os.path.join(directory, role)
            os.makedirs(os.path.join(base, "modeling"), exist_ok=True)
            self.boosters[role].save_model(self.models[role], os.path.join(base, "modeling"), shard=True)
            self.boosters[role].save_optimizer(optimizer, os.path.join(base, "optimizer"), shard=True)
            self.boosters[role].save_lr_scheduler(self.schedulers[role], os.path.join(base, "lr_scheduler"))

    def load_checkpoint(self, stage: str, directory: str) -> None:
        """coati's load_checkpoint: the booster loads the model, the optimizer, then the LR scheduler."""
        for role, optimizer in self.optimizers.items():
            base = os.path.join(directory, role)
            self.boosters[role].load_model(self.models[role], os.path.join(base, "modeling"))
            self.boosters[role].load_optimizer(optimizer, os.path.join(base, "optimizer"))
            self.boosters[role].load_lr_scheduler(self.schedulers[role], os.path.join(base, "lr_scheduler"))

    def params(self) -> dict[str, ParamCounts]:
        return dict(self._counts)

    def model_state(self) -> dict[str, ModelState]:
        # Module parameters are what this rank holds (TP shards under 3d; ZeRO 1/2 shard optimizer state only).
        return {role: model_state(model.parameters(), _inner_optimizer(self.optimizers.get(role)))
                for role, model in self.models.items()}

    def trained_optimizers(self) -> dict[str, Any]:
        return dict(self.optimizers)

    #: OLTrainer.fit: num_collect_steps rollouts into the buffer, then the update over all of them
    updates_after_all_rollouts = True

    def rollouts_per_step(self) -> int:
        """A step is one episode: num_collect_steps rollouts of `batch` prompts (--experience_batch_size)."""
        return self.options.ppo.num_collect_steps

    def upstream_defects(self) -> list[dict[str, str]]:
        return [dict(schedule.UPSTREAM_DEFECT)] if self.schedulers else []

    def trained_modules(self) -> dict[str, torch.nn.Module]:
        return {role: self.models[role] for role in self.optimizers}

    def engine_knobs(self) -> dict[str, dict[str, float]]:
        knobs: dict[str, dict[str, Any]] = {
            "grad_clip": {role: _clip_of(optimizer) for role, optimizer in self.optimizers.items()}}
        for knob, attribute in (("reduce_bucket_size", "_reduce_bucket_size"),
                                ("overlap_comm", "_overlap_communication")):  # ZeRO optimizers only
            found = {role: _zero_attribute(optimizer, attribute) for role, optimizer in self.optimizers.items()}
            if any(value is not None for value in found.values()):
                knobs[knob] = found
        return knobs

    def notes(self) -> list[str]:
        return list(self._notes)

    def probe_points(self) -> dict[str, torch.nn.Module]:
        """The reward model's backbone (NaiveExperienceMaker calls the reward model after the logits)."""
        if "ref" not in self.models:
            return {}
        reward = self.models["reward"]
        return {"reward_call": (reward if "reward" in self.quantized else reward.unwrap()).model}

    def computation_dtypes(self) -> dict[str, str]:
        return dict(self._dtypes)

    def close(self) -> None:
        self.models.clear()
        self.optimizers.clear()
        self.boosters.clear()
        if dist.is_initialized():
            dist.destroy_process_group()



def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    while hasattr(optimizer, "optim"):  # colossalai's OptimizerWrapper chain
        optimizer = optimizer.optim
    return optimizer


def _zero_attribute(optimizer: Any, name: str) -> Any:
    """An attribute of the LowLevelZero optimizer inside a boosted optimizer's wrappers; None where none is."""
    while optimizer is not None:
        if hasattr(optimizer, name):
            return getattr(optimizer, name)
        optimizer = getattr(optimizer, "optim", None)
    return None


def _clip_of(optimizer: Any) -> float:
    """The clipping threshold a boosted optimizer applies: LowLevelZero's `_clip_grad_norm`, the hybrid
    plugin's `max_norm`, down its wrappers; 0 where none clips (TorchDDPPlugin's plain optimizer)."""
    while optimizer is not None:
        for name in ("_clip_grad_norm", "max_norm"):
            if isinstance(getattr(optimizer, name, None), (int, float)):
                return float(getattr(optimizer, name))
        optimizer = getattr(optimizer, "optim", None)
    return 0.0
