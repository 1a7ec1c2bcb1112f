"""Trlx's SFT, RM and PPO on the real accelerate library (with its DeepSpeed plugin for ZeRO).

SFT: AccelerateSFTTrainer -- a causal LM (peft LoRA optional), AdamW, HF loss. RM: trlx has none; its
summarize_rlhf example trains GPTRewardModel with a per-token pairwise loss, done here on the same
accelerate plumbing. PPO: AcceleratePPOTrainer -- ONE trainable model, the causal LM with an fp32 value
head on the shared trunk, one optimizer and one joint loss (policy + vf_coef * value); the reference is
the hydra branch, the peft-disabled model or a whole frozen fp32 copy outside accelerate; the reward is
a function run on rank 0 only (here the RM-stage model) on the gathered rollouts, scores scattered back.
PPO arithmetic follows trlx: scores scaled by the running std and clipped to +-10, per-token k1 KL with
a fixed (or adaptive) coefficient, the score on the last response token, GAE with advantages whitened
across ranks per minibatch, clipped policy and value losses, `ppo_epochs` passes per rollout.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from adapters.base import Adapter, Experience, ModelState, RankContext, Rollout, TrainOutput
from adapters.deepspeed_cpu import allow_fp16
from adapters.rl_math import gae, gather_log_probs, position_ids
from adapters.state_bytes import model_state, tensor_bytes
from adapters.trlx.models import GPTRewardModel, PolicyWithValueHead, freeze_bottom_layers
from adapters.trlx.options import TrlxOptions
from bench.data import EOS, PAD, PreferenceBatch, PromptBatch, SFTBatch
from bench.flops import Attention
from bench.models import ParamCounts, build_causal_lm, count_params, gpt2_config
from bench.spec import RunSpec

MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


class TrlxAdapter(Adapter):
    phase_roles = {
        "sft": {"training": ("actor",)},
        "rm": {"training": ("reward",), "evaluation": ("reward",)},
        # One shared trunk: rollout, scoring and update all run through the policy; the reference adds
        # its own branch (or copy), the reward model runs once per rollout.
        "ppo": {"generation": ("actor",), "experience": ("actor", "ref", "reward"), "training": ("actor",)},
    }

    def __init__(self, spec: RunSpec, ctx: RankContext) -> None:
        super().__init__(spec, ctx)
        self.options = TrlxOptions.validate(spec)
        if ctx.device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

        plugin = None
        if spec.zero > 0:
            plugin = DeepSpeedPlugin(zero_stage=spec.zero, gradient_accumulation_steps=1, gradient_clipping=1.0,
                                     zero3_init_flag=False, zero3_save_16bit_model=spec.zero == 3)
            plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = spec.batch
            if spec.precision == "fp16":  # trlx PR #279: DeepSpeed's fp16 autocast broke its forward
                plugin.deepspeed_config["fp16"] = {"enabled": True, "auto_cast": False}
        on_cpu = ctx.device.type == "cpu"
        # Without an accelerator Accelerate picks no process-group backend: DeepSpeed needs gloo named, and
        # plain DDP is only built (MULTI_CPU) when Accelerate is told it runs on the CPU.
        handlers = [InitProcessGroupKwargs(backend="gloo")] if on_cpu else []
        self.accelerator = Accelerator(mixed_precision=MIXED_PRECISION[spec.precision], deepspeed_plugin=plugin,
                                       kwargs_handlers=handlers, cpu=on_cpu and plugin is None)
        self.deepspeed = plugin is not None
        self._notes: list[str] = [self._engine_note()]
        # Every engine library the run will use is imported now, inside the measured `imports` phase.
        if plugin is not None:
            fp16_note = allow_fp16(ctx.device, spec.precision)
            if fp16_note:
                self._notes.append(fp16_note)
        if spec.lora or self.options.reference_mode(spec.lora) == "peft":
            import peft  # noqa: F401
        self.model: Any = None
        self.optimizer: Any = None
        self.role = "actor"
        self.ref_model: torch.nn.Module | None = None
        self.reward_model: torch.nn.Module | None = None
        self._counts: dict[str, ParamCounts] = {}
        self._moments = _RunningMoments()
        self._kl_coef = self.options.ppo.init_kl_coef

    def _engine_note(self) -> str:
        if self.deepspeed:
            return f"engine: accelerate {self.accelerator.distributed_type.value} with DeepSpeed ZeRO-{self.spec.zero}"
        return f"engine: accelerate {self.accelerator.distributed_type.value} (no DeepSpeed; zero=0)"

    # ----------------------------------------------------------------- building
    def _lm(self, checkpoint: str | None) -> torch.nn.Module:
        torch.manual_seed(self.spec.seed)
        model = build_causal_lm(self.spec.model)
        if checkpoint:
            model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True))
        return model

    def _peft(self, model: torch.nn.Module, task_type: str | None = "CAUSAL_LM") -> torch.nn.Module:
        """peft LoRA with peft's per-architecture target modules (GPT-2: c_attn), as trlx's peft_config."""
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=self.spec.lora, lora_alpha=self.options.lora.alpha,
                            lora_dropout=self.options.lora.dropout, task_type=task_type,
                            target_modules=None if task_type else ["c_attn"])
        return get_peft_model(model, config)

    def _prepare(self, role: str, model: torch.nn.Module, lr: float) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lr, betas=tuple(self.options.betas), eps=self.options.eps,
                                      weight_decay=self.options.weight_decay)
        if self.spec.grad_ckpt:
            target = model.base_model if isinstance(model, PolicyWithValueHead) else model
            target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self._notes.append("gradient checkpointing: a harness extension (trlx's trainers have no such knob)")
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.role = role

    def setup(self, stage: str, init: dict[str, str]) -> None:
        if stage == "sft":
            model = self._lm(init.get("sft"))
            if self.spec.lora:
                model = self._peft(model)
            self._counts["actor"] = count_params(model)
            lr = self.spec.lr if self.spec.lr is not None else self.spec.stage_lr("sft")
            self._prepare("actor", model, lr)
        elif stage == "rm":
            model = self._reward_model(init.get("rm"))
            if self.spec.lora:  # the backbone gets LoRA; the v_head trains fully
                model.transformer = self._peft(model.transformer, task_type=None)
            self._counts["reward"] = count_params(model)
            self._prepare("reward", model, self.spec.stage_lr("rm"))
        else:
            self._setup_ppo(init)
        self._notes.append(f"optimizer: torch AdamW (betas {tuple(self.options.betas)}, eps {self.options.eps}, "
                           f"weight decay {self.options.weight_decay})")

    def _reward_model(self, checkpoint: str | None) -> GPTRewardModel:
        from transformers import GPT2Model

        torch.manual_seed(self.spec.seed)
        model = GPTRewardModel(GPT2Model(gpt2_config(self.spec.model)), self.spec.model.hidden)
        if checkpoint:
            model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True))
        return model

    def _setup_ppo(self, init: dict[str, str]) -> None:
        mode = self.options.reference_mode(self.spec.lora)
        lm = self._lm(init.get("sft"))
        hydra_layers = 0
        if mode == "peft":
            lm = self._peft(lm)
        elif mode == "hydra":
            hydra_layers = self.options.num_layers_unfrozen
            freeze_bottom_layers(lm, hydra_layers)
        policy = PolicyWithValueHead(lm, self.spec.model.hidden, hydra_layers)
        # Each module is counted where it runs: the hydra branch only in the reference's forward.
        whole = count_params(policy)
        branch = count_params(policy.frozen_head) if policy.frozen_head is not None else ParamCounts(0, 0, 0, 0)
        self._counts["actor"] = ParamCounts(total=whole.total, trainable=whole.trainable,
                                            compute=whole.compute - branch.compute,
                                            compute_trainable=whole.compute_trainable)
        trunk = self._counts["actor"].compute
        if mode == "full":
            # trlx builds a second whole model, moves it to the device and never wraps it: no ZeRO, no offload.
            self.ref_model = self._lm(init.get("sft")).to(self.ctx.device).eval().requires_grad_(False)
            self._counts["ref"] = count_params(self.ref_model)
        elif mode == "hydra":  # extra weights: the branch; work: forward_hydra re-runs the trunk, then the branch
            self._counts["ref"] = ParamCounts(total=branch.total, trainable=0, compute=trunk + branch.compute)
        else:  # no extra weights; the trunk runs again with adapters disabled
            self._counts["ref"] = ParamCounts(total=0, trainable=0, compute=trunk)
        with torch.device("meta"):  # every rank counts the reward model; only rank 0 holds it
            self._counts["reward"] = count_params(self._reward_model(None))
        self._notes.append(self._reference_note(mode, policy))
        self._prepare("actor", policy, self.spec.stage_lr("actor"))
        if self.ctx.rank == 0:  # trlx's reward_fn runs on the main process only
            self.reward_model = self._reward_model(init.get("rm")).to(self.ctx.device).eval().requires_grad_(False)
        self._notes.append("reward: the RM-stage model as trlx's reward_fn, on rank 0 only (scores scattered); "
                           "its FLOPs are booked to each rank for its own samples")
        self._notes.append("critic: the policy trunk plus a fresh fp32 value head (h -> 2h -> 1); joint loss, "
                           "one optimizer")
        if not init.get("sft"):
            self._notes.append("policy and reference start from random base weights (no SFT checkpoint)")

    def _reference_note(self, mode: str, policy: PolicyWithValueHead) -> str:
        if mode == "hydra":
            branch = sum(tensor_bytes(p) for p in policy.frozen_head.parameters())
            return (f"reference: hydra branch of the top {self.options.num_layers_unfrozen} blocks + final norm + "
                    f"LM head ({branch:,} bytes); lower blocks and embeddings frozen and shared")
        if mode == "peft":
            return "reference: the policy with its LoRA adapters disabled (no copy)"
        return ("reference: a whole frozen fp32 copy on every rank outside accelerate/DeepSpeed (trlx's intended "
                "num_layers_unfrozen=-1 path; at trlx HEAD this path looks broken, see the reference notes)")

    def attention(self) -> dict[str, Attention]:
        """The hydra reference re-runs the whole trunk, then its branch's blocks (forward_hydra)."""
        shapes = super().attention()
        if "ref" in shapes and self.options.reference_mode(self.spec.lora) == "hydra":
            shape = shapes["ref"]
            shapes["ref"] = Attention(layers=shape.layers + self.options.num_layers_unfrozen, hidden=shape.hidden)
        return shapes

    @property
    def _unwrapped(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model)

    # ----------------------------------------------------------------- stepping
    def _backward_step(self, loss: torch.Tensor, out: TrainOutput) -> None:
        role = self.role
        accelerator = self.accelerator
        engine = self.model if self.deepspeed else None
        skipped_before = engine.skipped_steps if engine is not None else 0
        accelerator.backward(loss)  # with DeepSpeed this also steps the engine
        norm = None
        if engine is None:
            scale = accelerator.scaler.get_scale() if accelerator.scaler is not None else 1.0
            grads = [p.grad.float() for p in self.model.parameters() if p.grad is not None]
            if grads:
                norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) / scale
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
        self.model.train()
        loss = self.model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                          labels=batch.labels.to(device), use_cache=False).loss
        out = TrainOutput(losses={}, tokens=batch.real_tokens, samples=batch.input_ids.shape[0])
        self._backward_step(loss, out)
        self.model.eval()  # trlx trains in train() mode only around backward
        return out

    def rm_step(self, batch: PreferenceBatch) -> TrainOutput:
        device = self.ctx.device
        self.model.train()
        loss, correct = self._pair_loss(batch, device)
        out = TrainOutput(losses={}, tokens=batch.real_tokens, samples=batch.chosen_ids.shape[0])
        self._backward_step(loss, out)
        out.metrics["accuracy"] = float(correct.mean())
        self.model.eval()
        return out

    def _pair_loss(self, batch: PreferenceBatch, device: torch.device):
        return self.model(batch.chosen_ids.to(device), batch.chosen_mask.to(device),
                          batch.rejected_ids.to(device), batch.rejected_mask.to(device))

    @torch.no_grad()
    def rm_accuracy(self, batch: PreferenceBatch) -> float:
        _, correct = self._pair_loss(batch, self.ctx.device)
        return float(correct.mean())

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
        width = self.spec.prompt_len + self.spec.answer_len
        sequences = torch.nn.functional.pad(sequences, (0, width - sequences.shape[1]), value=PAD)
        mask = (sequences != PAD).long()
        prompt_len = batch.input_ids.shape[1]
        return Rollout(sequences=sequences, attention_mask=mask, prompt_len=prompt_len,
                       prompt_tokens=int(mask[:, :prompt_len].sum()),
                       generated_tokens=int(mask[:, prompt_len:].sum()))

    def _scores(self, seq: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """trlx's make_experience: gather every rank's samples to rank 0, score them there, scale by the
        running std, clip, scatter each rank's share back. Returns (RM scores, scaled and clipped scores)."""
        ppo = self.options.ppo
        world = self.ctx.world_size
        gathered = [torch.empty_like(seq) for _ in range(world)] if self.ctx.rank == 0 else None
        masks = [torch.empty_like(mask) for _ in range(world)] if self.ctx.rank == 0 else None
        if world > 1:
            dist.gather(seq, gathered, dst=0)
            dist.gather(mask, masks, dst=0)
        else:
            gathered, masks = [seq], [mask]
        both = torch.empty(2, seq.shape[0], device=seq.device)
        chunks = None
        if self.ctx.rank == 0:
            raw = self.reward_model.end_scores(torch.cat(gathered), torch.cat(masks)).float()
            self._moments.update(raw)
            rm_scores = raw
            if ppo.scale_reward == "running":
                raw = raw / self._moments.std
            elif ppo.scale_reward == "ref":
                raw = raw / self._moments.first_std
            raw = raw.clamp(-ppo.cliprange_reward, ppo.cliprange_reward)
            chunks = [pair.contiguous() for pair in torch.stack([rm_scores, raw]).split(seq.shape[0], dim=1)]
        if world > 1:
            dist.scatter(both, chunks, src=0)
        else:
            both = chunks[0]
        return both[0], both[1]

    @torch.no_grad()
    def make_experience(self, rollout: Rollout) -> Experience:
        seq, mask, start = rollout.sequences, rollout.attention_mask, rollout.prompt_len - 1
        rm_scores, scores = self._scores(seq, mask)
        logits, values, _ = self.model(seq, mask)
        log_probs = gather_log_probs(logits[:, :-1], seq[:, 1:])
        if self.ref_model is not None:
            ref_logits = self.ref_model(input_ids=seq, attention_mask=mask, position_ids=position_ids(mask),
                                        use_cache=False).logits
        else:
            ref_logits = self.model(seq, mask, reference=True)
        ref_log_probs = gather_log_probs(ref_logits[:, :-1], seq[:, 1:])
        action_mask = mask[:, 1:].float()
        log_ratio = (log_probs - ref_log_probs) * action_mask
        rewards = -self._kl_coef * log_ratio[:, start:]
        ends = action_mask[:, start:].sum(1).long()
        rewards[torch.arange(len(ends)), (ends - 1).clamp(min=0)] += scores
        response_mask = action_mask[:, start:]
        # trlx stores each sample's own response span and pads the batch with zeros (values, rewards).
        payload = {"seq": seq, "mask": mask, "start": start, "log_probs": log_probs[:, start:],
                   "values": values[:, :-1][:, start:].float() * response_mask, "rewards": rewards * response_mask}
        kl = float((log_ratio[:, start:].sum(1)).mean())
        return Experience(payload=payload, reward=float(rm_scores.mean()), kl=kl,
                          value=float((values[:, :-1][:, start:] * action_mask[:, start:]).sum()
                                      / action_mask[:, start:].sum().clamp(min=1)),
                          tokens=rollout.real_tokens, samples=rollout.samples)

    def ppo_train(self, experience: Experience) -> TrainOutput:
        p = experience.payload
        ppo = self.options.ppo
        seq, mask, start = p["seq"], p["mask"], p["start"]
        response_mask = mask[:, 1:][:, start:].float()
        advantages, returns = gae(p["values"], p["rewards"], 0, ppo.gamma, ppo.lam)
        advantages = _whiten(advantages)
        out = TrainOutput(losses={}, tokens=0, samples=0)
        for _ in range(ppo.ppo_epochs):
            self.model.train()
            logits, values, _ = self.model(seq, mask)
            log_probs = gather_log_probs(logits[:, :-1], seq[:, 1:])[:, start:]
            values = values[:, :-1][:, start:].float()
            loss, pg_loss, vf_loss = _ppo_loss(log_probs, values, p["log_probs"], p["values"], advantages, returns,
                                               response_mask, ppo)
            self._backward_step(loss, out)
            self.model.eval()
            out.metrics.update(policy_loss=float(pg_loss), value_loss=float(vf_loss))
            out.tokens += experience.tokens
            out.samples += experience.samples
            if ppo.target is not None:  # AdaptiveKLController.update after each inner epoch
                error = max(-0.2, min(0.2, experience.kl / ppo.target - 1))
                self._kl_coef *= 1 + error * experience.samples / ppo.horizon
        out.metrics["kl_coef"] = self._kl_coef
        return out

    # ----------------------------------------------------------------- state
    def save(self, stage: str, directory: str) -> str:
        role = "reward" if stage == "rm" else "actor"
        path = os.path.join(directory, f"{role}.pt")
        module = self._unwrapped
        gather = nullcontext()
        if self.spec.zero == 3:
            import deepspeed

            gather = deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
        with gather:
            if self.ctx.rank == 0:
                if stage == "rm":
                    state = {f"transformer.{k}": v for k, v in _lm_state(module.transformer).items()}
                    state.update({f"v_head.{k}": v for k, v in module.v_head.state_dict().items()})
                else:
                    state = _lm_state(module.base_model if isinstance(module, PolicyWithValueHead) else module)
                os.makedirs(directory, exist_ok=True)
                torch.save({k: v.float().cpu().clone() for k, v in state.items()}, path + ".tmp")
                os.replace(path + ".tmp", path)
        self.accelerator.wait_for_everyone()
        return path

    def params(self) -> dict[str, ParamCounts]:
        return dict(self._counts)

    def model_state(self) -> dict[str, ModelState]:
        engine = self.model
        inner = self.optimizer.optimizer if hasattr(self.optimizer, "optimizer") else self.optimizer
        if self.deepspeed:
            inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        states = {self.role: model_state(self._unwrapped.parameters(), inner, held=_held_bytes)}
        if self.ref_model is not None:
            states["ref"] = model_state(self.ref_model.parameters(), None)
        if self.reward_model is not None:
            states["reward"] = model_state(self.reward_model.parameters(), None)
        return states

    def notes(self) -> list[str]:
        return list(self._notes)

    def close(self) -> None:
        self.model = self.optimizer = self.ref_model = self.reward_model = None
        if dist.is_initialized():
            dist.destroy_process_group()


def _held_bytes(param: torch.nn.Parameter) -> int:
    return tensor_bytes(param.data) + (tensor_bytes(param.ds_tensor) if hasattr(param, "ds_tensor") else 0)


def _lm_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weights under the plain model's names; peft LoRA deltas are folded into their base weights."""
    if not hasattr(model, "get_base_model"):
        return {k: v.detach() for k, v in model.state_dict().items()}
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {name: m.get_delta_weight("default") for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    state = {}
    for key, value in base.state_dict().items():
        if "lora_" in key:
            continue
        owner, _, leaf = key.rpartition(".base_layer.")
        if owner and leaf == "weight" and owner in deltas:
            value = value + deltas[owner].to(value.dtype)
        state[key.replace(".base_layer.", ".")] = value.detach()
    return state


class _RunningMoments:
    """trlx's RunningMoments: running mean and std of every score seen (Chan's parallel update)."""

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.var = 1.0
        self.first_std: float | None = None

    def update(self, x: torch.Tensor) -> None:
        n, mean, var = x.numel(), float(x.mean()), float(x.var(unbiased=False)) if x.numel() > 1 else 0.0
        if self.first_std is None:
            self.first_std = max(float(x.std()) if n > 1 else 1.0, 1e-8)
        total = self.count + n
        delta = mean - self.mean
        m2 = self.var * self.count + var * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        self.count = total

    @property
    def std(self) -> float:
        return max((self.var * self.count / max(self.count - 1, 1)) ** 0.5, 1e-8)


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
