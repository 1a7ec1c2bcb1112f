"""ColossalChat's rollout and experience (coati/experience_maker/naive.py NaiveExperienceMaker.make_experience).

Lifetimes as upstream: every model in eval mode; after generation `torch.cuda.empty_cache()`; actor and
reference logits forwards (use_cache=False) run in chunks of `logits_forward_batch_size` and are joined
with `torch.cat` into full-batch [B, T, V] logits, which stay referenced while the reward model and the
critic run (the function never drops them); log-probs are taken from the joined logits in their dtype.
The reward model scores the right-padded layout; the score is clipped and added on every action token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from adapters.base import Experience, Rollout
from adapters.colossalai import generation
from adapters.rl_math import gae, gather_log_probs, masked_mean, position_ids
from bench.run.data import EOS, PAD, PromptBatch


class ExperienceMaker:
    """Rollout half of ColossalAdapter (a mixin)."""

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

    def _joined_logits(self, role: str, seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Full-batch logits of `role`, forwarded in chunks and joined, as NaiveExperienceMaker does."""
        chunk = self.options.ppo.logits_forward_batch_size
        parts = []
        for i in range(0, seq.shape[0], chunk):
            s, m = seq[i:i + chunk], mask[i:i + chunk]
            parts.append(self._logits(role, input_ids=s, attention_mask=m, position_ids=position_ids(m),
                                      use_cache=False)[0])
        return torch.cat(parts)

    @torch.no_grad()
    def make_experience(self, rollout: Rollout) -> Experience:
        for model in self.models.values():
            model.eval()
        if self.ctx.device.type == "cuda":
            torch.cuda.empty_cache()
        ppo = self.options.ppo
        seq, mask, prompt_len = rollout.sequences, rollout.attention_mask, rollout.prompt_len
        num_actions = seq.shape[1] - prompt_len
        answers = seq[:, prompt_len:]
        # Actions up to and including the first stop token.
        action_mask = F.pad(((answers == EOS).long().cumsum(1) == 0)[:, :-1], (1, 0), value=True)
        action_mask = action_mask & (mask[:, prompt_len:] > 0)
        actor_output = self._joined_logits("actor", seq, mask)  # coati runs these under inference_mode
        base_model_output = self._joined_logits("ref", seq, mask)
        log_probs = gather_log_probs(actor_output[:, :-1], seq[:, 1:])[:, -num_actions:]
        ref_log_probs = gather_log_probs(base_model_output[:, :-1], seq[:, 1:])[:, -num_actions:]
        # actor_output and base_model_output stay referenced through the reward and critic calls, as upstream.
        score = self.models["reward"](*_right_padded(seq, mask))
        values = self.models["critic"](seq, mask, position_ids(mask))[:, -num_actions:] * action_mask
        self._dtypes.update({"experience/log_probs": str(log_probs.dtype), "experience/values": str(values.dtype),
                             "experience/reward_score": str(score.dtype)})
        action_mask_f = action_mask.to(log_probs.dtype)
        log_ratio = log_probs - ref_log_probs
        rewards = -ppo.kl_coef * log_ratio * action_mask_f
        scaled = self.reward_scaling(score)  # reward.normalize (none upstream), before coati's clip
        rewards += scaled.clamp(-ppo.reward_clip, ppo.reward_clip)[:, None].to(rewards.dtype) * action_mask_f
        advantages, _ = gae(values.to(rewards.dtype), rewards, 0, ppo.gamma, ppo.lam)  # every action position
        # the finished experience goes to the host (naive.py: Experience(sequences.cpu(), ...)); the update moves
        # each minibatch back
        payload = {key: value.cpu() for key, value in (
            ("seq", seq), ("mask", mask), ("action_mask", action_mask_f), ("log_probs", log_probs),
            ("values", values), ("advantages", advantages))}
        del actor_output, base_model_output
        return Experience(
            payload=payload,
            reward=float(score.float().mean()),
            kl=float(masked_mean(log_ratio.float(), action_mask_f.float())),
            value=float(masked_mean(values.float(), action_mask_f.float())),
            tokens=rollout.real_tokens,
            samples=rollout.samples,
        )


def _right_padded(seq: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's real tokens moved to the front, as coati converts rollouts for the reward model."""
    order = torch.argsort((mask == 0).long(), dim=1, stable=True)
    return seq.gather(1, order), mask.gather(1, order)
