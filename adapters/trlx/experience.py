"""Trlx's rollout and experience (AcceleratePPOTrainer.make_experience, examples/hh/ppo_hh.py reward_fn).

Order and lifetimes as upstream: generate; gather every rank's samples to rank 0 (padded across
processes); the reward function scores them there first, in micro-batches, in the run's precision; scores
are clipped to +-cliprange_reward, the running moments see the clipped scores, then they are divided by
the running std and scattered back. Only then the policy forward: it returns logits, values, every hidden
state and the KV cache, all alive while the reference runs (forward_hydra, the peft-disabled model or the
full copy). Log-probs are taken afterwards in the logits' dtype, and the experience moves to the host, as
trlx's rollout store keeps it. A rollout keeps its own width: prompt plus the batch's longest answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from adapters.base import Experience, Rollout
from adapters.rl_math import filled_position_ids, gather_log_probs
from bench.run.data import EOS, PAD, PromptBatch, pad_is_eos_mask


@dataclass
class PPOElement:
    """trlx's PPORLElement: one sample as the rollout store keeps it (host memory)."""

    query: torch.Tensor  # the prompt's tokens (left padded)
    response: torch.Tensor  # the answer's tokens, right padded to its rollout's longest answer
    log_probs: torch.Tensor  # the stored span (stored_span): policy log-probs
    values: torch.Tensor
    rewards: torch.Tensor


class ExperienceMaker:
    """Rollout half of TrlxAdapter (a mixin)."""

    @torch.no_grad()
    def generate(self, batch: PromptBatch) -> Rollout:
        ppo = self.options.ppo
        lm = self._unwrapped.base_model
        with self.accelerator.autocast():
            sequences = lm.generate(
                input_ids=batch.input_ids.to(self.ctx.device), attention_mask=batch.attention_mask.to(self.ctx.device),
                max_new_tokens=self.spec.answer_len, do_sample=True, top_k=ppo.top_k, top_p=ppo.top_p,
                pad_token_id=PAD, eos_token_id=EOS, suppress_tokens=[PAD],
                synced_gpus=self.spec.zero == 3 and self.ctx.world_size > 1,
            )
        prompt_len = batch.input_ids.shape[1]
        # Re-tokenised outputs padded to the longest in the batch: trailing all-pad columns go.
        real = (sequences[:, prompt_len:] != PAD).any(0).nonzero()
        width = prompt_len + (int(real.max()) + 1 if len(real) else 0)
        sequences = sequences[:, :width]
        mask = (sequences != PAD).long()
        return Rollout(sequences=sequences, attention_mask=mask, prompt_len=prompt_len,
                       prompt_tokens=int(mask[:, :prompt_len].sum()),
                       generated_tokens=int(mask[:, prompt_len:].sum()))

    def _score(self, seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """create_reward_fn: the RM on its device, in micro-batches of reward_batch_size."""
        device, chunk = self.reward_device, self.options.reward_batch_size
        scores = [self.reward_model.end_scores(seq[i:i + chunk].to(device), mask[i:i + chunk].to(device))
                  for i in range(0, seq.shape[0], chunk)]
        return torch.cat(scores).float().to(seq.device)

    def _scores(self, seq: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather every rank's samples to rank 0 (padded across processes), score them there, clip, update the
        running moments, scale, scatter each rank's share back. Returns (RM scores, clipped and scaled)."""
        ppo = self.options.ppo
        world = self.ctx.world_size
        if world > 1:
            width = torch.tensor([seq.shape[1]], device=seq.device)
            dist.all_reduce(width, op=dist.ReduceOp.MAX)
            pad = int(width) - seq.shape[1]
            seq, mask = F.pad(seq, (0, pad), value=PAD), F.pad(mask, (0, pad), value=0)
            gathered = [torch.empty_like(seq) for _ in range(world)] if self.ctx.rank == 0 else None
            masks = [torch.empty_like(mask) for _ in range(world)] if self.ctx.rank == 0 else None
            dist.gather(seq, gathered, dst=0)
            dist.gather(mask, masks, dst=0)
        else:
            gathered, masks = [seq], [mask]
        both = torch.empty(2, seq.shape[0], device=seq.device)
        chunks = None
        if self.ctx.rank == 0:
            rm_scores = self._score(torch.cat(gathered), torch.cat(masks))
            scaling = self.reward_scaling
            # reward.normalize=zscore (a harness extension) before trlx's clip; its own scalings after it
            scores = scaling(rm_scores) if scaling.mode == "zscore" else rm_scores
            clipped = scores.clamp(-ppo.cliprange_reward, ppo.cliprange_reward)
            scaling.moments.update(clipped)
            if scaling.mode == "running":
                clipped = clipped / scaling.moments.std
            elif scaling.mode == "ref":
                clipped = clipped / scaling.moments.first_std
            chunks = [pair.contiguous() for pair in torch.stack([rm_scores, clipped]).split(seq.shape[0], dim=1)]
        if world > 1:
            dist.scatter(both, chunks, src=0)
        else:
            both = chunks[0]
        return both[0], both[1]

    def _reference_logits(self, seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.ref_model is not None:
            return self.ref_model(input_ids=seq, attention_mask=mask, position_ids=filled_position_ids(mask)).logits
        return self.model(seq, mask, reference=True)

    @torch.no_grad()
    def make_experience(self, rollout: Rollout) -> Experience:
        seq, start = rollout.sequences, rollout.prompt_len - 1
        rm_scores, scores = self._scores(seq, rollout.attention_mask)
        # make_experience's `all_tokens.not_equal(pad_token_id)`: the pad is the EOS (AccelerateRLTrainer sets
        # the missing pad token to "<|padding|>", which GPT-2's and GPT-J's tokenizers resolve to <|endoftext|>)
        mask = pad_is_eos_mask(seq)
        values, outputs = self.model(seq, mask)  # logits, hidden states and KV cache: alive on purpose
        ref_logits = self._reference_logits(seq, mask)
        log_probs = gather_log_probs(outputs.logits[:, :-1], seq[:, 1:])
        ref_log_probs = gather_log_probs(ref_logits[:, :-1], seq[:, 1:])
        self._dtypes.update({"experience/log_probs": str(log_probs.dtype), "experience/values": str(values.dtype),
                             "experience/reward_score": str(next(self.reward_model.parameters()).dtype)
                             if self.reward_model is not None else "rank 0"})
        log_ratio, span, rewards = stored_rewards(log_probs, ref_log_probs, mask, start, scores, self._kl_coef)
        response_values = values[:, :-1][:, start:]
        # trlx's rollout store: per sample, on the host, its prompt, its answer (padded to this rollout's longest)
        # and its own span of log-probs, values and rewards (update.collate pads a minibatch's spans with zeros)
        lengths = span.sum(1).long().tolist()
        payload = [PPOElement(query=seq[i, :rollout.prompt_len].cpu(), response=seq[i, rollout.prompt_len:].cpu(),
                              log_probs=log_probs[i, start:start + n].cpu(), values=response_values[i, :n].cpu(),
                              rewards=rewards[i, :n].cpu())
                   for i, n in enumerate(lengths)]
        kl = float((log_ratio[:, start:].float() * span).sum(1).mean())
        value = float((response_values.float() * span).sum() / span.sum().clamp(min=1))
        del outputs
        return Experience(payload=payload, reward=float(rm_scores.mean()), kl=kl, value=value,
                          tokens=rollout.real_tokens, samples=rollout.samples)


def stored_span(mask: torch.Tensor, start: int) -> torch.Tensor:
    """[B, width - 1 - start]: which response entries make_experience stores per row, from `start` (the last prompt
    position) to `ends = start + attention_mask[:, start:].sum(1) + 1`, cut at the log-probs' width. A row that
    ends in EOS before the batch's longest stores its answer, the EOS action and one pad action (its last entry,
    where the score lands); the longest stores its answer and the EOS action; a row without EOS, its answer."""
    width = mask.shape[1] - 1
    ends = (start + mask[:, start:].sum(1) + 1).clamp(max=width)
    columns = torch.arange(start, width, device=mask.device)
    return (columns[None, :] < ends[:, None]).long()


def stored_rewards(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor, start: int,
                   scores: torch.Tensor, kl_coef: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """make_experience's rewards: -kl_coef x the log-ratio, each action masked by its preceding token's mask
    (`attention_mask[:, :-1]`), over the stored span, the score added to the span's last entry. Returns
    (log_ratio [B, width - 1], span and rewards [B, width - 1 - start])."""
    log_ratio = (log_probs - ref_log_probs) * mask[:, :-1].to(log_probs.dtype)
    span = stored_span(mask, start).to(log_probs.dtype)
    rewards = -kl_coef * log_ratio[:, start:] * span
    last = span.sum(1).long() - 1  # "Final reward given at EOS": the last stored entry
    rewards[torch.arange(len(last)), last] += scores.to(rewards.dtype)
    return log_ratio, span, rewards
