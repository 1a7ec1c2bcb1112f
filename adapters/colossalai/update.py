"""ColossalChat's training steps (SFTTrainer, RewardModelTrainer, PPOTrainer._training_step).

SFT through the booster (booster.execute_pipeline when pp > 1); RM with coati's LogSigLoss; PPO as
_training_step: actor forward and PolicyLoss (ratio clamp, skip when the mean ratio runs away), critic
forward and clipped ValueLoss, both backwards, then both optimizers step. Losses run in the models'
dtype, as coati computes them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from adapters.base import Experience, TrainOutput
from adapters.grad_norm import global_grad_norm
from adapters.rl_math import gather_log_probs, position_ids
from bench.run.data import PreferenceBatch, SFTBatch


class Update:
    """Training half of ColossalAdapter (a mixin)."""

    def _mixin(self, role: str):
        return precision_mixin(self.optimizers[role])

    def _step(self, role: str, loss: float, out: TrainOutput) -> None:
        """Step one optimizer and record its gradient norm (unscaled), overflow skip and loss scale; with
        grad_accum only on every grad_accum-th micro-batch, as coati's trainers count `num_train_step` (the
        losses are not divided: the micro-batches' gradients add up)."""
        if not self.ends_accumulation(role):
            out.accumulate(role, loss)
            return
        optimizer = self.optimizers[role]
        mixin = self._mixin(role)
        fp16 = self.spec.precision == "fp16" and hasattr(mixin, "loss_scale")
        scale = float(mixin.loss_scale) if fp16 else 1.0
        own_norm = None
        if self.plugin.cls == "TorchDDPPlugin":  # whole, all-reduced gradients sit on the module
            own_norm = global_grad_norm(self.models[role].parameters())
        optimizer.step()
        optimizer.zero_grad()
        self.schedulers[role].step()  # coati steps its schedulers after the optimizers, skipped step or not
        skipped = bool(fp16 and float(mixin.found_overflow) > 0)
        if own_norm is None and not skipped and hasattr(optimizer, "get_grad_norm"):
            norm = optimizer.get_grad_norm()
            # colossalai's ZeRO/AMP norms are of the loss-scaled gradients (their clip code divides it out)
            own_norm = float(norm) / scale if norm is not None else None
        out.record(role, loss, None if skipped else own_norm, skipped, float(mixin.loss_scale) if fp16 else None)

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
    def rm_scores(self, batch: PreferenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
        self.models["reward"].eval()
        return self._pair_scores(batch)

    def ppo_train(self, experiences: list[Experience]) -> TrainOutput:
        """An episode's update (OLTrainer.fit): the buffer of num_collect_steps rollouts, kept on the host
        (NaiveExperienceBuffer's cpu_offload), num_update_steps passes, each over a shuffled loader of
        train_batch_size minibatches without the last partial one (drop_last), each moved to the device and
        trained by _training_step; both optimizers step every grad_accum-th minibatch."""
        ppo = self.options.ppo
        buffer = {key: torch.cat([e.payload[key] for e in experiences]) for key in experiences[0].payload}
        size = self.options.train_batch_size(self.spec)
        out = TrainOutput(losses={}, tokens=0, samples=0)
        skips = steps = 0
        for _ in range(ppo.num_update_steps):
            for indices in shuffled_minibatches(len(buffer["seq"]), size):
                batch = {key: value[indices].to(self.ctx.device) for key, value in buffer.items()}
                skips += int(self._training_step(batch, out))
                steps += 1
        out.metrics["policy_skip_ratio"] = skips / max(1, steps)
        return out

    def _training_step(self, p: dict[str, torch.Tensor], out: TrainOutput) -> bool:
        """PPOTrainer._training_step on one minibatch; returns whether PolicyLoss skipped the actor's backward."""
        ppo = self.options.ppo
        seq, mask, action_mask = p["seq"], p["mask"], p["action_mask"]
        num_actions = action_mask.shape[1]
        actor, critic = self.models["actor"], self.models["critic"]
        actor.train()
        critic.train()
        logits, _ = self._logits("actor", input_ids=seq, attention_mask=mask, position_ids=position_ids(mask),
                                 use_cache=False)
        log_probs = gather_log_probs(logits[:, :-1], seq[:, 1:])[:, -num_actions:]
        actor_loss, skip, max_ratio = _policy_loss(log_probs, p["log_probs"], p["advantages"], action_mask,
                                                   ppo.eps_clip, ppo.skip_threshold, ppo.ratio_max)
        if not skip:
            self._backward("actor", actor_loss)
        values = self.models["critic"](seq, mask, position_ids(mask))[:, -num_actions:]
        self._dtypes.update({"update/log_probs": str(log_probs.dtype), "update/values": str(values.dtype)})
        critic_loss = ppo.vf_coef * _value_loss(values, p["values"], p["advantages"], action_mask, ppo.value_clip)
        self._backward("critic", critic_loss)
        self._step("actor", float(actor_loss.detach()), out)
        self._step("critic", float(critic_loss.detach()), out)
        out.metrics["max_ratio"] = float(max_ratio)
        out.tokens += int(mask.sum())
        out.samples += seq.shape[0]
        return skip


def shuffled_minibatches(samples: int, size: int) -> list[list[int]]:
    """The sample indices of each minibatch of PPOTrainer's `DataLoader(buffer, batch_size=size, shuffle=True,
    drop_last=True)`, drawn by that loader over the indices (so from torch's global generator as upstream's)."""
    return [batch.tolist() for batch in DataLoader(range(samples), batch_size=size, shuffle=True, drop_last=True)]


def precision_mixin(optimizer: Any) -> Any:
    """The optimizer's mixed-precision helper (overflow flag, loss scale). colossalai 0.5.0 names it
    `mixed_precision_mixin` in LowLevelZeroOptimizer, `mixed_precision` in the HybridParallel AMP wrapper and
    `mix_precision_mixin` in GeminiOptimizer."""
    for name in ("mixed_precision_mixin", "mixed_precision", "mix_precision_mixin"):
        mixin = getattr(optimizer, name, None)
        if mixin is not None:
            return mixin
    return None



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
