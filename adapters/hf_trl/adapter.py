"""Hugging Face TRL on the harness's interface: TRL's own trainers, run as they are, measured phase by phase.

Unlike the other adapters this one re-creates nothing: SFTTrainer, RewardTrainer, PPOTrainer and GRPOTrainer
are built as TRL's scripts build them (engines.py) and their own train() runs in a second thread
(driver.LoopDriver). The harness's phase calls let that loop run from one seam to the next (seams.py): a
training step ends at its log; PPO's and GRPO's generation ends where unwrap_model_for_generation exits, their
experience where the update's first forward begins (PPO) or where _generate_and_score_completions returns
(GRPO). What each phase returns (the rollout, scores, losses) is read from what TRL's calls returned and
logged. The TRL fidelity table (docs/frameworks/trl.md) lists every wrapped name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from adapters.base import Adapter, Experience, ModelState, RankContext, Rollout, TrainOutput
from adapters.deepspeed_state import held_bytes, zero3_masters
from adapters.hf_trl import engines, examples
from adapters.hf_trl.driver import LoopDriver
from adapters.hf_trl.options import TrlOptions
from adapters.hf_trl.seams import Captured, StepSeams, capture, generation_seam, patched, update_seam
from adapters.state_bytes import model_state
from bench.measure.params import ParamCounts
from bench.run.data import EOS, PAD, PreferenceBatch, PromptBatch, SFTBatch, SyntheticData
from bench.run.models import count_params
from bench.run.spec import RunSpec


def _answer_mask(answers: torch.Tensor) -> torch.Tensor:
    """Real answer tokens: up to and including the first EOS (generation pads after it)."""
    eos = (answers == EOS).int()
    after = (eos.cumsum(1) - eos) > 0
    return ((answers != PAD) & ~after).long()


class TrlAdapter(Adapter):
    update_passes_option = "num_ppo_epochs"  # PPOConfig's epochs over each batch of rollouts (default 4)

    def __init__(self, spec: RunSpec, ctx: RankContext) -> None:
        super().__init__(spec, ctx)
        self.options = TrlOptions.validate(spec)
        os.environ.update(engines.launch_env(spec, ctx.device))
        if not dist.is_initialized():  # what accelerate would start, named: gloo on a host, nccl on GPUs
            dist.init_process_group(backend="nccl" if ctx.device.type == "cuda" else "gloo")
        # Every library the run uses is imported now, inside the measured `imports` phase.
        import datasets  # noqa: F401
        import trl  # noqa: F401

        if spec.lora:
            import peft  # noqa: F401
        self.tokenizer = examples.tokenizer(spec.model.vocab)
        grpo = self.options.grpo
        self.phase_roles = {**Adapter.phase_roles,
                            "ppo": {"generation": ("actor",), "experience": ("actor", "ref", "critic", "reward"),
                                    "training": ("actor", "critic")},
                            # GRPO: the reference runs only with a KL term; the reward is a function
                            "grpo": {"generation": ("actor",), "experience": ("ref",) if grpo.beta else (),
                                     "training": ("actor",)}}
        self.trainer: Any = None
        self.driver: LoopDriver | None = None
        self.seams: StepSeams | None = None
        self.captured = Captured()
        self._patches = contextlib.ExitStack()
        self._stage = ""
        self._counts: dict[str, ParamCounts] = {}
        self._notes: list[str] = []

    # ----------------------------------------------------------------- building
    def _rows(self) -> examples.Rows:
        return examples.Rows(self.spec.model.vocab, self.spec.prompt_len, self.spec.answer_len, self.spec.batch,
                             self.spec.seed, self.ctx.world_size)

    def build_trainer(self, stage: str, init: dict[str, str]) -> Any:
        """The stage's TRL trainer as TRL's scripts build it, with no seam (plain.py runs it so)."""
        import trl

        self._stage = stage
        spec, rows, lora = self.spec, self._rows(), self.options.lora
        if self._empty_group_defect:
            from transformers import Trainer

            self._patches.enter_context(patched(Trainer, "create_optimizer", engines.without_empty_groups))
        if stage == "sft":
            args = engines.training_args(spec, stage, self.ctx.device, trl.SFTConfig)
            return trl.SFTTrainer(model=engines.causal_lm(spec, init.get("sft")), args=args,
                                  processing_class=self.tokenizer,
                                  train_dataset=examples.dataset(rows.sft(spec.steps[stage] * spec.grad_accum)),
                                  peft_config=engines.peft_config(spec, lora.alpha, lora.dropout, "CAUSAL_LM"))
        if stage == "rm":
            args = engines.training_args(spec, stage, self.ctx.device, trl.RewardConfig)
            return trl.RewardTrainer(
                model=engines.sequence_classifier(spec, init.get("rm")), args=args, processing_class=self.tokenizer,
                train_dataset=examples.dataset(rows.preferences(spec.steps[stage] * spec.grad_accum)),
                peft_config=engines.peft_config(spec, lora.alpha, lora.dropout, "SEQ_CLS"))
        if stage == "ppo":
            return self._ppo_trainer(init, rows, trl.PPOConfig, trl.PPOTrainer)
        return self._grpo_trainer(init, rows, trl.GRPOConfig, trl.GRPOTrainer)

    def setup(self, stage: str, init: dict[str, str]) -> None:
        from transformers.trainer_callback import PrinterCallback, ProgressCallback

        self.trainer = self.build_trainer(stage, init)
        self.driver = LoopDriver(self.trainer.train, step_seams=("train_begin", "step_end"))
        # HF Trainer logs a step after its on_step_end; TRL's PPO loop logs before it
        self.seams = StepSeams(self.driver, step_end_at="on_step_end" if stage == "ppo" else "on_log")
        self.trainer.add_callback(self.seams)
        for printer in (PrinterCallback, ProgressCallback):  # display only: the harness shows its own progress
            self.trainer.remove_callback(printer)
        if stage == "ppo":
            self._ppo_seams()
        elif stage == "grpo":
            self._grpo_seams()
        self._wrap_training_step()
        self._count(stage)
        self.driver.advance("train_begin")  # the trainer's set-up inside train() (engine wrapping) is init's

    def _ppo_trainer(self, init: dict[str, str], rows: examples.Rows, config: Any, trainer: Any) -> Any:
        """examples/scripts/ppo/ppo.py: policy and (without LoRA) reference from the SFT model, value and reward
        models from the RM; PPOTrainer builds one optimizer over policy and value model."""
        spec, ppo, lora = self.spec, self.options.ppo, self.options.lora
        args = engines.training_args(
            spec, "ppo", self.ctx.device, config, total_episodes=spec.steps["ppo"] * spec.batch * self.ctx.world_size,
            num_ppo_epochs=ppo.num_ppo_epochs, num_mini_batches=ppo.num_mini_batches, kl_coef=ppo.kl_coef,
            kl_estimator=ppo.kl_estimator, cliprange=ppo.cliprange, vf_coef=ppo.vf_coef,
            cliprange_value=ppo.cliprange_value, gamma=ppo.gamma, lam=ppo.lam, whiten_rewards=ppo.whiten_rewards,
            temperature=ppo.temperature, stop_token=ppo.stop_token, missing_eos_penalty=ppo.missing_eos_penalty,
            response_length=spec.answer_len, num_sample_generations=0)
        policy = engines.causal_lm(spec, init.get("sft"))
        ref = None if spec.lora else engines.causal_lm(spec, init.get("sft"))
        value = engines.sequence_classifier(spec, init.get("rm"))
        reward = engines.sequence_classifier(spec, init.get("rm"))
        self.tokenizer.padding_side = "left"  # the script's tokenizer: prompts left-padded for generation
        from transformers import set_seed

        set_seed(spec.seed)  # engines.PPO_SEED_DEFECT: what Trainer.__init__ does for TRL's other trainers
        prompts = examples.dataset({"input_ids": rows.prompts(spec.steps["ppo"])})
        if not init.get("sft"):
            self._notes.append("policy and reference start from random base weights (no SFT checkpoint)")
        return trainer(args=args, processing_class=self.tokenizer, model=policy, ref_model=ref, reward_model=reward,
                       train_dataset=prompts, value_model=value, eval_dataset=prompts.select(range(spec.batch)),
                       peft_config=engines.peft_config(spec, lora.alpha, lora.dropout, "CAUSAL_LM"))

    def _ppo_seams(self) -> None:
        """trl.trainer.ppo_trainer's names wrapped (seams.py) for the trainer's lifetime."""
        import trl.trainer.ppo_trainer as ppo_module

        trained, captured = self.trainer.model, self.captured
        for name, wrapper in (
                ("unwrap_model_for_generation", generation_seam(self.driver, captured)),
                ("batch_generation", capture(captured, "batch_generation", lambda a, out: (a[1], out[0]))),
                ("forward", update_seam(self.driver, captured, lambda: trained)),
                ("get_reward", capture(captured, "get_reward", lambda a, out: (a[0], out[0], out[1]),
                                       when=lambda: captured.generated)),
                ("selective_log_softmax", capture(captured, "logprobs", lambda a, out: out,
                                                  when=lambda: captured.generated))):
            self._patches.enter_context(patched(ppo_module, name, wrapper))

    def _grpo_trainer(self, init: dict[str, str], rows: examples.Rows, config: Any, trainer: Any) -> Any:
        """trl/scripts/grpo.py with the synthetic preferred-token reward as its reward function; per_device_train_
        batch_size counts answers: batch prompts x num_generations per rank."""
        spec, grpo, lora = self.spec, self.options.grpo, self.options.lora
        args = engines.training_args(
            spec, "grpo", self.ctx.device, config, num_generations=grpo.num_generations, beta=grpo.beta,
            num_iterations=grpo.num_iterations, epsilon=grpo.epsilon, loss_type=grpo.loss_type,
            scale_rewards=grpo.scale_rewards, temperature=grpo.temperature, max_prompt_length=spec.prompt_len,
            max_completion_length=spec.answer_len)
        args.per_device_train_batch_size = spec.batch * grpo.num_generations
        data = SyntheticData(spec.model.vocab, spec.prompt_len, spec.answer_len, spec.batch, spec.seed, self.ctx.rank)
        reward = examples.preferred_reward(data)
        captured = self.captured

        def preferred_tokens(*a: Any, **kw: Any) -> list[float]:
            scores = reward(*a, **kw)
            captured.add("rewards", scores)
            return scores

        preferred_tokens.__name__ = "preferred_tokens"  # GRPO logs each reward function under its name
        prompts = [examples.text(torch.tensor(p)) for p in rows.prompts(spec.steps["grpo"])]
        if not init.get("sft"):
            self._notes.append("policy starts from random base weights (no SFT checkpoint)")
        return trainer(model=engines.grpo_policy(spec, init.get("sft")), reward_funcs=[preferred_tokens], args=args,
                       train_dataset=examples.dataset({"prompt": prompts}), processing_class=self.tokenizer,
                       peft_config=engines.peft_config(spec, lora.alpha, lora.dropout, "CAUSAL_LM"))

    def _grpo_seams(self) -> None:
        """GRPO's generation ends at unwrap_model_for_generation's exit, its experience where
        _generate_and_score_completions (the reference's log-probs, the rewards, the advantages) returns."""
        import trl.trainer.grpo_trainer as grpo_module

        self._patches.enter_context(patched(grpo_module, "unwrap_model_for_generation",
                                            generation_seam(self.driver, self.captured)))
        score, driver = self.trainer._generate_and_score_completions, self.driver

        def generate_and_score(*a: Any, **kw: Any) -> Any:
            out = score(*a, **kw)
            driver.seam("training_begin")
            return out

        self.trainer._generate_and_score_completions = generate_and_score

    def _wrap_training_step(self) -> None:
        """HF Trainer's training_step(model, inputs, ...): what a micro-batch held (its real tokens and rows)."""
        step = self.trainer.training_step
        captured = self.captured

        def training_step(model: Any, inputs: Any, *a: Any, **kw: Any) -> Any:
            if isinstance(inputs, dict):
                masks = [v for k, v in inputs.items() if k.startswith("attention_mask")]
                ids = inputs.get("input_ids", inputs.get("input_ids_chosen"))
                tokens = sum(int(m.sum()) for m in masks) if masks else int((ids != PAD).sum())
                captured.add("micro", (tokens, int(ids.shape[0])))
            loss = step(model, inputs, *a, **kw)
            captured.add("micro_loss", loss)
            return loss

        self.trainer.training_step = training_step

    def _count(self, stage: str) -> None:
        trainer = self.trainer
        if stage == "ppo":
            self._counts = {"actor": count_params(trainer.policy_model), "critic": count_params(trainer.value_model),
                            "reward": count_params(trainer.reward_model)}
            ref = trainer.ref_model
            self._counts["ref"] = (count_params(ref) if ref is not None else
                                   ParamCounts(0, 0, self._counts["actor"].compute))  # peft: adapters disabled
        else:
            role = "reward" if stage == "rm" else "actor"
            self._counts = {role: count_params(trainer.model)}
            if stage == "grpo" and getattr(trainer, "ref_model", None) is not None:
                self._counts["ref"] = count_params(trainer.ref_model)

    # ----------------------------------------------------------------- phases
    def _train_micro(self, role: str) -> TrainOutput:
        """One SFT or RM micro-batch: the trainer runs to the micro-batch's end (the step's log at the last)."""
        ends = self.ends_accumulation(role)
        logs = self.driver.advance("step_end" if ends else "micro_end")
        micro = self.captured.take("micro")
        loss = self.captured.take("micro_loss")
        out = TrainOutput(losses={}, tokens=sum(t for t, _ in micro), samples=sum(n for _, n in micro))
        if ends:
            self._record(out, role, logs["loss"], logs.get("grad_norm"))
        else:
            out.accumulate(role, float(loss[-1]))
        return out

    def _record(self, out: TrainOutput, role: str, loss: float, grad_norm: float | None) -> None:
        accelerator = self.trainer.accelerator
        scaler = getattr(accelerator, "scaler", None)
        out.record(role, float(loss), None if grad_norm is None else float(grad_norm),
                   bool(accelerator.optimizer_step_was_skipped), float(scaler.get_scale()) if scaler else None)
        if self.driver.step_seconds:  # the trainer's own step, timed in its thread (driver.py)
            out.metrics["trl_step_s"] = self.driver.step_seconds[-1]

    def sft_step(self, batch: SFTBatch) -> TrainOutput:
        return self._train_micro("actor")

    def rm_step(self, batch: PreferenceBatch) -> TrainOutput:
        return self._train_micro("reward")

    def rm_scores(self, batch: PreferenceBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The RM's score (`score` at the last non-pad token) in eval mode; the trainer is paused meanwhile."""
        model = self.trainer.model_wrapped
        training = model.training
        model.eval()
        device = self.ctx.device
        with torch.no_grad():
            sides = ((batch.chosen_ids, batch.chosen_mask), (batch.rejected_ids, batch.rejected_mask))
            scores = [model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[:, 0].float().cpu()
                      for ids, mask in sides]
        model.train(training)
        return scores[0], scores[1]

    def generate(self, batch: PromptBatch) -> Rollout:
        """TRL's rollout of its own prompt batch (drawn by its dataloader from the same synthetic prompts)."""
        self.driver.advance("generation_end")
        if self._stage == "ppo":
            queries, sequences = self.captured.take("batch_generation")[-1]
        else:
            args, kwargs, sequences = self.captured.take("generate")[-1]
            queries = args[0] if args else kwargs["input_ids"]
        self.captured.take("generate")
        width = queries.shape[1]
        answers = sequences[:, width:]
        answer_mask = _answer_mask(answers)
        prompt_mask = (queries != PAD).long()
        return Rollout(sequences=sequences, attention_mask=torch.cat([prompt_mask, answer_mask], 1), prompt_len=width,
                       prompt_tokens=int(prompt_mask.sum()), generated_tokens=int(answer_mask.sum()))

    def make_experience(self, rollout: Rollout) -> Experience:
        self.driver.advance("training_begin")
        if self._stage == "grpo":
            rewards = [r for batch in self.captured.take("rewards") for r in batch]
            return Experience(payload=None, reward=sum(rewards) / max(1, len(rewards)), kl=None, value=None,
                              tokens=rollout.real_tokens, samples=rollout.samples)
        scores, values = [], []
        for model, first, second in self.captured.take("get_reward"):
            if model is self.trainer.reward_model:
                scores.append(second)
            else:
                values.append(first)
        logprobs = self.captured.take("logprobs")  # per chunk: the policy's, then the reference's
        mask = rollout.answers[1].bool()
        kl = torch.cat([(p - r) for p, r in zip(logprobs[0::2], logprobs[1::2], strict=True)]).float()
        width = rollout.prompt_len
        value = torch.cat([v[:, width - 1:-1, 0] for v in values]).float()
        return Experience(payload=None, reward=float(torch.cat(scores).float().mean()),
                          kl=float(kl[mask].mean()), value=float(value[mask].mean()),
                          tokens=rollout.real_tokens, samples=rollout.samples)

    def ppo_train(self, experiences: list[Experience]) -> TrainOutput:
        logs = self.driver.advance("step_end")
        for unread in ("micro", "micro_loss"):  # training_step's captures: counted from the experiences here
            self.captured.take(unread)
        out = TrainOutput(losses={}, tokens=0, samples=0)
        if self._stage == "grpo":
            self._record(out, "actor", logs["loss"], logs.get("grad_norm"))
            passes = self.options.grpo.num_iterations
        else:
            passes = self.options.ppo.num_ppo_epochs
            norm = self._deepspeed_norm()
            for _ in range(passes * self.options.ppo.num_mini_batches):  # TRL steps once per minibatch
                self._record(out, "actor", logs["loss/policy_avg"], norm)
                self._record(out, "critic", logs["loss/value_avg"], norm)
        for experience in experiences:
            out.tokens += experience.tokens * passes
            out.samples += experience.samples * passes
        out.metrics.update({f"trl/{k}": float(v) for k, v in logs.items() if isinstance(v, (int, float))})
        return out

    def _deepspeed_norm(self) -> float | None:
        """TRL's PPO clips nothing itself and logs no norm; under DeepSpeed the engine's last global norm."""
        engine = self.trainer.model
        norm = engine.get_global_grad_norm() if hasattr(engine, "get_global_grad_norm") else None
        return None if norm is None else float(norm)

    # ----------------------------------------------------------------- state
    @property
    def _deepspeed(self) -> bool:
        return bool(getattr(self.trainer, "is_deepspeed_enabled", False))

    def _unwrapped(self) -> torch.nn.Module:
        model = self.trainer.accelerator.unwrap_model(self.trainer.model_wrapped if self._stage != "ppo"
                                                      else self.trainer.model)
        return model.policy if self._stage == "ppo" else model

    def save(self, stage: str, directory: str) -> str:
        """The trained model as a Hugging Face checkpoint directory (save_pretrained; LoRA merged into its base
        weights, ZeRO-3 partitions gathered), which the next stage loads with from_pretrained as TRL's scripts
        do. Returns its weights file (what init.sft / init.rm name)."""
        model = self._unwrapped()
        gather = contextlib.nullcontext()
        if self.spec.zero == 3:
            import deepspeed

            gather = deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)
        path = os.path.join(directory, "model.safetensors")
        with gather:
            if self.ctx.rank == 0:
                if hasattr(model, "merge_and_unload"):
                    model = model.merge_and_unload()
                state = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
                model.save_pretrained(directory, state_dict=state, safe_serialization=True)
        dist.barrier()
        return path

    def params(self) -> dict[str, ParamCounts]:
        return dict(self._counts)

    def _optimizer(self) -> Any:
        if self._deepspeed:
            engine_optimizer = self.trainer.model_wrapped.optimizer if self._stage != "ppo" else \
                self.trainer.model.optimizer
            return getattr(engine_optimizer, "optimizer", engine_optimizer)
        return getattr(self.trainer.optimizer, "optimizer", self.trainer.optimizer)

    def model_state(self) -> dict[str, ModelState]:
        trainer = self.trainer
        masters = ()
        if self._deepspeed:
            engine = trainer.model if self._stage == "ppo" else trainer.model_wrapped
            masters = zero3_masters(engine.optimizer)
        optimizer = self._optimizer()
        if self._stage == "ppo":  # one optimizer over policy and value model: each role's share of its state
            joint = self._deepspeed  # DeepSpeed's flat partitions mix both models: all booked to the actor
            states = {"actor": model_state(trainer.policy_model.parameters(), optimizer if joint else
                                           _Share(optimizer, trainer.policy_model.parameters()),
                                           held=held_bytes, masters=masters),
                      "critic": model_state(trainer.value_model.parameters(), None if joint else
                                            _Share(optimizer, trainer.value_model.parameters()), held=held_bytes),
                      "reward": model_state(trainer.reward_model.parameters(), None, held=held_bytes)}
            if trainer.ref_model is not None:
                states["ref"] = model_state(trainer.ref_model.parameters(), None, held=held_bytes)
            return states
        role = "reward" if self._stage == "rm" else "actor"
        states = {role: model_state(self._unwrapped().parameters(), optimizer, held=held_bytes, masters=masters)}
        if getattr(trainer, "ref_model", None) is not None:
            states["ref"] = model_state(trainer.ref_model.parameters(), None, held=held_bytes)
        return states

    def trained_optimizers(self) -> dict[str, Any]:
        return {"reward" if self._stage == "rm" else "actor": self._optimizer()} if self.trainer else {}

    def trained_modules(self) -> dict[str, torch.nn.Module]:
        if self.trainer is None:
            return {}
        return {"reward" if self._stage == "rm" else "actor": self._unwrapped()}

    def engine_knobs(self) -> dict[str, dict[str, float]]:
        """Clipping as applied: DeepSpeed's gradient_clipping (accelerate fills it from max_grad_norm), else the
        Trainer's clip_grad_norm_(max_grad_norm); TRL's PPO loop clips nothing outside DeepSpeed."""
        if self.trainer is None:
            return {}
        roles = ("actor", "critic") if self._stage == "ppo" else ("reward" if self._stage == "rm" else "actor",)
        if self._deepspeed:
            engine = self.trainer.model if self._stage == "ppo" else self.trainer.model_wrapped
            clip = float(engine.gradient_clipping())
        else:
            clip = 0.0 if self._stage == "ppo" else float(self.trainer.args.max_grad_norm)
        return {"grad_clip": {role: clip for role in roles}}

    @property
    def _empty_group_defect(self) -> bool:
        """LoRA under DeepSpeed leaves the Trainer's no-decay group empty (engines.EMPTY_GROUP_DEFECT)."""
        return bool(self.spec.lora and self.spec.zero)

    def upstream_defects(self) -> list[dict[str, str]]:
        found = [dict(engines.PPO_SEED_DEFECT)] if self._stage == "ppo" else []
        if self._stage == "grpo" and self.spec.model.arch == "gpt2":  # the other families honour logits_to_keep
            found.append(dict(engines.GRPO_DEFECT))
        if self._empty_group_defect:
            found.append(dict(engines.EMPTY_GROUP_DEFECT))
        return found

    def notes(self) -> list[str]:
        engine = f"DeepSpeed ZeRO-{self.spec.zero}" if self.spec.zero else "accelerate DDP"
        notes = [f"TRL {_version()} trainers run as they are ({engine}, through accelerate)", *self._notes]
        if self._stage == "ppo":
            notes.append("one optimizer over policy and value model (PPOTrainer's PolicyAndValueWrapper), learning "
                         "rate = the actor's; its state is booked " + (
                             "to the actor (DeepSpeed's flat partitions mix both)" if self._deepspeed else
                             "to each model by its parameters"))
        return notes

    def close(self) -> None:
        if self.driver is not None:
            self.driver.stop()
        self._patches.close()
        if self.trainer is not None:  # TrainingArguments' output_dir: a temporary directory nothing is kept in
            shutil.rmtree(self.trainer.args.output_dir, ignore_errors=True)
        self.trainer = None
        if dist.is_initialized():
            dist.destroy_process_group()


class _Share:
    """The part of one torch optimizer that holds `params`' state (what adapters.state_bytes reads of it)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Any) -> None:
        ids = {id(p) for p in params}
        self.state = {p: state for p, state in optimizer.state.items() if id(p) in ids}
        self.param_groups = [{"params": [p for p in group["params"] if id(p) in ids]}
                             for group in optimizer.param_groups]


def _version() -> str:
    import trl

    return trl.__version__
