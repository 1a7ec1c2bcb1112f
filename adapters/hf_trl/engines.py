"""TRL's trainers per stage, built as TRL's example scripts build them (trl/scripts/sft.py, reward_modeling.py,
examples/scripts/ppo/ppo.py, grpo.py), on the harness's models and synthetic data.

ZeRO goes through accelerate's DeepSpeed plugin as `accelerate launch --config_file deepspeed_zero{1,2,3}.yaml`
sets it: the launcher's environment variables (`launch_env`), read by TrainingArguments (which then creates the
plugin, and for ZeRO-3 the zero.Init context models are built in) and by the Accelerator PPOTrainer makes.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from adapters.lora_targets import peft_targets, suffixes
from bench.run.models import family_config
from bench.run.spec import RunSpec

MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}
UPSTREAM_CLIP = 1.0  # TrainingArguments.max_grad_norm


def launch_env(spec: RunSpec, device: torch.device) -> dict[str, str]:
    """What `accelerate launch` exports for TRL's accelerate configs (deepspeed_zero{1,2,3}.yaml: zero3_init_flag
    and zero3_save_16bit_model true at stage 3; offload devices none unless offload); zero=0: multi-process DDP
    (multi_gpu.yaml; `--cpu` on a host without an accelerator)."""
    env = {"ACCELERATE_MIXED_PRECISION": MIXED_PRECISION[spec.precision]}
    if device.type == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        if spec.zero == 0:
            env["ACCELERATE_USE_CPU"] = "true"
    if spec.zero > 0:
        offload = "cpu" if spec.offload else "none"
        env.update({
            "ACCELERATE_USE_DEEPSPEED": "true",
            "ACCELERATE_DEEPSPEED_ZERO_STAGE": str(spec.zero),
            "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": str(spec.grad_accum),
            "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": offload,
            "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": offload if spec.zero == 3 else "none",
            "ACCELERATE_DEEPSPEED_ZERO3_INIT": str(spec.zero == 3).lower(),
            "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": str(spec.zero == 3).lower(),
        })
    return env


def peft_config(spec: RunSpec, alpha: float, dropout: float, task_type: str) -> Any:
    """trl's get_peft_config(ModelConfig): LoraConfig(r, target_modules, lora_alpha, lora_dropout, bias="none");
    lora_targets fill target_modules (None: peft's default for the family: GPT-2's c_attn, Llama-style q_proj
    and v_proj), lora_alpha the alpha."""
    if not spec.lora:
        return None
    from peft import LoraConfig

    arch = spec.model.arch
    return LoraConfig(task_type=task_type, r=spec.lora,
                      target_modules=suffixes(peft_targets(spec.lora_target_set, arch), arch),
                      lora_alpha=spec.lora_alpha_or(alpha), lora_dropout=dropout, bias="none")


def training_args(spec: RunSpec, stage: str, device: torch.device, config_class: Any, **extra: Any) -> Any:
    """The common knobs as TrainingArguments: batch, accumulation, learning rate, steps, precision, clipping,
    gradient checkpointing, seed. logging_steps=1: the record needs every step's loss (TRL's scripts log every
    10). Nothing is saved during the stage (save_strategy="no"); nothing is reported anywhere."""
    lr = spec.stage_lr({"sft": "sft", "rm": "rm"}.get(stage, "actor"))
    return config_class(
        output_dir=tempfile.mkdtemp(prefix=f"trl-{stage}-"), per_device_train_batch_size=spec.batch,
        gradient_accumulation_steps=spec.grad_accum, learning_rate=lr, max_steps=spec.steps[stage], logging_steps=1,
        save_strategy="no", report_to="none", seed=spec.seed, bf16=spec.precision == "bf16",
        fp16=spec.precision == "fp16", use_cpu=device.type == "cpu", gradient_checkpointing=spec.grad_ckpt,
        max_grad_norm=spec.grad_clip_or(UPSTREAM_CLIP), disable_tqdm=True, dataloader_num_workers=0, **extra)


def _pretrained(spec: RunSpec, checkpoint: str | None) -> str | None:
    """The directory a model loads from: the stage's checkpoint, else a local model.path, else none (random)."""
    return os.path.dirname(checkpoint) if checkpoint else spec.model.path


def causal_lm(spec: RunSpec, checkpoint: str | None) -> torch.nn.Module:
    """AutoModelForCausalLM from the stage's checkpoint directory or model.path (from_pretrained, as the scripts
    load), else from the harness's config with random weights (from_config: inside zero.Init under ZeRO-3, as
    from_pretrained)."""
    from transformers import AutoModelForCausalLM

    source = _pretrained(spec, checkpoint)
    if source:
        return AutoModelForCausalLM.from_pretrained(source, local_files_only=True)
    torch.manual_seed(spec.seed)
    return AutoModelForCausalLM.from_config(family_config(spec.model))


def sequence_classifier(spec: RunSpec, checkpoint: str | None) -> torch.nn.Module:
    """AutoModelForSequenceClassification(num_labels=1): TRL's reward and value models (the backbone + a
    bias-free `score` head; the score is read at the last non-pad token)."""
    from transformers import AutoModelForSequenceClassification

    source = _pretrained(spec, checkpoint)
    if source:
        return AutoModelForSequenceClassification.from_pretrained(source, num_labels=1, local_files_only=True)
    torch.manual_seed(spec.seed)
    config = family_config(spec.model)
    config.num_labels = 1
    return AutoModelForSequenceClassification.from_config(config)


# GRPOTrainer (0.19.1) asks the policy for `logits_to_keep` logits; transformers 4.51.3's GPT2LMHeadModel has no such
# argument (its **kwargs swallow it) and returns every position's logits, so TRL's slice no longer lines up with the
# tokens (RuntimeError: size 16 vs 30). An upstream incompatibility, recorded as an upstream defect of GRPO runs.
GRPO_DEFECT = {
    "id": "trl-grpo-logits-to-keep-ignored-by-gpt2",
    "where": ("trl/trainer/grpo_trainer.py _get_per_token_logps: model(..., logits_to_keep=k + 1) with transformers "
              "4.51.3 GPT2LMHeadModel.forward, which takes no logits_to_keep"),
    "effect": "GRPO's first update fails: log-probs of every position against the answer tokens only (shape mismatch)",
    "handling": ("the policy is GPT2LMHeadModel with a forward that honours logits_to_keep (the last k hidden states "
                 "through lm_head, as later transformers' GPT-2 and the Llama-family models do); weights and "
                 "arithmetic unchanged"),
}


def grpo_policy(spec: RunSpec, checkpoint: str | None) -> torch.nn.Module:
    """The causal LM for GRPO: a GPT-2 model's forward made to honour logits_to_keep (GRPO_DEFECT); the other
    families' transformers classes take it themselves."""
    if spec.model.arch != "gpt2":
        return causal_lm(spec, checkpoint)
    from transformers import GPT2LMHeadModel
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    class GPT2KeepingLogits(GPT2LMHeadModel):
        def forward(self, input_ids: Any = None, attention_mask: Any = None, logits_to_keep: int = 0,
                    **kwargs: Any) -> Any:
            if not logits_to_keep or kwargs.get("labels") is not None:
                return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            kwargs["return_dict"] = True
            out = self.transformer(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            logits = self.lm_head(out.last_hidden_state[:, -logits_to_keep:, :])
            return CausalLMOutputWithCrossAttentions(logits=logits, past_key_values=out.past_key_values,
                                                     hidden_states=out.hidden_states, attentions=out.attentions)

    source = _pretrained(spec, checkpoint)
    if source:
        return GPT2KeepingLogits.from_pretrained(source, local_files_only=True)
    torch.manual_seed(spec.seed)
    return GPT2KeepingLogits._from_config(family_config(spec.model))


# PPOTrainer.__init__ never calls Trainer.__init__, whose set_seed(args.seed) seeds Python's, numpy's and torch's
# generators for TRL's other trainers: it seeds torch itself, but shuffles each PPO epoch's minibatches with
# np.random.permutation on numpy's global generator, never seeded, so two runs with one seed differ.
PPO_SEED_DEFECT = {
    "id": "trl-ppo-numpy-shuffle-unseeded",
    "where": ("trl/trainer/ppo_trainer.py PPOTrainer.__init__ (no Trainer.__init__, so no set_seed) and train() "
              "(b_inds = np.random.permutation(args.local_batch_size))"),
    "effect": ("minibatch order differs run to run under one seed: with num_mini_batches=1 only the summation order "
               "(last-digit loss differences), with more minibatches which samples share an optimizer step"),
    "handling": "the harness calls transformers.set_seed(seed) before building PPOTrainer, as Trainer.__init__ would",
}


# HF Trainer (4.51.3) builds its optimizer with a decay and a no-decay group and its LR scheduler on it before
# DeepSpeed wraps them; DeepSpeed 0.19.8 then removes empty groups in place (engine.py, "Removing param_group that
# has no 'params'"), and torch 2.13's scheduler zips its per-group rates with the groups strictly: with LoRA (no
# trainable bias or norm: an empty no-decay group) the first lr_scheduler.step() fails. Older torch truncated the zip.
EMPTY_GROUP_DEFECT = {
    "id": "hf-trainer-deepspeed-empty-param-group-scheduler",
    "where": ("transformers/trainer.py create_optimizer (decay / no-decay groups) + deepspeed/runtime/engine.py "
              "_configure_basic_optimizer (removes empty groups) + torch LRScheduler._update_lr (zip strict=True)"),
    "effect": "LoRA under DeepSpeed: the first scheduler step raises ValueError (zip() argument 2 is longer)",
    "handling": ("the empty groups are removed when the optimizer is created, before the scheduler is built on it "
                 "(what DeepSpeed does a moment later); no parameter changes group"),
}


def without_empty_groups(create_optimizer: Any) -> Any:
    """Trainer.create_optimizer, its empty parameter groups dropped (EMPTY_GROUP_DEFECT)."""

    def create(self: Any, *args: Any, **kwargs: Any) -> Any:
        optimizer = create_optimizer(self, *args, **kwargs)
        optimizer.param_groups[:] = [group for group in optimizer.param_groups if group["params"]]
        return optimizer

    return create
