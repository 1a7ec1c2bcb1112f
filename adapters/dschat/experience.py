"""DS-Chat's rollout and experience (dschat/rlhf/ppo_trainer.py `_generate_sequence`, `generate_experience`).

Lifetimes as upstream: all engines go to eval for generation, then actor and critic back to train mode
(`self.train()`), so the experience forwards of actor and critic run in train mode (dropout as
configured). Actor and reference are called without `use_cache=False`: each returns its logits and its
KV cache, and both outputs stay alive through the reward and critic forwards; log-probs are taken only
afterwards, in the logits' dtype (fp32 only with `compute_fp32_loss`).
"""

from __future__ import annotations

from typing import Any

import torch

from adapters.base import Experience, Rollout
from adapters.dschat.options import pad_is_eos
from adapters.rl_math import gather_log_probs, masked_mean, position_ids
from bench.run.data import EOS, PAD, PromptBatch, pad_is_eos_mask


class ExperienceMaker:
    """Rollout half of DSChatAdapter (a mixin)."""

    @torch.no_grad()
    def generate(self, batch: PromptBatch) -> Rollout:
        actor = self.engines["actor"]
        # _generate_sequence forces greedy decoding for model_type "llama" (a probability/nan error upstream met
        # with Llama-2's sampling config); every other architecture samples as configured
        do_sample = self.options.ppo.do_sample and self.spec.model.arch != "llama"
        sampling: dict[str, Any] = {"do_sample": do_sample}
        if do_sample:
            sampling.update(top_k=self.options.ppo.top_k, temperature=self.options.ppo.temperature)
        for engine in self.engines.values():  # DeepSpeedPPOTrainer.eval(); the Hybrid Engine switches here
            engine.eval()
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
        actor.train()  # DeepSpeedPPOTrainer.train(): actor and critic only
        self.engines["critic"].train()
        mask = (sequences != PAD).long()
        prompt_len = batch.input_ids.shape[1]
        return Rollout(
            sequences=sequences,
            attention_mask=mask,
            prompt_len=prompt_len,
            prompt_tokens=int(mask[:, :prompt_len].sum()),
            generated_tokens=int(mask[:, prompt_len:].sum()),
        )

    @torch.no_grad()
    def make_experience(self, rollout: Rollout) -> Experience:
        # generate_experience's `seq.not_equal(pad_token_id)`: where the pad is the EOS the EOS action leaves both
        # losses and the reward model reads the token before it; a Llama tokenizer's own [PAD] keeps it in
        seq = rollout.sequences
        mask = pad_is_eos_mask(seq) if pad_is_eos(self.spec.model.arch) else (seq != PAD).long()
        positions = position_ids(mask)
        output = self.engines["actor"](input_ids=seq, attention_mask=mask, position_ids=positions)
        output_ref = self.engines["ref"](input_ids=seq, attention_mask=mask, position_ids=positions)
        score = self.engines["reward"].forward_value(seq, mask, rollout.prompt_len)["chosen_end_scores"]
        values = self.engines["critic"].forward_value(seq, mask)["values"][:, :-1]
        logits, logits_ref = self._upcast(output.logits), self._upcast(output_ref.logits)
        log_probs = gather_log_probs(logits[:, :-1], seq[:, 1:])
        ref_log_probs = gather_log_probs(logits_ref[:, :-1], seq[:, 1:])
        self._dtypes.update({"experience/log_probs": str(log_probs.dtype), "experience/values": str(values.dtype),
                             "experience/reward_score": str(score.dtype)})
        start = rollout.prompt_len - 1
        action_mask = mask[:, 1:]
        payload = {
            "seq": seq, "mask": mask, "start": start, "log_probs": log_probs,
            "ref_log_probs": ref_log_probs, "values": values,
            "score": self.reward_scaling(score),  # reward.normalize (none upstream); update.py clips it
        }
        return Experience(
            payload=payload,
            reward=float(score.float().mean()),
            kl=float(masked_mean((log_probs - ref_log_probs).float()[:, start:], action_mask[:, start:])),
            value=float(masked_mean(values.float()[:, start:], action_mask[:, start:])),
            tokens=rollout.real_tokens,
            samples=rollout.samples,
        )
