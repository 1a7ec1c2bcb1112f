"""The reference's models per stage, wrapped in PyTorch's own data parallelism (see options.LAYOUTS).

SFT trains the causal LM ("actor"); RM a backbone with a value head ("reward"); PPO four models as DS-Chat
and coati build them: actor and critic train (each its own AdamW), reference and reward are frozen and
held in the run's precision. Trained models keep fp32 parameters: under DDP the forward runs in
torch.autocast (bf16/fp16; fp16 losses scaled by torch.amp.GradScaler), under FSDP2 in its
MixedPrecisionPolicy (parameters gathered in the run's precision, gradients reduced in fp32). Frozen
models are sharded too at ZeRO-3 (as DS-Chat's eval engines follow ZeRO-3), replicated otherwise.
LoRA is peft's, injected into every attention and MLP projection, the value heads left trainable.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from adapters.lora_targets import suffixes
from adapters.reference.models import ValueModel, end_scores
from adapters.rl_math import position_ids
from bench.run.families import FAMILIES, MEANINGS
from bench.run.models import TORCH_DTYPES, build_backbone, build_causal_lm, count_params, set_dropout

BLOCK_CLASSES = {traits.layer_class for traits in FAMILIES.values()}  # GPT2Block, LlamaDecoderLayer, ...


class Engines:
    """Building half of ReferenceAdapter (a mixin: the adapter holds spec, ctx, options and the dicts)."""

    @property
    def _dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.spec.precision]

    @property
    def _fsdp(self) -> bool:
        return self.spec.zero >= 2

    def autocast(self):
        """The forward's precision context: autocast under DDP, nothing under FSDP2 (its policy casts)."""
        if self.spec.precision == "fp32" or self._fsdp:
            return nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=self._dtype)

    def _mesh(self):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.ctx.device.type, (self.ctx.world_size,))

    def _shard(self, model: torch.nn.Module, reshard_after_forward: bool) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy() if self.spec.precision == "fp32" else \
            MixedPrecisionPolicy(param_dtype=self._dtype, reduce_dtype=torch.float32)
        mesh = self._mesh()
        for block in [m for m in model.modules() if type(m).__name__ in BLOCK_CLASSES]:  # one unit per block
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)

    def _lm(self, checkpoint: str | None) -> torch.nn.Module:
        torch.manual_seed(self.spec.seed)  # every role starts from the same "pretrained" base weights
        model = build_causal_lm(self.spec.model)
        if checkpoint:
            model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True))
        return model

    def _value_model(self, checkpoint: str | None) -> torch.nn.Module:
        torch.manual_seed(self.spec.seed)
        model = ValueModel(build_backbone(self.spec.model))
        if checkpoint:
            model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True))
        return model

    def _lora(self, model: torch.nn.Module) -> None:
        if not self.spec.lora:
            return
        from peft import LoraConfig, inject_adapter_in_model

        arch = self.spec.model.arch
        config = LoraConfig(r=self.spec.lora, lora_alpha=self.spec.lora_alpha_or(self.options.lora_alpha),
                            lora_dropout=0.0, target_modules=suffixes(self.spec.lora_target_set or MEANINGS, arch),
                            fan_in_fan_out=arch == "gpt2")  # GPT-2's Conv1D keeps its weight as [in, out]
        inject_adapter_in_model(config, model)
        for name, param in model.named_parameters():
            param.requires_grad_("lora_" in name or name.startswith("value_head."))

    def _train(self, role: str, model: torch.nn.Module, lr: float) -> None:
        """`role` trains: to the device, wrapped for data parallelism, with its own AdamW."""
        self._counts[role] = count_params(model)
        model.to(self.ctx.device)
        if self.spec.grad_ckpt:
            backbone = model.model if hasattr(model, "value_head") else model
            backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self._fsdp:
            self._shard(model, reshard_after_forward=self.spec.zero == 3)
            wrapped = model
        elif self.ctx.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
            wrapped = DistributedDataParallel(model, device_ids=device_ids)
        else:
            wrapped = model
        params = [p for p in model.parameters() if p.requires_grad]
        kwargs: dict[str, Any] = {"lr": lr, "betas": tuple(self.options.betas),
                                  "weight_decay": self.options.weight_decay}
        if self.spec.zero == 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **kwargs)
        else:
            optimizer = torch.optim.AdamW(params, **kwargs)
        self.models[role], self.modules[role], self.optimizers[role] = wrapped, model, optimizer
        if self.spec.precision == "fp16":
            self.scalers[role] = torch.amp.GradScaler(self.ctx.device.type, init_scale=self.options.initial_scale)
        model.train()

    def _freeze(self, role: str, model: torch.nn.Module) -> None:
        """`role` only infers: no gradients, the run's precision, sharded at ZeRO-3 -- or, in 8 or 4 bits
        (reference.quant, reward.quant), replicated: FSDP2 shards no bitsandbytes weights."""
        self._counts[role] = count_params(model)
        model.requires_grad_(False)
        model.to(self.ctx.device, self._dtype)
        model.eval()
        quant = (self.spec.reference if role == "ref" else self.spec.reward).quant
        if quant != "none":
            self._quantize(role, model)
        elif self.spec.zero == 3:
            self._shard(model, reshard_after_forward=True)
        self.models[role] = self.modules[role] = model

    def _quantize(self, role: str, model: torch.nn.Module) -> None:
        from adapters.quantize import quantize_reference, quantize_reward

        if role == "ref":
            self.quantized[role] = quantize_reference(self.spec, model, self.ctx.device, lambda ids, mask: model(
                input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False).logits)
        else:
            self.quantized[role] = quantize_reward(self.spec, model, self.ctx.device, lambda ids, mask: end_scores(
                model(ids, mask, position_ids(mask)), mask))
        self._notes.append(f"{role}: {self.quantized[role].mode} weights ({self.quantized[role].library}), "
                           "replicated (a harness extension)")

    def setup(self, stage: str, init: dict[str, str]) -> None:
        if stage == "sft":
            model = self._lm(init.get("sft"))
            self._lora(model)
            self._train("actor", model, self.spec.stage_lr("sft"))
        elif stage == "rm":
            model = self._value_model(init.get("rm"))
            self._lora(model)
            self._train("reward", model, self.spec.stage_lr("rm"))
        else:
            actor, critic = self._lm(init.get("sft")), self._value_model(init.get("rm"))
            for model in (actor, critic):
                set_dropout(model, 0.0)  # DS-Chat's scripts pass --actor_dropout 0.0; coati disables both
                self._lora(model)
            self._train("actor", actor, self.spec.stage_lr("actor"))
            self._train("critic", critic, self.spec.stage_lr("critic"))
            self._freeze("ref", self._lm(init.get("sft")))
            self._freeze("reward", self._value_model(init.get("rm")))
            if not init.get("sft"):
                self._notes.append("actor and reference start from random base weights (no SFT checkpoint)")
        clip = self.spec.grad_clip_or(self.options.grad_clip) or "off"
        self._notes.append(f"layout: {self.layout_name}; torch AdamW (betas {tuple(self.options.betas)}, weight "
                           f"decay {self.options.weight_decay}), gradient clipping {clip}")
