"""The reference's rollout and experience: Hugging Face `generate`, then one no-grad forward of each model.

The simplest correct order: actor logits -> log-probs, and the logits are dropped before the reference
runs; reference log-probs; the reward model's score; the critic's values. Nothing else stays alive, so the
experience peak is one model's logits at a time (the frameworks keep more: see their fidelity tables).
"""

from __future__ import annotations

import torch

from adapters.base import Experience, Rollout
from adapters.reference.models import end_scores
from adapters.rl_math import gather_log_probs, masked_mean, position_ids
from bench.run.data import EOS, PAD, PromptBatch


class ExperienceMaker:
    """Rollout half of ReferenceAdapter (a mixin)."""

    @torch.no_grad()
    def generate(self, batch: PromptBatch) -> Rollout:
        actor = self.modules["actor"]
        actor.eval()
        ppo = self.options.ppo
        with self.autocast():
            sequences = actor.generate(
                batch.input_ids.to(self.ctx.device),
                attention_mask=batch.attention_mask.to(self.ctx.device),
                max_new_tokens=self.spec.answer_len,
                do_sample=True, top_k=ppo.top_k, temperature=ppo.temperature,
                pad_token_id=PAD, eos_token_id=EOS,
                suppress_tokens=[PAD],  # a sampled pad id would read as padding inside the answer
                synced_gpus=self._fsdp and self.ctx.world_size > 1,  # sharded: every rank runs every forward
            )
        actor.train()
        mask = (sequences != PAD).long()
        prompt_len = batch.input_ids.shape[1]
        return Rollout(sequences=sequences, attention_mask=mask, prompt_len=prompt_len,
                       prompt_tokens=int(mask[:, :prompt_len].sum()),
                       generated_tokens=int(mask[:, prompt_len:].sum()))

    def _log_probs(self, role: str, seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits = self.models[role](input_ids=seq, attention_mask=mask, position_ids=position_ids(mask),
                                   use_cache=False).logits
        return gather_log_probs(logits[:, :-1], seq[:, 1:])

    @torch.no_grad()
    def make_experience(self, rollout: Rollout) -> Experience:
        seq, mask = rollout.sequences, rollout.attention_mask
        positions = position_ids(mask)
        with self.autocast():
            log_probs = self._log_probs("actor", seq, mask)
            ref_log_probs = self._log_probs("ref", seq, mask)
            score = end_scores(self.models["reward"](seq, mask, positions), mask)
            values = self.models["critic"](seq, mask, positions)[:, :-1]
        self._dtypes.update({"experience/log_probs": str(log_probs.dtype), "experience/values": str(values.dtype),
                             "experience/reward_score": str(score.dtype)})
        start = rollout.prompt_len - 1
        action_mask = mask[:, 1:]
        payload = {"seq": seq, "mask": mask, "start": start, "log_probs": log_probs.float(),
                   "ref_log_probs": ref_log_probs.float(), "score": self.reward_scaling(score.float()),
                   "values": values.float()}
        return Experience(
            payload=payload,
            reward=float(score.float().mean()),
            kl=float(masked_mean((log_probs - ref_log_probs).float()[:, start:], action_mask[:, start:])),
            value=float(masked_mean(values.float()[:, start:], action_mask[:, start:])),
            tokens=rollout.real_tokens,
            samples=rollout.samples,
        )
