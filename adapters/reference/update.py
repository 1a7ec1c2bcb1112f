"""The reference's training steps: the Hugging Face LM loss (SFT), DS-Chat's per-token pairwise loss (RM), and
one PPO update per rollout as DS-Chat's train_rlhf computes it (per-token KL penalty plus the clipped score
on the last action, GAE, clipped policy and value losses; actor step, then critic step)."""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from adapters.base import Experience, TrainOutput
from adapters.reference.models import end_scores, pairwise_loss
from adapters.rl_math import gae, gather_log_probs, kl_penalised_rewards, policy_loss, position_ids, value_loss
from bench.run.data import PreferenceBatch, SFTBatch


def _total_norm(norm: torch.Tensor) -> float:
    """clip_grad_norm_'s result as a number (a DTensor under FSDP2: its full value)."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


class Update:
    """Training half of ReferenceAdapter (a mixin)."""

    def _backward_step(self, role: str, loss: torch.Tensor, out: TrainOutput) -> None:
        """Backward of one micro-batch's loss / grad_accum (the step's gradient is their mean), the data-parallel
        reduction only on the last (DDP no_sync; FSDP2 set_requires_gradient_sync), then clip and step."""
        optimizer, scaler = self.optimizers[role], self.scalers.get(role)
        model = self.models[role]
        last = self.ends_accumulation(role)
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
            model.set_requires_gradient_sync(last)
        with nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync():
            scaled = loss / self.spec.grad_accum
            (scaled if scaler is None else scaler.scale(scaled)).backward()
        if not last:
            out.accumulate(role, float(loss.detach()))
            return
        params = [p for p in self.modules[role].parameters() if p.requires_grad]
        if scaler is not None:
            scaler.unscale_(optimizer)
        # the norm of whole gradients (DDP has all-reduced them; FSDP2's DTensors reduce it), clipped as asked
        clip = self.spec.grad_clip_or(self.options.grad_clip) or math.inf
        norm = _total_norm(torch.nn.utils.clip_grad_norm_(params, clip))
        skipped = False
        if scaler is None:
            optimizer.step()
        else:
            before = scaler.get_scale()
            scaler.step(optimizer)  # skips the step on an overflow and lowers the scale
            scaler.update()
            skipped = scaler.get_scale() < before
        optimizer.zero_grad(set_to_none=True)
        out.record(role, float(loss.detach()), None if skipped else norm, skipped,
                   scaler.get_scale() if scaler is not None else None)

    def sft_step(self, batch: SFTBatch) -> TrainOutput:
        device = self.ctx.device
        with self.autocast():
            loss = self.models["actor"](input_ids=batch.input_ids.to(device),
                                        attention_mask=batch.attention_mask.to(device),
                                        labels=batch.labels.to(device), use_cache=False).loss
        out = TrainOutput(losses={}, tokens=batch.real_tokens, samples=batch.input_ids.shape[0])
        self._backward_step("actor", loss, out)
        return out

    def _pair_values(self, batch: PreferenceBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-token values of [chosen; rejected] in one forward, and the pair's ids and masks on the device."""
        ids = torch.cat([batch.chosen_ids, batch.rejected_ids]).to(self.ctx.device)
        mask = torch.cat([batch.chosen_mask, batch.rejected_mask]).to(self.ctx.device)
        with self.autocast():
            values = self.models["reward"](ids, mask, position_ids(mask)).float()
        return values, ids, mask

    def rm_step(self, batch: PreferenceBatch) -> TrainOutput:
        values, ids, mask = self._pair_values(batch)
        n = batch.chosen_ids.shape[0]
        loss = pairwise_loss(ids[:n], ids[n:], values[:n], values[n:], mask[:n], mask[n:])
        out = TrainOutput(losses={}, tokens=batch.real_tokens, samples=n)
        self._backward_step("reward", loss, out)
        scores = end_scores(values.detach(), mask)
        out.metrics["accuracy"] = float((scores[:n] > scores[n:]).float().mean())
        return out

    @torch.no_grad()
    def rm_scores(self, batch: PreferenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
        self.modules["reward"].eval()
        values, _, mask = self._pair_values(batch)
        self.modules["reward"].train()
        scores, n = end_scores(values, mask), batch.chosen_ids.shape[0]
        return scores[:n], scores[n:]

    def ppo_train(self, experiences: list[Experience]) -> TrainOutput:
        (experience,) = experiences  # updated as it comes, as DS-Chat's formulation
        p = experience.payload
        ppo = self.options.ppo
        seq, mask, start = p["seq"], p["mask"], p["start"]
        action_mask = mask[:, 1:]
        with torch.no_grad():
            rewards, ends = kl_penalised_rewards(p["log_probs"], p["ref_log_probs"], p["score"], start, action_mask,
                                                 ppo.kl_coef, ppo.clip_reward_value)
            after_end = torch.arange(rewards.shape[1], device=rewards.device)[None, :] >= ends[:, None]
            old_values = p["values"].masked_fill(after_end, 0.0)
            advantages, returns = gae(old_values, rewards.masked_fill(after_end, 0.0), start, ppo.gamma, ppo.lam)
        out = TrainOutput(losses={}, tokens=0, samples=0)
        positions = position_ids(mask)
        for _ in range(ppo.ppo_epochs):
            with self.autocast():
                logits = self.models["actor"](input_ids=seq, attention_mask=mask, position_ids=positions,
                                              use_cache=False).logits
                log_probs = gather_log_probs(logits[:, :-1], seq[:, 1:])
            actor_loss = policy_loss(log_probs[:, start:].float(), p["log_probs"][:, start:], advantages,
                                     action_mask[:, start:], ppo.cliprange)
            del logits
            self._backward_step("actor", actor_loss, out)
            with self.autocast():
                values = self.models["critic"](seq, mask, positions)[:, :-1]
            self._dtypes.update({"update/log_probs": str(log_probs.dtype), "update/values": str(values.dtype)})
            critic_loss = value_loss(values[:, start:].float(), old_values[:, start:], returns,
                                     action_mask[:, start:], ppo.cliprange_value)
            self._backward_step("critic", critic_loss, out)
            out.tokens += experience.tokens
            out.samples += experience.samples
        return out
