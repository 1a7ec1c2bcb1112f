"""DS-Chat's training steps (step-1/2 main.py loops, DeepSpeedPPOTrainer `train_rlhf`).

The PPO update follows train_rlhf: rewards (per-token KL penalty plus the clipped end score), GAE, the
actor's clipped policy loss, backward and step, then the critic's forward and clipped value loss. The
new-policy log-probs stay in the logits' dtype even with `compute_fp32_loss`, which upcasts only the
value loss's values (critic_loss_fn). The actor is checkpointed only during the update.
"""

from __future__ import annotations

import torch

from adapters.base import Experience, TrainOutput
from adapters.dschat import fp16_zero0
from adapters.grad_norm import global_grad_norm
from adapters.rl_math import gae, gather_log_probs, kl_penalised_rewards, masked_mean, policy_loss, position_ids
from bench.run.data import PreferenceBatch, SFTBatch


class Update:
    """Training half of DSChatAdapter (a mixin)."""

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
        """engine.backward and engine.step, as train_rlhf and the step-1/2 loops call them on every micro-batch:
        DeepSpeed divides the loss by its gradient_accumulation_steps and steps the optimizer on the last."""
        engine = self.engines[role]
        boundary = engine.is_gradient_accumulation_boundary()  # asked before step() counts this micro-batch
        skipped_before = engine.skipped_steps
        scale = 1.0
        if role in self._unscaled and self.options.fix_fp16_zero0_loss_scale:
            scaled, scale = fp16_zero0.scaled_loss(loss, engine.optimizer)
            engine.backward(scaled)
        else:
            engine.backward(loss)
        if not boundary:
            engine.step()  # counts the micro-batch; the optimizer waits for the last
            out.accumulate(role, float(loss.detach()))
            return
        # ZeRO-0 keeps whole gradients on the module, so the norm is measured there (unscaled); DeepSpeed's own
        # ZeRO-0 figure is missing for fp32 and, for fp16, off by the loss scale (see fp16_zero0).
        own_norm = global_grad_norm(engine.module.parameters()) if engine.zero_optimization_stage() == 0 else None
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
    def rm_scores(self, batch: PreferenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
        engine = self.engines["reward"]
        engine.eval()
        result = engine(*self._pair_inputs(batch))
        engine.train()
        return result["chosen_end_scores"].float(), result["rejected_end_scores"].float()

    def ppo_train(self, experiences: list[Experience]) -> TrainOutput:
        (experience,) = experiences  # train_rlhf runs on each rollout as it comes (generation_batches 1)
        p = experience.payload
        ppo = self.options.ppo
        seq, mask, start = p["seq"], p["mask"], p["start"]
        action_mask = mask[:, 1:]
        old_values = p["values"].clone()
        with torch.no_grad():
            rewards, ends = kl_penalised_rewards(p["log_probs"], p["ref_log_probs"], p["score"], start, action_mask,
                                                 ppo.kl_ctl, ppo.clip_reward_value, one_past=True)
            for j in range(rewards.shape[0]):
                old_values[j, int(ends[j]):] = 0
                rewards[j, int(ends[j]):] = 0
            advantages, returns = gae(old_values, rewards, start, ppo.gamma, ppo.lam)
        actor, critic = self.engines["actor"], self.engines["critic"]
        if self.spec.grad_ckpt:  # DS-Chat checkpoints the actor only during its update
            actor.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        out = TrainOutput(losses={}, tokens=0, samples=0)
        for _ in range(ppo.ppo_epochs):
            # `actor_prob` stays referenced through the critic's forward and backward, as in train_rlhf.
            actor_prob = actor(input_ids=seq, attention_mask=mask, position_ids=position_ids(mask),
                               use_cache=False).logits
            log_probs = gather_log_probs(actor_prob[:, :-1], seq[:, 1:])
            actor_loss = policy_loss(log_probs[:, start:], p["log_probs"][:, start:], advantages,
                                     action_mask[:, start:], ppo.cliprange)
            self._backward_step("actor", actor_loss, out)
            values = critic.forward_value(seq, mask)["values"][:, :-1]
            critic_loss = critic_loss_fn(values[:, start:], old_values[:, start:], returns, action_mask[:, start:],
                                         ppo.cliprange_value, self.options.compute_fp32_loss)
            self._dtypes.update({"update/log_probs": str(log_probs.dtype),
                                 "update/values": str(self._upcast(values).dtype)})
            self._backward_step("critic", critic_loss, out)
            del actor_prob
            out.tokens += experience.tokens
            out.samples += experience.samples
        if self.spec.grad_ckpt:
            actor.module.gradient_checkpointing_disable()
        return out



def critic_loss_fn(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                   cliprange_value: float, fp32: bool) -> torch.Tensor:
    """DeepSpeedPPOTrainer.critic_loss_fn: the values clamped around the old ones in the model's dtype, then
    (--compute_fp32_loss) both upcast; half the larger squared error, masked mean."""
    clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    if fp32:
        values, clipped = values.float(), clipped.float()
    return 0.5 * masked_mean(torch.max((values - returns) ** 2, (clipped - returns) ** 2), mask)
