"""DeepSpeed-Chat's three steps on the real deepspeed engine.

The adapter is split the way DS-Chat is: `engines` builds the models and engines of each step
(rlhf_engine.py), `experience` generates and scores rollouts (ppo_trainer.py generate_experience),
`update` runs the training steps (main.py loops, ppo_trainer.py train_rlhf). This module holds the
pieces every phase shares (checkpoints, parameter and state counts, teardown). Where the re-creation
still differs from upstream is declared in the DS-Chat fidelity table (docs/frameworks/dschat.md).
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any

import torch

from adapters.base import Adapter, ModelState, RankContext
from adapters.comm_knobs import deepspeed_comm_knobs
from adapters.deepspeed_cpu import allow_fp16
from adapters.deepspeed_state import held_bytes, zero3_masters
from adapters.dschat import fp16_zero0
from adapters.dschat.engines import Engines
from adapters.dschat.experience import ExperienceMaker
from adapters.dschat.lora import fused_state_dict
from adapters.dschat.options import DSChatOptions
from adapters.dschat.update import Update
from adapters.state_bytes import model_state
from bench.measure.params import ParamCounts
from bench.run.models import count_params
from bench.run.spec import RunSpec


class DSChatAdapter(Engines, ExperienceMaker, Update, Adapter):
    def __init__(self, spec: RunSpec, ctx: RankContext) -> None:
        super().__init__(spec, ctx)
        if ctx.device.type == "cpu":  # skip DeepSpeed's accelerator probing and its warning
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        self.ds = deepspeed
        self.options = DSChatOptions.validate(spec)
        self.engines: dict[str, Any] = {}
        offload = (" with optimizer offload" + (" and parameter offload" if spec.zero == 3 else "")
                   if spec.offload else "")
        self._notes: list[str] = [f"engine: DeepSpeed ZeRO-{spec.zero} {spec.precision}{offload} "
                                  "(DS-Chat's ds_config)"]
        self._dtypes: dict[str, str] = {}
        self._unscaled: dict[str, fp16_zero0.ClipWatch] = {}  # roles hit by the fp16 ZeRO-0 defect
        deepspeed.init_distributed()
        fp16_note = allow_fp16(ctx.device, spec.precision)
        if fp16_note:
            self._notes.append(fp16_note)
        # The optimizer's JIT op is built and loaded now, inside the measured `imports` phase.
        if self.options.optimizer == "fused_adam":
            from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder

            (CPUAdamBuilder if spec.offload else FusedAdamBuilder)().load()

    def _upcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """--compute_fp32_loss: experience logits and the value loss's values in fp32 (both phases use it)."""
        return tensor.float() if self.options.compute_fp32_loss else tensor

    # ----------------------------------------------------------------- state
    def save(self, stage: str, directory: str) -> str:
        role = "reward" if stage == "rm" else "actor"  # step 3 keeps the RLHF-trained actor
        module = self.engines[role].module
        path = os.path.join(directory, f"{role}.pt")
        if self.spec.zero == 3:
            # The RM's closing evaluation is a forward without a backward: ZeRO-3's prefetcher, following the
            # trace of the training steps, has fetched the backward's parameters, which stay in flight and
            # refuse GatheredParameters ("Cannot partition a param in flight"). Releasing them first is what
            # the engine offers (empty_partition_cache); upstream's save_zero_three_model skips in-flight
            # parameters in its gather list instead.
            self.engines[role].empty_partition_cache()
        gather = (
            self.ds.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
            if self.spec.zero == 3 else nullcontext()
        )
        with gather:
            if self.ctx.rank == 0:
                os.makedirs(directory, exist_ok=True)
                state = {k: v.float().cpu().clone() for k, v in fused_state_dict(module).items()}
                torch.save(state, path + ".tmp")
                os.replace(path + ".tmp", path)
        torch.distributed.barrier()
        return path

    def engine_knobs(self) -> dict[str, dict[str, float]]:
        # the trained engines: actor and critic in step 3, the one engine of steps 1 and 2 (the eval engines keep
        # a clipping setting too, and DS-Chat leaves their parameters requiring gradients)
        roles = ("actor", "critic") if "critic" in self.engines else tuple(self.engines)
        # every DeepSpeed engine's ZeRO stage as the engine reports it (a quantized role has none: outside DeepSpeed)
        stages = {role: int(engine.zero_optimization_stage()) for role, engine in self.engines.items()
                  if hasattr(engine, "zero_optimization_stage")}
        return {"grad_clip": {role: float(self.engines[role].gradient_clipping()) for role in roles},
                "zero_stage": stages, **deepspeed_comm_knobs({role: self.engines[role] for role in roles})}

    def accumulation(self) -> dict[str, dict[str, int]]:
        """DeepSpeed's own counts: micro-batches run and optimizer steps taken by each trained engine."""
        roles = ("actor", "critic") if "critic" in self.engines else tuple(self.engines)
        return {"micro_batches": {role: int(self.engines[role].micro_steps) for role in roles},
                "optimizer_steps": {role: int(self.engines[role].global_steps) for role in roles}}

    def learning_rates(self) -> dict[str, float]:
        """The rate of each trained engine's first parameter group, from the engine (its scheduler writes it)."""
        roles = ("actor", "critic") if "critic" in self.engines else tuple(self.engines)
        return {role: float(self.engines[role].get_lr()[0]) for role in roles}

    def trained_modules(self) -> dict[str, torch.nn.Module]:
        return {role: engine.module for role, engine in self._trained().items()}

    def _trained(self) -> dict[str, Any]:
        return {role: engine for role, engine in self.engines.items() if engine.optimizer is not None}

    def save_checkpoint(self, stage: str, directory: str) -> None:
        """DeepSpeed's engine.save_checkpoint per trained engine (DS-Chat itself saves only at the end)."""
        for role, engine in self._trained().items():
            engine.save_checkpoint(os.path.join(directory, role), tag="state", save_latest=False)

    def load_checkpoint(self, stage: str, directory: str) -> None:
        for role, engine in self._trained().items():
            path, _ = engine.load_checkpoint(os.path.join(directory, role), tag="state")
            if path is None:
                raise RuntimeError(f"no DeepSpeed checkpoint of {role} in {directory}")

    def params(self) -> dict[str, ParamCounts]:
        return {role: count_params(engine.module) for role, engine in self.engines.items()}

    def model_state(self) -> dict[str, ModelState]:
        return {role: _engine_state(engine) for role, engine in self.engines.items()}

    def notes(self) -> list[str]:
        return list(self._notes)

    def probe_points(self) -> dict[str, torch.nn.Module]:
        """The reward model's backbone: forward_value calls it first."""
        if "ref" not in self.engines:
            return {}
        return {"reward_call": self.engines["reward"].module.rwtransformer}

    def computation_dtypes(self) -> dict[str, str]:
        return dict(self._dtypes)

    def upstream_defects(self) -> list[dict[str, str]]:
        return [fp16_zero0.record_entry(self.options.fix_fp16_zero0_loss_scale)] if self._unscaled else []

    def close(self) -> None:
        self.engines.clear()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _engine_state(engine) -> ModelState:
    wrapper = engine.optimizer
    inner = getattr(wrapper, "optimizer", wrapper) if wrapper is not None else None
    return model_state(engine.module.parameters(), inner, held=held_bytes, masters=zero3_masters(wrapper))
