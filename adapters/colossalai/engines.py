"""ColossalChat's models, plugins and boosters per stage (train_sft.py, train_rm.py, train_ppo.py).

PPO: four separate models as train_ppo.py builds them -- actor and critic each with their own HybridAdam
and booster, reference and reward boosted without an optimizer (shuttled to the host for the update and
back for rollout when `offload_inference_models`); under 3d the critic and reward use a second plugin
whose policy is the backbone's. Dropout is disabled in actor and critic, as train_ppo.py does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from adapters.colossalai import schedule
from adapters.colossalai.lora import convert_to_lora
from adapters.colossalai.models import Critic, RewardModel
from adapters.colossalai.options import bucket_in_mi
from adapters.comm_knobs import deepspeed_comm
from adapters.lora_targets import suffixes
from bench.run.models import backbone_prefix, build_backbone, build_causal_lm, count_params, set_dropout


class Engines:
    """Building half of ColossalAdapter (a mixin)."""

    def _make_plugin(self, custom_policy: Any = None):
        from colossalai.booster import plugin as plugins

        kwargs = dict(self.plugin.kwargs)
        if self.plugin.cls != "TorchDDPPlugin":
            kwargs.update(precision=self.spec.precision, initial_scale=self.options.initial_scale,
                          max_norm=self.spec.grad_clip_or(self.options.grad_clip))
        if self.plugin.cls in ("LowLevelZeroPlugin", "HybridParallelPlugin"):
            comm = deepspeed_comm(self.spec, self.ctx.device)  # refuses overlap on a device without streams
            if self.ctx.device.type == "cpu":  # overlapping records CUDA streams on buffers; CPU tensors reject it
                kwargs["overlap_communication"] = False
            if "overlap_comm" in comm:
                kwargs["overlap_communication"] = comm["overlap_comm"]
            if "reduce_bucket_size" in comm:  # coati counts its bucket in Mi values
                low_level = self.plugin.cls == "LowLevelZeroPlugin"
                bucket = "reduce_bucket_size_in_m" if low_level else "zero_bucket_size_in_m"
                kwargs[bucket] = bucket_in_mi(comm["reduce_bucket_size"])
        if custom_policy is not None:
            kwargs["custom_policy"] = custom_policy
        return getattr(plugins, self.plugin.cls)(**kwargs)

    def _optimizer(self, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        betas = tuple(self.options.betas)
        if self.options.optimizer == "torch_adamw":
            return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=self.options.weight_decay)
        from colossalai.nn.optimizer import HybridAdam

        return HybridAdam(params, lr=lr, betas=betas, weight_decay=self.options.weight_decay, adamw_mode=True)

    def _lm(self, checkpoint: str | None) -> torch.nn.Module:
        torch.manual_seed(self.spec.seed)  # every role starts from the same "pretrained" base weights
        model = build_causal_lm(self.spec.model)
        if checkpoint:
            model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True))
        return model

    def _value_model(self, cls: type, checkpoint: str | None, backbone_from_lm: str | None = None):
        torch.manual_seed(self.spec.seed)
        model = cls(build_backbone(self.spec.model))
        if checkpoint:
            model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True))
        elif backbone_from_lm:
            state = torch.load(backbone_from_lm, map_location="cpu", weights_only=True)
            prefix = backbone_prefix(self.spec.model) + "."
            model.model.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        return model

    def _lora(self, model: torch.nn.Module) -> None:
        if not self.spec.lora:
            return
        targets = self.spec.lora_target_set
        options = replace(self.options.lora, alpha=self.spec.lora_alpha_or(self.options.lora.alpha))
        if targets is not None:  # LoraConfig.target_modules: matched by coati's own rule (lora.matched_layers)
            convert_to_lora(model, self.spec.lora, options, target_modules=suffixes(targets, self.spec.model.arch))
        elif self.plugin.cls == "HybridParallelPlugin":
            # Shardformer swaps the embeddings and LM head for its padded versions and cannot swap a
            # LoRA-wrapped one ("Failed to replace wte of type LoraEmbedding"; coati users hit the same, #5507).
            convert_to_lora(model, self.spec.lora, options, embeddings=False, skip=("lm_head",))
            note = "LoRA under HybridParallelPlugin: every linear layer but the LM head; embeddings stay frozen"
            if note not in self._notes:
                self._notes.append(note)
        else:
            convert_to_lora(model, self.spec.lora, options)

    def _boost(self, role: str, model: torch.nn.Module, lr: float | None, plugin: Any, stage: str = "") -> None:
        """Boost a model; a trained one (`lr` given) with its optimizer and the stage's LR schedule."""
        self._counts[role] = count_params(model)
        optimizer = scheduler = None
        if lr is not None:
            optimizer = self._optimizer(model, lr)
            total = self.spec.steps[stage] if stage != "ppo" else self.options.ppo_optimizer_steps(self.spec)
            warmup = schedule.warmup_steps(self.options.warmup_steps, total)
            # train_ppo.py's critic scheduler takes eta_min = 0.1 x args.lr, the actor's rate
            main = self.spec.stage_lr("actor") if role == "critic" else lr
            scheduler = schedule.build_scheduler(optimizer, warmup, total, schedule.floor_share(lr, main))
            note = (f"LR schedule: CosineAnnealingWarmupLR, {warmup} warm-up of {total} steps, eta_min 0.1 x lr "
                    "(the critic's too: 0.1 x the actor's lr, as train_ppo.py)")
            if note not in self._notes:
                self._notes.append(note)
        booster = self._booster_cls(plugin=plugin)
        model, optimizer, _, _, scheduler = booster.boost(model=model, optimizer=optimizer, lr_scheduler=scheduler)
        self.models[role], self.boosters[role] = model, booster
        if optimizer is not None:
            self.optimizers[role] = optimizer
            self.schedulers[role] = scheduler
        else:
            model.eval()

    def _quantized(self, role: str, model: torch.nn.Module) -> None:
        """A frozen role in 8 or 4 bits (reference.quant, reward.quant): in the run's precision on the device,
        quantized, never boosted (no plugin shards or casts bitsandbytes weights) nor shuttled (small is its
        point)."""
        from adapters.quantize import quantize_frozen_model

        self._counts[role] = count_params(model)
        self.quantized[role] = quantize_frozen_model(self.spec, role, model, self.ctx.device, model)
        self.models[role] = model
        self._notes.append(f"{role}: {self.quantized[role].mode} weights ({self.quantized[role].library}), not "
                           "boosted: whole on every rank, never shuttled (a harness extension)")

    def _value_plugin(self, plugin: Any, value_model: torch.nn.Module) -> Any:
        """coati boosts value models under 3d with a second plugin whose policy is their backbone's, looked up
        on the model it has (train_rm.py `get_autopolicy(model.model)`, train_ppo.py
        `get_autopolicy(reward_model.model)`): no other model is built for it."""
        if self.plugin.cls != "HybridParallelPlugin":
            return plugin
        from colossalai.shardformer.policies.auto_policy import get_autopolicy

        return self._make_plugin(custom_policy=get_autopolicy(value_model.model))

    def setup(self, stage: str, init: dict[str, str]) -> None:
        plugin = self._plugin
        if stage == "sft":
            model = self._lm(init.get("sft"))
            self._lora(model)
            if self.spec.grad_ckpt:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self._boost("actor", model, self.spec.stage_lr("sft"), plugin, stage)
        elif stage == "rm":
            model = self._value_model(RewardModel, init.get("rm"))
            self._lora(model)
            if self.spec.grad_ckpt:
                model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self._boost("reward", model, self.spec.stage_lr("rm"), self._value_plugin(plugin, model), stage)
        else:
            self._setup_ppo(init, plugin)
        optimizer = "HybridAdam" if self.options.optimizer == "hybrid_adam" else "torch AdamW"
        self._notes.append(f"optimizer: {optimizer} (betas {tuple(self.options.betas)}, "
                           f"weight decay {self.options.weight_decay})")
        if self.plugin.cls == "TorchDDPPlugin":
            self._notes.append("no gradient clipping: ColossalChat's ddp path passes no max_norm")

    def _setup_ppo(self, init: dict[str, str], plugin: Any) -> None:
        actor = self._lm(init.get("sft"))
        critic_ckpt = init.get("rm") if self.options.critic_from_rm else None
        critic = self._value_model(Critic, critic_ckpt, backbone_from_lm=init.get("sft"))
        value_plugin = self._value_plugin(plugin, critic)
        self._lora(actor)
        self._lora(critic)
        set_dropout(actor, 0.0)  # train_ppo.py: disable_dropout(actor), disable_dropout(critic)
        set_dropout(critic, 0.0)
        if self.spec.grad_ckpt:
            actor.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            critic.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self._boost("actor", actor, self.spec.stage_lr("actor"), plugin, "ppo")
        self._boost("critic", critic, self.spec.stage_lr("critic"), value_plugin, "ppo")
        reward, ref = self._value_model(RewardModel, init.get("rm")), self._lm(init.get("sft"))
        for role, model, quant, role_plugin in (("reward", reward, self.spec.reward.quant, value_plugin),
                                                ("ref", ref, self.spec.reference.quant, plugin)):
            if quant == "none":
                self._boost(role, model, None, role_plugin)
            else:
                self._quantized(role, model)
        self.shuttles_models = (self.options.ppo.offload_inference_models and self.plugin.cls != "GeminiPlugin"
                                and bool(self._inference_models))
        if not init.get("sft"):
            self._notes.append("actor and reference start from random base weights (no SFT checkpoint)")
        source = "the RM checkpoint" if critic_ckpt else "the SFT backbone with a fresh value head"
        self._notes.append(f"critic starts from {source}")
        ppo = self.options.ppo
        self._notes.append(
            f"PPO: an episode per step: {ppo.num_collect_steps} rollouts into the host buffer, "
            f"{ppo.num_update_steps} update pass(es) over it in shuffled minibatches of "
            f"{self.options.train_batch_size(self.spec)} (train_ppo.sh: 1 pass; the argparse default 5); "
            "positions skip left padding in every forward; the RM scores the stop token and the critic uses the "
            "rollout's layout for old and new values (coati: one pad late, and misaligned by prompt padding)"
        )
