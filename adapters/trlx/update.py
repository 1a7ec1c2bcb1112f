"""Trlx's training steps (AccelerateRLTrainer.learn, AcceleratePPOTrainer.loss, PPOConfig.loss).

As `learn` does: the loss forward runs in eval mode, `train()` is switched on only around
`accelerator.backward`, then back to eval. The PPO loss is one joint loss (policy + vf_coef * value) over
the rollout at its own padded width, `ppo_epochs` passes per rollout, advantages whitened across ranks.
The RM example trains with HF's Trainer, in train mode throughout.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from adapters.base import Experience, TrainOutput
from adapters.grad_norm import global_grad_norm
from adapters.rl_math import gae, gather_log_probs
from bench.run.data import PreferenceBatch, SFTBatch


class Update:
    """Training half of TrlxAdapter (a mixin)."""

    def _backward_step(self, loss: torch.Tensor, out: TrainOutput, train_mode_around_backward: bool = True,
                       hf_trainer: bool = False) -> None:
        """learn()'s micro-batch: accelerator.backward, then opt.step() after the minibatch's last. trlx never
        sets accelerate's gradient_accumulation_steps, so the loss is not divided (the micro-batches' gradients
        add up) and under DeepSpeed accelerate's backward steps the engine on every micro-batch (an upstream
        defect, UPSTREAM_DEFECTS). `hf_trainer` (the RM example's Trainer): the loss divided by grad_accum and
        gradients synchronised on the last micro-batch only; under DeepSpeed the engine accumulates (its
        gradient_accumulation_steps set from grad_accum at setup) and steps on the last."""
        role = self.role
        accelerator = self.accelerator
        engine = self.model if self.deepspeed else None
        skipped_before = engine.skipped_steps if engine is not None else 0
        last = self.ends_accumulation(role)
        if train_mode_around_backward:
            self.model.train()
        if hf_trainer and engine is not None:
            engine.backward(loss)
            engine.step()
        elif hf_trainer:
            with nullcontext() if last else accelerator.no_sync(self.model):
                accelerator.backward(loss / self.spec.grad_accum)
        else:
            accelerator.backward(loss)  # with DeepSpeed this also steps the engine, every micro-batch
        if train_mode_around_backward:
            self.model.eval()
        if not last and (engine is None or hf_trainer):
            out.accumulate(role, float(loss.detach()))
            return
        norm = None
        if engine is None:
            scale = accelerator.scaler.get_scale() if accelerator.scaler is not None else 1.0
            norm = global_grad_norm(self.model.parameters())
            norm = norm / scale if norm is not None else None
            if self.spec.grad_clip:  # upstream's DDP path clips nothing; grad_clip asks for it (a harness extension)
                accelerator.clip_grad_norm_(self.model.parameters(), self.spec.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad()
        if engine is not None:
            skipped = engine.skipped_steps > skipped_before
            norm = engine.get_global_grad_norm()
            scale = None
            if engine.fp16_enabled():
                scale = getattr(engine.optimizer, "cur_scale", None) or getattr(engine.optimizer, "loss_scale", None)
        else:
            skipped = accelerator.optimizer_step_was_skipped
            scale = accelerator.scaler.get_scale() if accelerator.scaler is not None else None
        out.record(role, float(loss.detach()), None if skipped or norm is None else float(norm), bool(skipped),
                   float(scale) if scale is not None else None)

    def sft_step(self, batch: SFTBatch) -> TrainOutput:
        device = self.ctx.device
        loss = self.model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                          labels=batch.labels.to(device), use_cache=False).loss
        out = TrainOutput(losses={}, tokens=batch.real_tokens, samples=batch.input_ids.shape[0])
        self._backward_step(loss, out)
        return out

    def rm_step(self, batch: PreferenceBatch) -> TrainOutput:
        loss, correct = self._pair_loss(batch, self.ctx.device)
        out = TrainOutput(losses={}, tokens=batch.real_tokens, samples=batch.chosen_ids.shape[0])
        self._backward_step(loss, out, train_mode_around_backward=False, hf_trainer=True)
        out.metrics["accuracy"] = float(correct.mean())
        return out

    def _pair_loss(self, batch: PreferenceBatch, device: torch.device):
        return self.model(batch.chosen_ids.to(device), batch.chosen_mask.to(device),
                          batch.rejected_ids.to(device), batch.rejected_mask.to(device))

    @torch.no_grad()
    def rm_scores(self, batch: PreferenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
        self.model.eval()
        device, n = self.ctx.device, batch.chosen_ids.shape[0]
        ids = torch.cat([batch.chosen_ids, batch.rejected_ids]).to(device)
        mask = torch.cat([batch.chosen_mask, batch.rejected_mask]).to(device)
        scores = self._unwrapped.end_scores(ids, mask)
        self.model.train()
        return scores[:n], scores[n:]

    def ppo_train(self, experiences: list[Experience]) -> TrainOutput:
        """learn(): `ppo_epochs` passes over the step's rollouts, each pass one minibatch of grad_accum
        micro-batches (train.batch_size = batch x grad_accum, minibatch_size = batch)."""
        ppo = self.options.ppo
        out = TrainOutput(losses={}, tokens=0, samples=0)
        micro = [self._micro_batch(e) for e in experiences]
        for _ in range(ppo.ppo_epochs):
            for experience, (p, advantages, returns, response_mask) in zip(experiences, micro, strict=True):
                seq, mask, start = p["seq"], p["mask"], p["start"]
                values, outputs = self.model(seq, mask)  # eval mode, as trlx's loss forward
                log_probs = gather_log_probs(outputs.logits[:, :-1], seq[:, 1:])[:, start:]
                values = values[:, :-1][:, start:]
                self._dtypes.update({"update/log_probs": str(log_probs.dtype), "update/values": str(values.dtype)})
                loss, pg_loss, vf_loss = _ppo_loss(log_probs, values, p["log_probs"], p["values"], advantages,
                                                   returns, response_mask, ppo)
                self._backward_step(loss, out)
                out.metrics.update(policy_loss=float(pg_loss), value_loss=float(vf_loss))
                out.tokens += experience.tokens
                out.samples += experience.samples
            if ppo.target is not None:  # AdaptiveKLController.update after each inner epoch
                samples = sum(e.samples for e in experiences)
                kl = sum(e.kl * e.samples for e in experiences) / samples
                error = max(-0.2, min(0.2, kl / ppo.target - 1))
                self._kl_coef *= 1 + error * samples / ppo.horizon
        out.metrics["kl_coef"] = self._kl_coef
        return out

    def _micro_batch(self, experience: Experience):
        """One rollout's tensors on the device, with its GAE advantages (whitened, as loss() does per
        micro-batch), returns and response mask."""
        ppo = self.options.ppo
        p = {k: v.to(self.ctx.device) if torch.is_tensor(v) else v for k, v in experience.payload.items()}
        response_mask = p["mask"][:, 1:][:, p["start"]:].to(p["values"].dtype)
        advantages, returns = gae(p["values"], p["rewards"], 0, ppo.gamma, ppo.lam)
        return p, _whiten(advantages), returns, response_mask


def _whiten(x: torch.Tensor) -> torch.Tensor:
    """trlx's whiten with global statistics across ranks (mean shifted out)."""
    stats = torch.tensor([x.sum(), (x * x).sum(), x.numel()], dtype=torch.float64, device=x.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stats)
    mean = stats[0] / stats[2]
    var = stats[1] / stats[2] - mean**2
    return ((x - mean) * torch.rsqrt(var.clamp(min=0) + 1e-8)).to(x.dtype)


def _ppo_loss(log_probs, values, old_log_probs, old_values, advantages, returns, mask, ppo):
    """PPOConfig.loss: clipped value loss and clipped policy loss, masked means over the response."""
    n = mask.sum().clamp(min=1)
    values_clipped = torch.max(torch.min(values, old_values + ppo.cliprange_value), old_values - ppo.cliprange_value)
    vf_loss = 0.5 * (torch.max((values - returns) ** 2, (values_clipped - returns) ** 2) * mask).sum() / n
    ratio = torch.exp((log_probs - old_log_probs) * mask)
    pg_loss = (torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - ppo.cliprange, 1 + ppo.cliprange))
               * mask).sum() / n
    return pg_loss + ppo.vf_coef * vf_loss, pg_loss.detach(), vf_loss.detach()
