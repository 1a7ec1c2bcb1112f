"""DS-Chat's models and engines per step (dschat/rlhf/rlhf_engine.py, dschat/utils/ds_utils.py).

Step 1: one engine over a causal LM. Step 2: one engine over RewardModel. Step 3 (DeepSpeedRLHFEngine):
actor and critic train (own optimizers); reference and reward are eval-only (no optimizer) and run
ZeRO-3 only when actor/critic do. Actor and reference start from the step-1 checkpoint, critic and
reward from the step-2 one. The actor gets `--actor_dropout` (0.0 in every script) and the `lora` rank;
the critic keeps the model's dropout unless `critic_dropout` is set and has its own LoRA rank
(`critic_lora_dim`, 0 by default as upstream).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from adapters.comm_knobs import deepspeed_comm
from adapters.dschat import ds_config, fp16_zero0, hybrid_engine, schedule
from adapters.dschat.lora import UPSTREAM_LORA_SCALING, convert_to_lora, only_optimize_lora
from adapters.dschat.options import lora_module_names, pad_is_eos
from adapters.dschat.reward_model import RewardModel
from bench.run.models import build_backbone, build_causal_lm, set_dropout
from bench.run.spec import UnsupportedError

# get_optimizer_grouped_parameters' no_decay_name_list, matched against lower-cased names (GPT-2's ln_1 and
# ln_2 weights match none of them and decay, as upstream; Llama's norms all match)
_NO_DECAY = ("bias", "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight")
_UNSHARDED = {"zero_optimization": {"stage": 0}}  # what _zero3 and _load read: build a model whole


class QuantizedEngine:
    """Where DS-Chat holds an eval engine, a quantized frozen role: its module, and what the adapter reads of an
    engine (no optimizer; forward, forward_value, eval/train pass through)."""

    optimizer = None

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def forward_value(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.forward_value(*args, **kwargs)

    def eval(self) -> QuantizedEngine:
        self.module.eval()
        return self

    def train(self, mode: bool = True) -> QuantizedEngine:
        self.module.train(mode)
        return self


class Engines:
    """Building half of DSChatAdapter (a mixin: the adapter holds spec, ctx, options, engines, ds)."""

    def _zero3(self, config: dict[str, Any]):
        if config["zero_optimization"]["stage"] == 3:
            return self.ds.zero.Init(config_dict_or_path=config)
        return nullcontext()

    def _load(self, model: torch.nn.Module, path: str, config: dict[str, Any]) -> None:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if config["zero_optimization"]["stage"] == 3:
            with self.ds.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
                if self.ctx.rank == 0:
                    model.load_state_dict(state)
        else:
            model.load_state_dict(state)

    def _build_lm(self, config: dict[str, Any], checkpoint: str | None, dropout: float | None = None
                  ) -> torch.nn.Module:
        torch.manual_seed(self.spec.seed)  # every role starts from the same "pretrained" base weights
        with self._zero3(config):
            model = build_causal_lm(self.spec.model)
        if checkpoint:
            self._load(model, checkpoint, config)
        if dropout is not None:
            set_dropout(model, dropout)
        return model

    def _build_reward_model(self, config: dict[str, Any], checkpoint: str | None, dropout: float | None = None
                            ) -> torch.nn.Module:
        torch.manual_seed(self.spec.seed)
        with self._zero3(config):
            base = build_backbone(self.spec.model)
            model = RewardModel(base, base.config.hidden_size, self.options.compute_fp32_loss,
                                pad_is_eos(self.spec.model.arch))
        if checkpoint:
            self._load(model, checkpoint, config)
        if dropout is not None:
            set_dropout(model, dropout)
        return model

    def _apply_lora(self, model: torch.nn.Module, config: dict[str, Any], rank: int,
                    keep_trainable: tuple[str, ...]) -> None:
        if not rank:
            return
        names = lora_module_names(self.spec.lora_target_set, self.options.module_name(self.spec.model.arch),
                                  self.spec.model.arch)
        with self._zero3(config):
            converted = convert_to_lora(model, names, rank, self.spec.lora_alpha_or(UPSTREAM_LORA_SCALING))
        if converted == 0:
            raise ValueError(
                f"framework.lora_module_name={names!r} matches no linear layer: LoRA "
                "would change nothing (and with only_optimize_lora nothing would train, DS#3339)"
            )
        if self.options.only_optimize_lora:
            only_optimize_lora(model, keep_trainable)

    def _optimizer(self, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
        decay, no_decay, lora = [], [], []
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            lowered = name.lower()
            if any(key in lowered for key in _NO_DECAY):
                no_decay.append(param)
            elif "lora_right_weight" in lowered or "lora_left_weight" in lowered:
                lora.append(param)
            else:
                decay.append(param)
        groups = [  # upstream's order and weight decay: LoRA factors decay like the weights they adapt
            {"params": decay, "weight_decay": self.options.weight_decay},
            {"params": lora, "weight_decay": self.options.weight_decay, "lr": self.options.lora_lr},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        betas = tuple(self.options.betas)
        if self.options.optimizer == "torch_adamw":
            return torch.optim.AdamW(groups, lr=lr, betas=betas)
        if self.spec.offload:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(groups, lr=lr, betas=betas)
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(groups, lr=lr, betas=betas)

    def _train_config(self, hybrid_engine: bool = False, stage: int | None = None) -> dict[str, Any]:
        # upstream's get_train_ds_config always overlaps (it runs on GPUs); a device without streams cannot
        overlap = self.ctx.device.type == "cuda"
        return ds_config.train_config(self.spec, self.options, self.ctx.world_size, overlap, hybrid_engine,
                                      deepspeed_comm(self.spec, self.ctx.device), stage)

    def _train_engine(self, model: torch.nn.Module, lr: float, config: dict[str, Any], grad_ckpt: bool,
                      stage: str):
        if grad_ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        optimizer = self._optimizer(model, lr)
        total = self.spec.steps[stage] * (self.options.ppo.ppo_epochs if stage == "ppo" else 1)
        warmup = schedule.warmup_steps(stage, self.options.num_warmup_steps[stage], total)
        scheduler = schedule.build_scheduler(optimizer, self.options.lr_scheduler_type, warmup, total)
        engine, *_ = self.ds.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
        note = f"LR schedule: {self.options.lr_scheduler_type}, {warmup} warm-up of {total} optimizer steps"
        if note not in self._notes:
            self._notes.append(note)
        return engine

    def _watch_fp16_defect(self, role: str) -> None:
        if fp16_zero0.affected(self.engines[role]):
            self._unscaled[role] = fp16_zero0.ClipWatch(self.engines[role].optimizer)

    def _eval_engine(self, model: torch.nn.Module, config: dict[str, Any]):
        engine, *_ = self.ds.initialize(model=model, config=config)
        engine.eval()
        return engine

    def _quantized(self, role: str, model: torch.nn.Module) -> QuantizedEngine:
        """A frozen role in 8 or 4 bits (reference.quant, reward.quant): built whole, in the run's precision on
        the device, quantized, and kept outside DeepSpeed (its engines take no bitsandbytes weights)."""
        from adapters.quantize import quantize_frozen_model

        self.quantized[role] = quantize_frozen_model(self.spec, role, model, self.ctx.device, lambda ids, mask: (
            model.forward_value(ids, mask, self.spec.prompt_len)["chosen_end_scores"]))
        self._notes.append(f"{role}: {self.quantized[role].mode} weights ({self.quantized[role].library}), outside "
                           "DeepSpeed, whole on every rank (a harness extension)")
        return QuantizedEngine(model)

    def setup(self, stage: str, init: dict[str, str]) -> None:
        if stage == "sft":
            config = self._train_config()
            model = self._build_lm(config, init.get("sft"))
            self._apply_lora(model, config, self.spec.lora, ())
            self.engines["actor"] = self._train_engine(model, self.spec.stage_lr("sft"), config, self.spec.grad_ckpt,
                                                       "sft")
            self._watch_fp16_defect("actor")
        elif stage == "rm":
            config = self._train_config()
            model = self._build_reward_model(config, init.get("rm"))
            self._apply_lora(model, config, self.spec.lora, ("v_head",))  # DS-Chat PR #758: the RM head trains
            self.engines["reward"] = self._train_engine(model, self.spec.stage_lr("rm"), config, self.spec.grad_ckpt,
                                                        "rm")
            self._watch_fp16_defect("reward")
        else:
            self._setup_ppo(init)
            self._watch_fp16_defect("actor")
            self._watch_fp16_defect("critic")
        self._notes.append(self._optimizer_note())
        if self._unscaled:
            fixed = self.options.fix_fp16_zero0_loss_scale
            self._notes.append(f"upstream defect {fp16_zero0.DEFECT_ID}: " + fp16_zero0.record_entry(fixed)["handling"])

    def _setup_ppo(self, init: dict[str, str]) -> None:
        hybrid = self.options.hybrid_engine
        if hybrid and self.ctx.device.type != "cuda":
            # DeepSpeed's CPU accelerator has no inference kernels: a layer with an injection policy
            # (GPT-2 has one) fails in initialize. With no policies the HE keeps its control flow
            # (eval -> generate -> train) around the model's native generate().
            import deepspeed.runtime.hybrid_engine as deepspeed_hybrid_engine

            deepspeed_hybrid_engine.replace_policies = []
        actor_config = self._train_config(hybrid_engine=hybrid)
        actor = self._build_lm(actor_config, init.get("sft"), self.options.actor_dropout)
        if hybrid and self.ctx.device.type == "cuda":
            refusal = hybrid_engine.refusal(actor)
            if refusal:
                raise UnsupportedError(refusal)
        self._apply_lora(actor, actor_config, self.spec.lora, ())
        # DS-Chat checkpoints the actor only during its update (see ppo_train), not during generation.
        self.engines["actor"] = self._train_engine(actor, self.spec.stage_lr("actor"), actor_config, False, "ppo")
        if hybrid:
            containers = len(getattr(self.engines["actor"], "_inference_containers", []))
            kernels = "inference kernels in use" if containers else "no inference kernels: native HF generate()"
            where = "" if self.ctx.device.type == "cuda" else " (CPU: DeepSpeed implements no inference ops)"
            self._notes.append(f"hybrid engine: {containers} inference containers, {kernels}{where}")

        ref_config = ds_config.eval_config(self.spec, self.options, self.ctx.world_size)
        if self.spec.reference.quant != "none":
            self.engines["ref"] = self._quantized("ref", self._build_lm(_UNSHARDED, init.get("sft")))
        else:
            self.engines["ref"] = self._eval_engine(self._build_lm(ref_config, init.get("sft")), ref_config)

        critic_stage = self.options.critic_stage(self.spec.zero)
        critic_config = self._train_config(stage=critic_stage)
        reward_config = ds_config.eval_config(self.spec, self.options, self.ctx.world_size, critic_stage)
        critic = self._build_reward_model(critic_config, init.get("rm"), self.options.critic_dropout)
        self._apply_lora(critic, critic_config, self.options.critic_lora_dim, ())
        # DS-Chat enables critic checkpointing once, at init.
        self.engines["critic"] = self._train_engine(
            critic, self.spec.stage_lr("critic"), critic_config,
            self.options.critic_checkpointing(self.spec.grad_ckpt), "ppo"
        )
        if self.spec.reward.quant != "none":
            reward = self._build_reward_model(_UNSHARDED, init.get("rm"), self.options.critic_dropout)
            self.engines["reward"] = self._quantized("reward", reward)
        else:
            reward = self._build_reward_model(reward_config, init.get("rm"), self.options.critic_dropout)
            self.engines["reward"] = self._eval_engine(reward, reward_config)
        if not init.get("sft"):
            self._notes.append("actor and reference start from random base weights (no SFT checkpoint)")
        if self.spec.model.arch == "llama" and self.options.ppo.do_sample:
            self._notes.append("generation: greedy (DS-Chat's _generate_sequence forces do_sample=False for "
                               "model_type llama)")
        self._notes.append(f"dropout: actor {self.options.actor_dropout}, critic "
                           f"{self._dropout_note(self.options.critic_dropout)} (train mode during experience, as "
                           f"upstream); LoRA rank: actor {self.spec.lora}, critic {self.options.critic_lora_dim}")

    def _dropout_note(self, value: float | None) -> str:
        return f"the model's {self.spec.model.dropout}" if value is None else str(value)

    def _optimizer_note(self) -> str:
        if self.options.optimizer == "torch_adamw":
            return "optimizer: torch AdamW inside the DeepSpeed engine (DS-Chat uses FusedAdam/DeepSpeedCPUAdam)"
        name = "DeepSpeedCPUAdam" if self.spec.offload else "FusedAdam"
        where = " (DeepSpeed's JIT-built CPU implementation)" if self.ctx.device.type == "cpu" else ""
        return f"optimizer: {name}{where}, as DS-Chat"
