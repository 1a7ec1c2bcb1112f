"""Trlx's models per stage on accelerate (AccelerateSFTTrainer, the summarize_rlhf RM, AcceleratePPOTrainer).

SFT: a causal LM (peft LoRA optional). RM: GPTRewardModel with the bottom 70 % of its blocks frozen, as
the example. PPO: ONE trainable model, the causal LM with a value head on the shared trunk, one
optimizer; the reference is the hydra branch, the peft-disabled model, or a whole frozen fp32 copy outside
accelerate; the reward is a function on rank 0 (here the RM-stage model in the run's precision, on its
own device if `reward_device` names one). Every model is left in eval mode, as `from_pretrained` returns
it: trlx switches to train mode only around backward.
"""

from __future__ import annotations

import torch

from adapters.lora_targets import peft_targets, suffixes
from adapters.state_bytes import tensor_bytes
from adapters.trlx import schedule
from adapters.trlx.models import GPTRewardModel, PolicyWithValueHead, freeze_bottom_layers, freeze_reward_backbone
from bench.measure.params import ParamCounts
from bench.run.models import TORCH_DTYPES, build_backbone, build_causal_lm, count_params, decoder_blocks


class Engines:
    """Building half of TrlxAdapter (a mixin)."""

    def _lm(self, checkpoint: str | None) -> torch.nn.Module:
        torch.manual_seed(self.spec.seed)
        model = build_causal_lm(self.spec.model)
        if checkpoint:
            model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True))
        return model.eval()

    def _peft(self, model: torch.nn.Module, task_type: str | None = "CAUSAL_LM") -> torch.nn.Module:
        """peft LoRA with peft's per-architecture target modules (GPT-2: c_attn; Llama-style: q_proj, v_proj),
        as trlx's peft_config; the common lora_targets / lora_alpha fill the peft_config's target_modules /
        lora_alpha."""
        from peft import LoraConfig, get_peft_model

        arch = self.spec.model.arch
        targets = peft_targets(self.spec.lora_target_set, arch)
        config = LoraConfig(r=self.spec.lora, lora_alpha=self.spec.lora_alpha_or(self.options.lora.alpha),
                            lora_dropout=self.options.lora.dropout, task_type=task_type,
                            target_modules=suffixes(targets, arch))
        return get_peft_model(model, config)

    def _prepare(self, role: str, model: torch.nn.Module, lr: float) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lr, betas=tuple(self.options.betas), eps=self.options.eps,
                                      weight_decay=self.options.weight_decay)
        if self.spec.grad_ckpt:
            target = model.base_model if isinstance(model, PolicyWithValueHead) else model
            target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self._notes.append("gradient checkpointing: a harness extension (trlx's trainers have no such knob)")
        stage = {"actor": "sft" if self._stage == "sft" else "ppo", "reward": "rm"}[role]
        scheduler = schedule.build_scheduler(stage, optimizer, lr, self.options.scheduler_t_max,
                                             self.options.scheduler_eta_min, self.options.rm_warmup_steps,
                                             self.spec.steps[stage])
        if stage == "rm":  # HF's Trainer steps its own scheduler once per optimizer step
            self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
            self.accelerator.register_for_checkpointing(scheduler)
            self.scheduler = scheduler
        else:  # trlx prepares it: accelerate steps it with the optimizer (DeepSpeed's engine, at ZeRO > 0)
            self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        self.model.eval()
        self.role = role

    def setup(self, stage: str, init: dict[str, str]) -> None:
        self._stage = stage
        if stage == "sft":
            model = self._lm(init.get("sft"))
            if self.spec.lora:
                model = self._peft(model)
            self._counts["actor"] = count_params(model)
            lr = self.spec.lr if self.spec.lr is not None else self.spec.stage_lr("sft")
            self._prepare("actor", model, lr)
        elif stage == "rm":
            model = self._reward_model(init.get("rm"))
            freeze_reward_backbone(model, self.options.rm_unfrozen_fraction)
            if self.spec.lora:  # the backbone gets LoRA; the v_head trains fully
                model.transformer = self._peft(model.transformer, task_type=None)
            self._counts["reward"] = count_params(model)
            self._prepare("reward", model, self.spec.stage_lr("rm"))
            self.model.train()  # the example trains its RM with HF's Trainer: train mode throughout
            if self.deepspeed and self.spec.grad_accum > 1:  # the Trainer hands its accumulation to DeepSpeed
                self.model.set_train_batch_size(self.spec.batch * self.ctx.world_size * self.spec.grad_accum)
            frozen = sum(not p.requires_grad for p in decoder_blocks(model.transformer).parameters())
            self._notes.append(f"RM: rm_unfrozen_fraction={self.options.rm_unfrozen_fraction} leaves {frozen} block "
                               "tensors frozen (train_reward_model_gptj.py freezes the first 70 % of the blocks)")
        else:
            self._setup_ppo(init)
        self._notes.append(f"optimizer: torch AdamW (betas {tuple(self.options.betas)}, eps {self.options.eps}, "
                           f"weight decay {self.options.weight_decay})")

    def _reward_model(self, checkpoint: str | None) -> GPTRewardModel:
        torch.manual_seed(self.spec.seed)
        model = GPTRewardModel(build_backbone(self.spec.model), self.spec.model.hidden)
        if checkpoint:
            model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True))
        return model

    @property
    def reward_device(self) -> torch.device:
        return torch.device(self.options.reward_device) if self.options.reward_device else self.ctx.device

    def _setup_ppo(self, init: dict[str, str]) -> None:
        mode = self.options.reference_mode(self.spec.lora)
        lm = self._lm(init.get("sft"))
        hydra_layers = 0
        if mode == "peft":
            lm = self._peft(lm)
        elif mode == "hydra":
            hydra_layers = self.options.num_layers_unfrozen
            freeze_bottom_layers(lm, hydra_layers)
        policy = PolicyWithValueHead(lm, self.spec.model.hidden, hydra_layers)
        # Each module is counted where it runs: the hydra branch only in the reference's forward.
        whole = count_params(policy)
        branch = count_params(policy.frozen_head) if policy.frozen_head is not None else ParamCounts(0, 0, 0, 0)
        self._counts["actor"] = ParamCounts(total=whole.total, trainable=whole.trainable,
                                            compute=whole.compute - branch.compute,
                                            compute_trainable=whole.compute_trainable)
        trunk = self._counts["actor"].compute
        if mode == "full":
            # trlx builds a second whole model, moves it to the device and never wraps it: no ZeRO, no offload.
            self.ref_model = self._lm(init.get("sft")).to(self.ctx.device).eval().requires_grad_(False)
            self._counts["ref"] = count_params(self.ref_model)
        elif mode == "hydra":  # extra weights: the branch; work: forward_hydra re-runs the trunk, then the branch
            self._counts["ref"] = ParamCounts(total=branch.total, trainable=0, compute=trunk + branch.compute)
        else:  # no extra weights; the trunk runs again with adapters disabled
            self._counts["ref"] = ParamCounts(total=0, trainable=0, compute=trunk)
        with torch.device("meta"):  # every rank counts the reward model; only rank 0 holds it
            self._counts["reward"] = count_params(self._reward_model(None))
        self._notes.append(self._reference_note(mode, policy))
        self._prepare("actor", policy, self.spec.stage_lr("actor"))
        if self.spec.reference.quant != "none":
            self._quantize_reference(mode)
        if self.ctx.rank == 0:  # trlx's reward_fn runs on the main process only
            dtype = TORCH_DTYPES[self.spec.precision]
            self.reward_model = self._reward_model(init.get("rm")).to(self.reward_device, dtype).eval()
            self.reward_model.requires_grad_(False)
            if self.spec.reward.quant != "none":
                from adapters.quantize import quantize_reward

                reward = self.reward_model
                self.quantized["reward"] = quantize_reward(self.spec, reward, self.reward_device,
                                                           lambda ids, mask: reward.end_scores(ids, mask))
                self._notes.append(f"reward: {self.quantized['reward'].mode} weights "
                                   f"({self.quantized['reward'].library}; a harness extension)")
        self._notes.append(
            f"reward: the RM-stage model as trlx's reward_fn, on rank 0 only ({self.spec.precision}, on "
            f"{self.options.reward_device or 'the training device'}, micro-batches of "
            f"{self.options.reward_batch_size}; scores scattered); its FLOPs are booked to each rank for its "
            "own samples")
        self._notes.append("critic: the policy trunk plus a fresh fp32 value head (h -> 2h -> 1); joint loss, "
                           "one optimizer")
        if not init.get("sft"):
            self._notes.append("policy and reference start from random base weights (no SFT checkpoint)")

    def _quantize_reference(self, mode: str) -> None:
        """reference.quant: the hydra branch (its blocks and untied LM head, after accelerate prepared the policy:
        the engine casts and wraps fp16/bf16 weights, and leaves frozen ones alone from then on) or the whole
        frozen copy. The peft reference is the policy itself (refused in the adapter)."""
        from adapters.quantize import quantize_reference

        if mode == "full":
            ref = self.ref_model
            target, logits = ref, lambda ids, mask: ref(input_ids=ids, attention_mask=mask).logits
        else:
            target, logits = self._unwrapped.frozen_head, lambda ids, mask: self.model(ids, mask, reference=True)
        self.quantized["ref"] = quantize_reference(self.spec, target, self.ctx.device, logits)
        self._notes.append(f"ref: the {'hydra branch' if mode == 'hydra' else 'frozen copy'} in "
                           f"{self.quantized['ref'].mode} ({self.quantized['ref'].library}; a harness extension)")

    def _reference_note(self, mode: str, policy: PolicyWithValueHead) -> str:
        if mode == "hydra":
            branch = sum(tensor_bytes(p) for p in policy.frozen_head.parameters())
            return (f"reference: hydra branch of the top {self.options.num_layers_unfrozen} blocks + final norm + "
                    f"LM head ({branch:,} bytes); lower blocks and input embeddings frozen and shared, the "
                    "position table trains (as freeze_bottom_causal_layers leaves it)")
        if mode == "peft":
            return "reference: the policy with its LoRA adapters disabled (no copy)"
        return ("reference: a whole frozen fp32 copy on every rank outside accelerate/DeepSpeed (trlx's intended "
                "num_layers_unfrozen=-1 path; at trlx HEAD this path looks broken, see the reference notes)")
