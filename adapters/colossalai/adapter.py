"""ColossalChat's SFT, RM and PPO on the real colossalai Booster.

SFT: a causal LM boosted with the chosen plugin (booster.execute_pipeline when pp > 1). RM: coati's
RewardModel (backbone + fresh value head, score at the last attended token, log-sigmoid pairwise loss).
PPO: four separate models as train_ppo.py builds them -- actor and critic each with their own HybridAdam
and booster, reference and reward boosted without an optimizer and shuttled to the host for the update
and back for rollout; under 3d the critic and reward use a second plugin whose policy is the backbone's.
Rollout is coati's own sampling loop; experience and losses follow NaiveExperienceMaker and PPOTrainer
(per-token k1 KL penalty with the clipped score added on every action token, GAE, PolicyLoss with its
ratio clamp and skip, clipped ValueLoss; actor and critic backward, then both optimizers step).

Where this differs from coati, on purpose: positions skip left padding in every forward (coati's
generation does, its scoring forwards do not); the reward model reads the stop token (coati's
right-padded mask attends one pad beyond it) and the critic sees the same left-padded layout in
experience and update (coati scores it on the right-padded layout, misaligned by the prompt padding).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from adapters.base import Adapter, Experience, ModelState, RankContext, Rollout, TrainOutput
from adapters.colossalai import generation
from adapters.colossalai.lora import convert_to_lora, merged_state_dict
from adapters.colossalai.models import Critic, RewardModel, build_backbone
from adapters.colossalai.options import ColossalOptions, PluginChoice
from adapters.rl_math import gae, gather_log_probs, masked_mean, position_ids
from adapters.state_bytes import model_state
from bench.data import EOS, PAD, PreferenceBatch, PromptBatch, SFTBatch
from bench.models import ParamCounts, build_causal_lm, count_params
from bench.spec import RunSpec, UnsupportedError

GEMINI_ON_CPU = (
    "GeminiPlugin (zero=3) needs CUDA: its chunk manager moves every chunk to the GPU "
    "(colossalai/zero/gemini/chunk/manager.py asserts 'each chunk should first be moved to CUDA'; "
    "placement_policy=auto fails with 'Torch not compiled with CUDA enabled')"
)


class ColossalAdapter(Adapter):
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
        self._counts: dict[str, ParamCounts] = {}
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
    def _make_plugin(self, custom_policy: Any = None):
        from colossalai.booster import plugin as plugins

        kwargs = dict(self.plugin.kwargs)
        if self.plugin.cls != "TorchDDPPlugin":
            kwargs.update(precision=self.spec.precision, initial_scale=self.options.initial_scale,
                          max_norm=self.options.grad_clip)
        if self.plugin.cls in ("LowLevelZeroPlugin", "HybridParallelPlugin") and self.ctx.device.type == "cpu":
            # Overlapping ZeRO's reduction records CUDA streams on its buffers; CPU tensors reject that.
            kwargs["overlap_communication"] = False
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
            prefix = "transformer."
            model.model.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        return model

    def _lora(self, model: torch.nn.Module) -> None:
        if not self.spec.lora:
            return
        if self.plugin.cls == "HybridParallelPlugin":
            # Shardformer swaps the embeddings and LM head for its padded versions and cannot swap a
            # LoRA-wrapped one ("Failed to replace wte of type LoraEmbedding"; coati users hit the same, #5507).
            convert_to_lora(model, self.spec.lora, self.options.lora, embeddings=False, skip=("lm_head",))
            note = "LoRA under HybridParallelPlugin: every linear layer but the LM head; embeddings stay frozen"
            if note not in self._notes:
                self._notes.append(note)
        else:
            convert_to_lora(model, self.spec.lora, self.options.lora)

    def _boost(self, role: str, model: torch.nn.Module, lr: float | None, plugin: Any) -> None:
        self._counts[role] = count_params(model)
        optimizer = self._optimizer(model, lr) if lr is not None else None
        booster = self._booster_cls(plugin=plugin)
        model, optimizer, *_ = booster.boost(model=model, optimizer=optimizer)
        self.models[role], self.boosters[role] = model, booster
        if optimizer is not None:
            self.optimizers[role] = optimizer
        else:
            model.eval()

    def _value_plugin(self, plugin: Any) -> Any:
        """coati boosts value models under 3d with a second plugin whose policy is their backbone's."""
        if self.plugin.cls != "HybridParallelPlugin":
            return plugin
        from colossalai.shardformer.policies.auto_policy import get_autopolicy

        return self._make_plugin(custom_policy=get_autopolicy(build_backbone(self.spec.model)))

    def setup(self, stage: str, init: dict[str, str]) -> None:
        plugin = self._plugin
        if stage == "sft":
            model = self._lm(init.get("sft"))
            self._lora(model)
            if self.spec.grad_ckpt:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self._boost("actor", model, self.spec.stage_lr("sft"), plugin)
        elif stage == "rm":
            model = self._value_model(RewardModel, init.get("rm"))
            self._lora(model)
            if self.spec.grad_ckpt:
                model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self._boost("reward", model, self.spec.stage_lr("rm"), self._value_plugin(plugin))
        else:
            self._setup_ppo(init, plugin)
        optimizer = "HybridAdam" if self.options.optimizer == "hybrid_adam" else "torch AdamW"
        self._notes.append(f"optimizer: {optimizer} (betas {tuple(self.options.betas)}, "
                           f"weight decay {self.options.weight_decay})")
        if self.plugin.cls == "TorchDDPPlugin":
            self._notes.append("no gradient clipping: ColossalChat's ddp path passes no max_norm")

    def _setup_ppo(self, init: dict[str, str], plugin: Any) -> None:
        value_plugin = self._value_plugin(plugin)
        actor = self._lm(init.get("sft"))
        critic_ckpt = init.get("rm") if self.options.critic_from_rm else None
        critic = self._value_model(Critic, critic_ckpt, backbone_from_lm=init.get("sft"))
        self._lora(actor)
        self._lora(critic)
        _disable_dropout(actor)
        _disable_dropout(critic)
        if self.spec.grad_ckpt:
            actor.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            critic.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self._boost("actor", actor, self.spec.stage_lr("actor"), plugin)
        self._boost("critic", critic, self.spec.stage_lr("critic"), value_plugin)
        self._boost("reward", self._value_model(RewardModel, init.get("rm")), None, value_plugin)
        self._boost("ref", self._lm(init.get("sft")), None, plugin)
        self.shuttles_models = self.options.ppo.offload_inference_models and self.plugin.cls != "GeminiPlugin"
        if not init.get("sft"):
            self._notes.append("actor and reference start from random base weights (no SFT checkpoint)")
        source = "the RM checkpoint" if critic_ckpt else "the SFT backbone with a fresh value head"
        self._notes.append(f"critic starts from {source}")
        self._notes.append(
            f"PPO: {self.options.ppo.num_update_steps} update pass(es) per rollout (coati's default is 5); "
            "positions skip left padding in every forward; the RM scores the stop token and the critic uses the "
            "rollout's layout for old and new values (coati: one pad late, and misaligned by prompt padding)"
        )

    # ----------------------------------------------------------------- stepping
    def _mixin(self, role: str):
        return precision_mixin(self.optimizers[role])

    def _step(self, role: str, loss: float, out: TrainOutput) -> None:
        """Step one optimizer and record its gradient norm (unscaled), overflow skip and loss scale."""
        optimizer = self.optimizers[role]
        mixin = self._mixin(role)
        fp16 = self.spec.precision == "fp16" and hasattr(mixin, "loss_scale")
        scale = float(mixin.loss_scale) if fp16 else 1.0
        own_norm = None
        if self.plugin.cls == "TorchDDPPlugin":  # whole, all-reduced gradients sit on the module
            grads = [p.grad.float() for p in self.models[role].parameters() if p.grad is not None]
            own_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else None
        optimizer.step()
        optimizer.zero_grad()
        skipped = bool(fp16 and float(mixin.found_overflow) > 0)
        if own_norm is None and not skipped and hasattr(optimizer, "get_grad_norm"):
            norm = optimizer.get_grad_norm()
            # colossalai's ZeRO/AMP norms are of the loss-scaled gradients (their clip code divides it out)
            own_norm = float(norm) / scale if norm is not None else None
        out.record(role, loss, None if skipped else own_norm, skipped, float(mixin.loss_scale) if fp16 else None)

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

    def _backward(self, role: str, loss: torch.Tensor) -> None:
        self.boosters[role].backward(loss=loss, optimizer=self.optimizers[role])

    def _pipeline_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        model, booster = self.models["actor"], self.boosters["actor"]
        result = booster.execute_pipeline(iter([batch]), model, lambda outputs, inputs: outputs.loss,
                                          self.optimizers["actor"], return_loss=True)
        # Only the last stage holds the loss; share it so every rank records the same value.
        if booster.plugin.stage_manager.is_last_stage():
            loss = result["loss"].detach().float()
        else:
            loss = torch.zeros((), device=self.ctx.device)
        dist.all_reduce(loss, group=booster.plugin.pp_group)
        return loss

    def sft_step(self, batch: SFTBatch) -> TrainOutput:
        device = self.ctx.device
        inputs = {"input_ids": batch.input_ids.to(device), "attention_mask": batch.attention_mask.to(device),
                  "labels": batch.labels.to(device)}
        out = TrainOutput(losses={}, tokens=batch.real_tokens, samples=batch.input_ids.shape[0])
        self.models["actor"].train()
        if self.spec.pp > 1:
            loss = self._pipeline_loss(inputs)
        else:
            if self.spec.tp > 1:  # the HF loss would meet vocabulary-sharded logits (see _logits)
                labels = inputs.pop("labels")
                logits, _ = self._logits("actor", **inputs, use_cache=False)
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
            else:
                loss = self.models["actor"](**inputs, use_cache=False).loss
            self._backward("actor", loss)
        self._step("actor", float(loss.detach()), out)
        return out

    def _pair_scores(self, batch: PreferenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.cat([batch.chosen_ids, batch.rejected_ids]).to(self.ctx.device)
        mask = torch.cat([batch.chosen_mask, batch.rejected_mask]).to(self.ctx.device)
        scores = self.models["reward"](ids, mask).float()
        n = batch.chosen_ids.shape[0]
        return scores[:n], scores[n:]

    def rm_step(self, batch: PreferenceBatch) -> TrainOutput:
        self.models["reward"].train()
        chosen, rejected = self._pair_scores(batch)
        loss = -F.logsigmoid(chosen - rejected).mean()  # coati's LogSigLoss
        self._backward("reward", loss)
        out = TrainOutput(losses={}, tokens=batch.real_tokens, samples=batch.chosen_ids.shape[0])
        self._step("reward", float(loss.detach()), out)
        out.metrics["accuracy"] = float((chosen > rejected).float().mean())
        return out

    @torch.no_grad()
    def rm_accuracy(self, batch: PreferenceBatch) -> float:
        self.models["reward"].eval()
        chosen, rejected = self._pair_scores(batch)
        return float((chosen > rejected).float().mean())

    @property
    def _inference_models(self) -> list[torch.nn.Module]:
        return [self.models["ref"], self.models["reward"]]

    def shuttle(self, direction: str) -> dict[str, int]:
        target = self.ctx.device if direction == "onload" else torch.device("cpu")
        moved = 0
        for model in self._inference_models:
            for tensor in [*model.parameters(), *model.buffers()]:
                if tensor.device != target:
                    moved += tensor.numel() * tensor.element_size()
            model.to(target)
        return {"bytes_moved": moved}

    @torch.no_grad()
    def generate(self, batch: PromptBatch) -> Rollout:
        self.models["actor"].eval()
        ppo = self.options.ppo
        if ppo.rollout_seed is not None:
            torch.manual_seed(ppo.rollout_seed)
        sequences, mask = generation.sample(
            lambda **inputs: self._logits("actor", **inputs),
            batch.input_ids.to(self.ctx.device), batch.attention_mask.to(self.ctx.device),
            self.spec.prompt_len + self.spec.answer_len, EOS, PAD, ppo.temperature, ppo.top_k,
        )
        prompt_len = batch.input_ids.shape[1]
        return Rollout(sequences=sequences, attention_mask=mask, prompt_len=prompt_len,
                       prompt_tokens=int(mask[:, :prompt_len].sum()),
                       generated_tokens=int(mask[:, prompt_len:].sum()))

    def _forward_chunks(self, role: str, seq: torch.Tensor, mask: torch.Tensor, num_actions: int) -> torch.Tensor:
        """Action log-probs from `role`, in chunks as NaiveExperienceMaker runs its logits forwards."""
        chunk = self.options.ppo.logits_forward_batch_size
        parts = []
        for i in range(0, seq.shape[0], chunk):
            s, m = seq[i:i + chunk], mask[i:i + chunk]
            logits, _ = self._logits(role, input_ids=s, attention_mask=m, position_ids=position_ids(m), use_cache=False)
            parts.append(gather_log_probs(logits[:, :-1], s[:, 1:])[:, -num_actions:])
        return torch.cat(parts)

    def _values(self, seq: torch.Tensor, mask: torch.Tensor, num_actions: int) -> torch.Tensor:
        return self.models["critic"](seq, mask)[:, -num_actions:].float()

    @torch.no_grad()
    def make_experience(self, rollout: Rollout) -> Experience:
        for model in self.models.values():
            model.eval()
        ppo = self.options.ppo
        seq, mask, prompt_len = rollout.sequences, rollout.attention_mask, rollout.prompt_len
        num_actions = seq.shape[1] - prompt_len
        answers = seq[:, prompt_len:]
        # Actions up to and including the first stop token.
        action_mask = F.pad(((answers == EOS).long().cumsum(1) == 0)[:, :-1], (1, 0), value=True)
        action_mask = action_mask & (mask[:, prompt_len:] > 0)
        log_probs = self._forward_chunks("actor", seq, mask, num_actions)
        ref_log_probs = self._forward_chunks("ref", seq, mask, num_actions)
        score = self.models["reward"](*_right_padded(seq, mask)).float()
        values = self._values(seq, mask, num_actions) * action_mask
        action_mask_f = action_mask.float()
        log_ratio = log_probs - ref_log_probs
        rewards = -ppo.kl_coef * log_ratio * action_mask_f
        rewards += score.clamp(-ppo.reward_clip, ppo.reward_clip)[:, None] * action_mask_f  # every action token
        advantages, _ = gae(values, rewards, 0, ppo.gamma, ppo.lam)  # over every action position
        payload = {"seq": seq, "mask": mask, "action_mask": action_mask_f, "log_probs": log_probs,
                   "values": values, "advantages": advantages}
        return Experience(
            payload=payload,
            reward=float(score.mean()),
            kl=float(masked_mean(log_ratio, action_mask_f)),
            value=float(masked_mean(values, action_mask_f)),
            tokens=rollout.real_tokens,
            samples=rollout.samples,
        )

    def ppo_train(self, experience: Experience) -> TrainOutput:
        p = experience.payload
        ppo = self.options.ppo
        seq, mask, action_mask = p["seq"], p["mask"], p["action_mask"]
        num_actions = action_mask.shape[1]
        actor, critic = self.models["actor"], self.models["critic"]
        out = TrainOutput(losses={}, tokens=0, samples=0)
        skips = 0
        for _ in range(ppo.num_update_steps):
            actor.train()
            critic.train()
            logits, _ = self._logits("actor", input_ids=seq, attention_mask=mask, position_ids=position_ids(mask),
                                     use_cache=False)
            log_probs = gather_log_probs(logits[:, :-1], seq[:, 1:])[:, -num_actions:]
            actor_loss, skip, max_ratio = _policy_loss(log_probs, p["log_probs"], p["advantages"], action_mask,
                                                       ppo.eps_clip, ppo.skip_threshold, ppo.ratio_max)
            if not skip:
                self._backward("actor", actor_loss)
            skips += int(skip)
            values = self._values(seq, mask, num_actions)
            critic_loss = ppo.vf_coef * _value_loss(values, p["values"], p["advantages"], action_mask,
                                                     ppo.value_clip)
            self._backward("critic", critic_loss)
            self._step("actor", float(actor_loss.detach()), out)
            self._step("critic", float(critic_loss.detach()), out)
            out.metrics["max_ratio"] = float(max_ratio)
            out.tokens += experience.tokens
            out.samples += experience.samples
        out.metrics["policy_skip_ratio"] = skips / ppo.num_update_steps
        return out

    # ----------------------------------------------------------------- state
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

    def params(self) -> dict[str, ParamCounts]:
        return dict(self._counts)

    def model_state(self) -> dict[str, ModelState]:
        # Module parameters are what this rank holds (TP shards under 3d; ZeRO 1/2 shard optimizer state only).
        return {role: model_state(model.parameters(), _inner_optimizer(self.optimizers.get(role)))
                for role, model in self.models.items()}

    def notes(self) -> list[str]:
        return list(self._notes)

    def close(self) -> None:
        self.models.clear()
        self.optimizers.clear()
        self.boosters.clear()
        if dist.is_initialized():
            dist.destroy_process_group()


def precision_mixin(optimizer: Any) -> Any:
    """The optimizer's mixed-precision helper (overflow flag, loss scale). colossalai 0.5.0 names it
    `mixed_precision_mixin` in LowLevelZeroOptimizer, `mixed_precision` in the HybridParallel AMP wrapper and
    `mix_precision_mixin` in GeminiOptimizer."""
    for name in ("mixed_precision_mixin", "mixed_precision", "mix_precision_mixin"):
        mixin = getattr(optimizer, name, None)
        if mixin is not None:
            return mixin
    return None


def _disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def _right_padded(seq: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's real tokens moved to the front, as coati converts rollouts for the reward model."""
    order = torch.argsort((mask == 0).long(), dim=1, stable=True)
    return seq.gather(1, order), mask.gather(1, order)


def _masked_row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((values * mask).sum(1) / (mask.sum(1) + 1e-8)).mean()


def _policy_loss(log_probs, old_log_probs, advantages, mask, eps: float, skip_threshold: float, ratio_max: float):
    """coati PolicyLoss: skip the backward when the mean ratio exceeds the threshold, clamp the ratio."""
    ratio_ = ((log_probs - old_log_probs) * mask).exp()
    skip = bool(ratio_.mean() > skip_threshold)
    ratio = ratio_.clamp(0.0, ratio_max)
    surrogate = -torch.min(ratio * advantages, ratio.clamp(1 - eps, 1 + eps) * advantages)
    return _masked_row_mean(surrogate, mask), skip, ratio_.max().detach()


def _value_loss(values, old_values, advantages, mask, clip: float) -> torch.Tensor:
    """coati ValueLoss: returns = advantages + old values; the larger of the clipped and plain squared errors."""
    returns = advantages + old_values
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    loss = torch.max((clipped - returns) ** 2, (values - returns) ** 2)
    return 0.5 * (loss * mask).sum() / mask.sum()


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    while hasattr(optimizer, "optim"):  # colossalai's OptimizerWrapper chain
        optimizer = optimizer.optim
    return optimizer
