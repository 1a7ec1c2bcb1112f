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
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

from adapters.base import Experience, TrainOutput
from adapters.grad_norm import global_grad_norm
from adapters.rl_math import gae, gather_log_probs
from adapters.trlx.experience import PPOElement
from bench.run.data import PAD, PreferenceBatch, SFTBatch, pad_is_eos_mask


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
        self.scheduler.step()  # learn(): after opt.step(); HF's Trainer (RM) as well
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
        """learn() over the rollout store (num_rollouts samples per rank, from the step's generate calls):
        `ppo_epochs` passes, each over a new shuffled loader of minibatches of train.batch_size = batch x
        grad_accum samples (collated: padded to the minibatch's longest), each split into grad_accum
        micro-batches of `batch`; opt.step() per minibatch, the adaptive KL controller after each pass."""
        ppo = self.options.ppo
        out = TrainOutput(losses={}, tokens=0, samples=0)
        store = [element for e in experiences for element in e.payload]
        size = self.spec.batch * self.spec.grad_accum
        for _ in range(ppo.ppo_epochs):
            # create_train_dataloader: a new shuffled loader every pass, drawn from torch's global generator
            for indices in DataLoader(range(len(store)), batch_size=size, shuffle=True):
                minibatch = collate([store[i] for i in indices.tolist()])
                for micro in range(0, size, self.spec.batch):
                    self._micro_step({k: v[micro:micro + self.spec.batch] for k, v in minibatch.items()}, out)
            if ppo.target is not None:  # post_backward_callback: kl_ctl.update(mean_kl, n_steps=batch_size)
                samples = sum(e.samples for e in experiences)
                kl = sum(e.kl * e.samples for e in experiences) / samples
                error = max(-0.2, min(0.2, kl / ppo.target - 1))
                self._kl_coef *= 1 + error * size / ppo.horizon
        out.metrics["kl_coef"] = self._kl_coef
        return out

    def _micro_step(self, micro: dict[str, torch.Tensor], out: TrainOutput) -> None:
        """loss() on one micro-batch: GAE and whitening over its padded spans, the joint loss from a forward in
        eval mode over prompt + answer, masked by the answer tokens (`attention_mask[:, start + 1:end + 1]`)."""
        ppo = self.options.ppo
        micro = {k: v.to(self.ctx.device) for k, v in micro.items()}
        tokens, old_values = micro["tokens"], micro["values"]
        start, length = micro["query_width"][0].item() - 1, old_values.shape[1]
        advantages, returns = gae(old_values, micro["rewards"], 0, ppo.gamma, ppo.lam)
        mask = pad_is_eos_mask(tokens)
        values, outputs = self.model(tokens, mask)
        log_probs = gather_log_probs(outputs.logits[:, :-1], tokens[:, 1:])[:, start:start + length]
        values = values[:, :-1][:, start:start + length]
        self._dtypes.update({"update/log_probs": str(log_probs.dtype), "update/values": str(values.dtype)})
        response_mask = mask[:, start + 1:start + 1 + length].to(values.dtype)
        # upstream's process group: more than one process, or DeepSpeed (trlx's ZeRO configs) for one
        grouped = self.ctx.world_size > 1 or self.spec.zero >= 1
        loss, pg_loss, vf_loss = _ppo_loss(log_probs, values, micro["log_probs"], old_values,
                                           whiten(advantages, grouped), returns, response_mask, ppo)
        self._backward_step(loss, out)
        out.metrics.update(policy_loss=float(pg_loss), value_loss=float(vf_loss))
        out.tokens += int((tokens != PAD).sum())
        out.samples += tokens.shape[0]


def optimizer_steps(num_rollouts: int, batch_size: int, ppo_epochs: int) -> int:
    """Optimizer steps of one learning phase: ppo_epochs passes over a loader of ceil(num_rollouts / batch_size)
    minibatches, opt.step() after each."""
    return ppo_epochs * -(-num_rollouts // batch_size)


def collate(elements: list[PPOElement]) -> dict[str, torch.Tensor]:
    """ppo_collate_fn: the prompts (all one width here), the answers right padded to the longest with the pad
    id, the spans padded to the longest with zeros; `tokens` = prompt + answer."""
    responses = pad_sequence([e.response for e in elements], batch_first=True, padding_value=PAD)
    queries = torch.stack([e.query for e in elements])
    spans = {key: pad_sequence([getattr(e, key) for e in elements], batch_first=True, padding_value=0.0)
             for key in ("log_probs", "values", "rewards")}
    return {"tokens": torch.cat([queries, responses], dim=1), **spans,
            "query_width": torch.full((len(elements),), queries.shape[1])}


def whiten(x: torch.Tensor, grouped: bool = False) -> torch.Tensor:
    """trlx's whiten (mean shifted out, `distributed=True`), whose branch is whether a process group exists
    (`dist.is_initialized()`). `grouped`: upstream's run would have one, with more than one process or under
    DeepSpeed, which starts one for a single process too: get_global_statistics' mean and biased variance.
    Without (accelerate's single-process run without DeepSpeed starts none): torch.var_mean's unbiased variance."""
    if not grouped:
        var, mean = torch.var_mean(x)
        return (x - mean) * torch.rsqrt(var + 1e-8)
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
