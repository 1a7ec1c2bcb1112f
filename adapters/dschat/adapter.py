"""DeepSpeed-Chat's three steps on the real deepspeed engine.

Step 1 (SFT): one engine over a causal LM. Step 2 (RM): one engine over RewardModel. Step 3 (PPO):
DeepSpeedRLHFEngine's four engines -- actor and critic train (own optimizers), reference and reward are
eval-only (no optimizer); reference/reward run ZeRO-3 only when actor/critic do, otherwise they are
unsharded replicas; critic and reward both start from the step-2 checkpoint, actor and reference from
the step-1 checkpoint. The PPO arithmetic follows DeepSpeedPPOTrainer (per-token KL penalty, end-token
score clipped to +-5, GAE, clipped policy and value losses; actor steps before the critic's forward).
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any

import torch

from adapters.base import Adapter, Experience, ModelState, RankContext, Rollout, TrainOutput
from adapters.deepspeed_cpu import allow_fp16
from adapters.dschat import ds_config, fp16_zero0
from adapters.dschat.lora import convert_to_lora, fused_state_dict, only_optimize_lora
from adapters.dschat.options import DSChatOptions
from adapters.dschat.reward_model import RewardModel
from adapters.rl_math import gae, gather_log_probs, masked_mean, policy_loss, position_ids, value_loss
from adapters.state_bytes import model_state, tensor_bytes
from bench.data import EOS, PAD, PreferenceBatch, PromptBatch, SFTBatch
from bench.models import ParamCounts, build_causal_lm, count_params, gpt2_config
from bench.spec import RunSpec

_NO_DECAY = ("bias", "ln_", "LayerNorm.weight", "layer_norm.weight")


class DSChatAdapter(Adapter):
    def __init__(self, spec: RunSpec, ctx: RankContext) -> None:
        super().__init__(spec, ctx)
        if ctx.device.type == "cpu":  # skip DeepSpeed's accelerator probing and its warning
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        self.ds = deepspeed
        self.options = DSChatOptions.validate(spec)
        self.engines: dict[str, Any] = {}
        self._notes: list[str] = []
        self._unscaled: dict[str, fp16_zero0.ClipWatch] = {}  # roles hit by the fp16 ZeRO-0 defect
        deepspeed.init_distributed()
        fp16_note = allow_fp16(ctx.device, spec.precision)
        if fp16_note:
            self._notes.append(fp16_note)
        # The optimizer's JIT op is built and loaded now, inside the measured `imports` phase.
        if self.options.optimizer == "fused_adam":
            from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder

            (CPUAdamBuilder if spec.offload else FusedAdamBuilder)().load()

    # ----------------------------------------------------------------- building
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

    def _build_lm(self, config: dict[str, Any], checkpoint: str | None) -> torch.nn.Module:
        torch.manual_seed(self.spec.seed)  # every role starts from the same "pretrained" base weights
        with self._zero3(config):
            model = build_causal_lm(self.spec.model)
        if checkpoint:
            self._load(model, checkpoint, config)
        return model

    def _build_reward_model(self, config: dict[str, Any], checkpoint: str | None) -> torch.nn.Module:
        from transformers import AutoModel, GPT2Model

        torch.manual_seed(self.spec.seed)
        with self._zero3(config):
            if self.spec.model.path:
                base = AutoModel.from_pretrained(self.spec.model.path, local_files_only=True)
            else:
                base = GPT2Model(gpt2_config(self.spec.model))
            model = RewardModel(base, base.config.hidden_size)
        if checkpoint:
            self._load(model, checkpoint, config)
        return model

    def _apply_lora(self, model: torch.nn.Module, config: dict[str, Any], keep_trainable: tuple[str, ...]) -> None:
        if not self.spec.lora:
            return
        with self._zero3(config):
            converted = convert_to_lora(model, self.options.lora_module_name, self.spec.lora)
        if converted == 0:
            raise ValueError(
                f"framework.lora_module_name={self.options.lora_module_name!r} matches no linear layer; "
                "with only_optimize_lora nothing would train (DS#3339)"
            )
        if self.options.only_optimize_lora:
            only_optimize_lora(model, keep_trainable)

    def _optimizer(self, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
        decay, no_decay, lora = [], [], []
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            if "lora_right_weight" in name or "lora_left_weight" in name:
                lora.append(param)
            elif any(key in name for key in _NO_DECAY):
                no_decay.append(param)
            else:
                decay.append(param)
        groups = [
            {"params": decay, "weight_decay": self.options.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
            {"params": lora, "weight_decay": 0.0, "lr": self.options.lora_lr},
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

    def _train_config(self, hybrid_engine: bool = False) -> dict[str, Any]:
        # Overlapping reduction with backward needs device streams; CPU (gloo) has none.
        overlap = self.ctx.device.type == "cuda"
        return ds_config.train_config(self.spec, self.options, self.ctx.world_size, overlap, hybrid_engine)

    def _train_engine(self, model: torch.nn.Module, lr: float, config: dict[str, Any], grad_ckpt: bool):
        if grad_ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        engine, *_ = self.ds.initialize(model=model, optimizer=self._optimizer(model, lr), config=config)
        return engine

    def _watch_fp16_defect(self, role: str) -> None:
        if fp16_zero0.affected(self.engines[role]):
            self._unscaled[role] = fp16_zero0.ClipWatch(self.engines[role].optimizer)

    def _eval_engine(self, model: torch.nn.Module):
        config = ds_config.eval_config(self.spec, self.options, self.ctx.world_size)
        engine, *_ = self.ds.initialize(model=model, config=config)
        engine.eval()
        return engine

    def setup(self, stage: str, init: dict[str, str]) -> None:
        if stage == "sft":
            config = self._train_config()
            model = self._build_lm(config, init.get("sft"))
            self._apply_lora(model, config, ())
            self.engines["actor"] = self._train_engine(model, self.spec.stage_lr("sft"), config, self.spec.grad_ckpt)
            self._watch_fp16_defect("actor")
        elif stage == "rm":
            config = self._train_config()
            model = self._build_reward_model(config, init.get("rm"))
            self._apply_lora(model, config, ("v_head",))  # DS-Chat PR #758: the RM head always trains
            self.engines["reward"] = self._train_engine(model, self.spec.stage_lr("rm"), config, self.spec.grad_ckpt)
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
            import deepspeed.runtime.hybrid_engine as hybrid_engine

            hybrid_engine.replace_policies = []
        actor_config = self._train_config(hybrid_engine=hybrid)
        actor = self._build_lm(actor_config, init.get("sft"))
        self._apply_lora(actor, actor_config, ())
        # DS-Chat checkpoints the actor only during its update (see ppo_train), not during generation.
        self.engines["actor"] = self._train_engine(actor, self.spec.stage_lr("actor"), actor_config, False)
        if hybrid:
            containers = len(getattr(self.engines["actor"], "_inference_containers", []))
            kernels = "inference kernels in use" if containers else "no inference kernels: native HF generate()"
            where = "" if self.ctx.device.type == "cuda" else " (CPU: DeepSpeed implements no inference ops)"
            self._notes.append(f"hybrid engine: {containers} inference containers, {kernels}{where}")

        eval_config = ds_config.eval_config(self.spec, self.options, self.ctx.world_size)
        self.engines["ref"] = self._eval_engine(self._build_lm(eval_config, init.get("sft")))

        critic_config = self._train_config()
        critic = self._build_reward_model(critic_config, init.get("rm"))
        self._apply_lora(critic, critic_config, ())
        # DS-Chat enables critic checkpointing once, at init.
        self.engines["critic"] = self._train_engine(
            critic, self.spec.stage_lr("critic"), critic_config, self.spec.grad_ckpt
        )
        self.engines["reward"] = self._eval_engine(self._build_reward_model(eval_config, init.get("rm")))
        if not init.get("sft"):
            self._notes.append("actor and reference start from random base weights (no SFT checkpoint)")

    def _optimizer_note(self) -> str:
        if self.options.optimizer == "torch_adamw":
            return "optimizer: torch AdamW inside the DeepSpeed engine (DS-Chat uses FusedAdam/DeepSpeedCPUAdam)"
        name = "DeepSpeedCPUAdam" if self.spec.offload else "FusedAdam"
        where = " (DeepSpeed's JIT-built CPU implementation)" if self.ctx.device.type == "cpu" else ""
        return f"optimizer: {name}{where}, as DS-Chat"

    # ----------------------------------------------------------------- stepping
    @staticmethod
    def _loss_scale(engine) -> float | None:
        if not engine.fp16_enabled():
            return None
        optimizer = engine.optimizer
        scale = getattr(optimizer, "cur_scale", None)
        if scale is None:
            scale = getattr(optimizer, "loss_scale", None)
        return float(scale) if scale is not None else None

    def _backward_step(self, role: str, loss: torch.Tensor, out: TrainOutput) -> None:
        engine = self.engines[role]
        skipped_before = engine.skipped_steps
        scale = 1.0
        if role in self._unscaled and self.options.fix_fp16_zero0_loss_scale:
            scaled, scale = fp16_zero0.scaled_loss(loss, engine.optimizer)
            engine.backward(scaled)
        else:
            engine.backward(loss)
        # ZeRO-0 keeps whole gradients on the module, so the norm is measured there (unscaled); DeepSpeed's own
        # ZeRO-0 figure is missing for fp32 and, for fp16, off by the loss scale (see fp16_zero0).
        own_norm = _local_grad_norm(engine) if engine.zero_optimization_stage() == 0 else None
        if own_norm is not None:
            own_norm /= scale
        engine.step()
        engine_norm = engine.get_global_grad_norm()
        norm = own_norm if own_norm is not None else engine_norm
        out.record(role, float(loss.detach()), float(norm) if norm is not None else None,
                   engine.skipped_steps > skipped_before, self._loss_scale(engine))
        if own_norm is not None and engine_norm is not None:
            out.metrics[f"engine_grad_norm/{role}"] = float(engine_norm)
        if role in self._unscaled:
            coefficient = self._unscaled[role].take()
            if coefficient is not None:
                out.metrics[f"clip_coef/{role}"] = coefficient

    def sft_step(self, batch: SFTBatch) -> TrainOutput:
        actor = self.engines["actor"]
        device = self.ctx.device
        result = actor(
            input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
            labels=batch.labels.to(device), use_cache=False,
        )
        out = TrainOutput(losses={}, tokens=batch.real_tokens, samples=batch.input_ids.shape[0])
        self._backward_step("actor", result.loss, out)
        return out

    def _pair_inputs(self, batch: PreferenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.cat([batch.chosen_ids, batch.rejected_ids]).to(self.ctx.device)
        mask = torch.cat([batch.chosen_mask, batch.rejected_mask]).to(self.ctx.device)
        return ids, mask

    def rm_step(self, batch: PreferenceBatch) -> TrainOutput:
        result = self.engines["reward"](*self._pair_inputs(batch))
        out = TrainOutput(losses={}, tokens=batch.real_tokens, samples=batch.chosen_ids.shape[0])
        self._backward_step("reward", result["loss"], out)
        accuracy = (result["chosen_end_scores"] > result["rejected_end_scores"]).float().mean()
        out.metrics["accuracy"] = float(accuracy)
        return out

    @torch.no_grad()
    def rm_accuracy(self, batch: PreferenceBatch) -> float:
        engine = self.engines["reward"]
        engine.eval()
        result = engine(*self._pair_inputs(batch))
        engine.train()
        return float((result["chosen_end_scores"] > result["rejected_end_scores"]).float().mean())

    @torch.no_grad()
    def generate(self, batch: PromptBatch) -> Rollout:
        actor = self.engines["actor"]
        sampling: dict[str, Any] = {"do_sample": self.options.ppo.do_sample}
        if self.options.ppo.do_sample:
            sampling.update(top_k=self.options.ppo.top_k, temperature=self.options.ppo.temperature)
        actor.eval()  # the Hybrid Engine switches to its inference path here
        sequences = actor.module.generate(
            batch.input_ids.to(self.ctx.device),
            attention_mask=batch.attention_mask.to(self.ctx.device),
            max_length=self.spec.prompt_len + self.spec.answer_len,
            pad_token_id=PAD,
            eos_token_id=EOS,
            suppress_tokens=[PAD],  # a sampled pad id would read as padding inside the answer
            synced_gpus=self.spec.zero == 3 and self.ctx.world_size > 1,
            **sampling,
        )
        actor.train()
        mask = (sequences != PAD).long()
        prompt_len = batch.input_ids.shape[1]
        return Rollout(
            sequences=sequences,
            attention_mask=mask,
            prompt_len=prompt_len,
            prompt_tokens=int(mask[:, :prompt_len].sum()),
            generated_tokens=int(mask[:, prompt_len:].sum()),
        )

    def _logits(self, role: str, seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.engines[role](
            input_ids=seq, attention_mask=mask, position_ids=position_ids(mask), use_cache=False
        ).logits

    @torch.no_grad()
    def make_experience(self, rollout: Rollout) -> Experience:
        seq, mask = rollout.sequences, rollout.attention_mask
        log_probs = gather_log_probs(self._logits("actor", seq, mask)[:, :-1], seq[:, 1:])
        ref_log_probs = gather_log_probs(self._logits("ref", seq, mask)[:, :-1], seq[:, 1:])
        score = self.engines["reward"].forward_value(seq, mask)["chosen_end_scores"].float()
        values = self.engines["critic"].forward_value(seq, mask)["values"][:, :-1].float()
        start = rollout.prompt_len - 1
        action_mask = mask[:, 1:]
        payload = {
            "seq": seq, "mask": mask, "start": start, "log_probs": log_probs,
            "ref_log_probs": ref_log_probs, "score": score, "values": values,
        }
        return Experience(
            payload=payload,
            reward=float(score.mean()),
            kl=float(masked_mean((log_probs - ref_log_probs)[:, start:], action_mask[:, start:])),
            value=float(masked_mean(values[:, start:], action_mask[:, start:])),
            tokens=rollout.real_tokens,
            samples=rollout.samples,
        )

    def _rewards(self, p: dict[str, Any], action_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSpeedPPOTrainer.compute_rewards: -kl_ctl * (logp - logp_ref) per token, plus the score
        clipped to +-clip_reward_value on the last answer action. DS-Chat's pad id equals its EOS id,
        so its mask drops the EOS and its `+ 1` lands the score on the EOS action; with separate pad and
        EOS ids the same action is the last unmasked one, so `ends` here has no `+ 1`."""
        ppo = self.options.ppo
        rewards = -ppo.kl_ctl * (p["log_probs"] - p["ref_log_probs"])
        start = p["start"]
        ends = start + action_mask[:, start:].sum(1)
        clipped = p["score"].clamp(-ppo.clip_reward_value, ppo.clip_reward_value)
        for j in range(rewards.shape[0]):
            rewards[j, int(ends[j]) - 1] += clipped[j]
        return rewards, ends

    def ppo_train(self, experience: Experience) -> TrainOutput:
        p = experience.payload
        ppo = self.options.ppo
        seq, mask, start = p["seq"], p["mask"], p["start"]
        action_mask = mask[:, 1:]
        old_values = p["values"].clone()
        with torch.no_grad():
            rewards, ends = self._rewards(p, action_mask)
            for j in range(rewards.shape[0]):
                old_values[j, int(ends[j]):] = 0
                rewards[j, int(ends[j]):] = 0
            advantages, returns = gae(old_values, rewards, start, ppo.gamma, ppo.lam)
        actor, critic = self.engines["actor"], self.engines["critic"]
        if self.spec.grad_ckpt:  # DS-Chat checkpoints the actor only during its update
            actor.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        out = TrainOutput(losses={}, tokens=0, samples=0)
        for _ in range(ppo.ppo_epochs):
            log_probs = gather_log_probs(self._logits("actor", seq, mask)[:, :-1], seq[:, 1:])
            actor_loss = policy_loss(log_probs[:, start:], p["log_probs"][:, start:], advantages,
                                     action_mask[:, start:], ppo.cliprange)
            self._backward_step("actor", actor_loss, out)
            values = critic.forward_value(seq, mask)["values"][:, :-1].float()
            critic_loss = value_loss(values[:, start:], old_values[:, start:], returns,
                                     action_mask[:, start:], ppo.cliprange_value)
            self._backward_step("critic", critic_loss, out)
            out.tokens += experience.tokens
            out.samples += experience.samples
        if self.spec.grad_ckpt:
            actor.module.gradient_checkpointing_disable()
        return out

    # ----------------------------------------------------------------- state
    def save(self, stage: str, directory: str) -> str:
        role = "reward" if stage == "rm" else "actor"  # step 3 keeps the RLHF-trained actor
        module = self.engines[role].module
        path = os.path.join(directory, f"{role}.pt")
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

    def params(self) -> dict[str, ParamCounts]:
        return {role: count_params(engine.module) for role, engine in self.engines.items()}

    def model_state(self) -> dict[str, ModelState]:
        return {role: _engine_state(engine) for role, engine in self.engines.items()}

    def notes(self) -> list[str]:
        return list(self._notes)

    def upstream_defects(self) -> list[dict[str, str]]:
        return [fp16_zero0.record_entry(self.options.fix_fp16_zero0_loss_scale)] if self._unscaled else []

    def close(self) -> None:
        self.engines.clear()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _local_grad_norm(engine) -> float | None:
    grads = [p.grad.float() for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return None
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def _held_bytes(param: torch.nn.Parameter) -> int:
    """A ZeRO-3 partition (`ds_tensor`) plus any gathered or persistent copy."""
    return tensor_bytes(param.data) + (tensor_bytes(param.ds_tensor) if hasattr(param, "ds_tensor") else 0)


def _engine_state(engine) -> ModelState:
    wrapper = engine.optimizer
    inner = getattr(wrapper, "optimizer", wrapper) if wrapper is not None else None
    return model_state(engine.module.parameters(), inner, held=_held_bytes)
