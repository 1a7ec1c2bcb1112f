"""TRL's memory as this adapter runs it (trl 0.19.1's own trainers), per phase, for the planner (bench.plan).
Imports no framework.

Every model is prepared by accelerate (adapters/accelerate_memory.py): DDP with fp32 weights at ZeRO-0, DeepSpeed
above. SFT trains the causal LM (transformers' loss); RM (RewardTrainer) the sequence classifier (the backbone and
a bias-free score head h -> 1) on the chosen and the rejected sequences, two forwards kept for one backward.
PPO (PPOTrainer) builds all four models whole in fp32 first (examples/scripts/ppo/ppo.py), then prepares the
policy and the value model as one engine (PolicyAndValueWrapper, one optimizer over both; peft adapts the policy
only) and the reference and reward for inference: whole on every rank in fp32 under DDP, in the compute dtype
under DeepSpeed (prepare_deepspeed), partitioned at ZeRO-3. PPOTrainer disables dropout in all four. Its rollout
keeps every step's scores (generate's output_scores, fp32) and stacks them, then the experience forwards run with
output_hidden_states (the reference's with its KV cache too) while those stacked scores stay alive; at ZeRO-3 the
whole policy and value model are gathered for generation (ds3_gather_for_generation). The update runs the policy
and the value model forward and backward together on a micro-batch. GRPO trains the policy alone on batch x
num_generations answers, with no reference at beta 0 (its default) and a reward function.
"""

from __future__ import annotations

from adapters.accelerate_memory import accelerate_engine
from adapters.deepspeed_memory import engine_build
from adapters.lora_targets import PEFT_DEFAULTS
from bench.plan.physics import Terms, logits_bytes, peak, total
from bench.plan.run_shape import (
    RunShape,
    build_transient,
    forward_backward,
    forward_only,
    frozen_role,
    generation_cache,
    hf_loss_logits,
    step_transient,
)


def _targets(shape: RunShape) -> tuple[str, ...]:
    """peft's maps: lora_targets, else peft's default for the family (the harness refuses a family without one)."""
    return shape.lora_targets or PEFT_DEFAULTS.get(shape.arch.family, ())


def _linear_inputs(shape: RunShape) -> float:
    """What the block maps keep for gradients: all of them without LoRA; with peft's LoRA (dropout 0.05, TRL's
    ModelConfig) the adapted ones, each with a dropped copy and its mask."""
    if not shape.lora:
        return shape.arch.linear_inputs()
    if (shape.options.get("lora") or {}).get("dropout", 0) > 0:
        return shape.arch.lora_dropout_inputs(_targets(shape), shape.device, shape.value_bytes)
    return shape.arch.linear_inputs(_targets(shape))


def role_params(shape: RunShape, role: str, lora: int) -> tuple[int, int]:
    """(total, trainable) of one model: the causal LM (actor, ref), or the sequence classifier (critic, reward:
    the backbone and a bias-free h -> 1 score head); peft on the policy adds its factors and freezes the rest."""
    arch = shape.arch
    params = arch.backbone_params + arch.hidden if role in ("critic", "reward") else arch.total_params
    if not lora or role != "actor":
        return params, params
    added = arch.lora_params(lora, _targets(shape))
    return params + added, added


def _frozen(shape: RunShape, role: str) -> Terms:
    """A frozen model as prepared: fp32 under DDP, the compute dtype under DeepSpeed, partitioned at ZeRO-3."""
    weight_bytes = 4 if shape.zero == 0 else shape.value_bytes
    shard = shape.data_parallel if shape.zero >= 3 else 1
    return frozen_role(shape, role, role_params(shape, role, 0)[0], weight_bytes, shard)


def _init(shape: RunShape, params: float, trainable: float, state: Terms, frozen: list[float]) -> Terms:
    """The trained engine prepared while the frozen models built beside it are still whole in fp32."""
    built = total([build_transient(shape, p) for p in frozen])
    if shape.zero == 0:  # DDP's construction broadcasts every parameter through copies
        return built + Terms(params=state.params, buffers=4 * params)
    if shape.zero < 3:
        during = engine_build(params, trainable, shape.value_bytes, shape.zero, shape.data_parallel, shape.mixed,
                              shape.freed_returned)[0]
        return peak(build_transient(shape, params) + built, during + built)
    return peak(build_transient(shape, params) + built, state + built)


def predict(shape: RunShape) -> dict[str, Terms]:
    vb, arch = shape.value_bytes, shape.arch
    if shape.stage in ("sft", "rm"):
        role = "actor" if shape.stage == "sft" else "reward"
        params, trainable = role_params(shape, role, shape.lora)
        state, kept, made = accelerate_engine(shape, params, trainable)
        sequences = shape.batch if shape.stage == "sft" else 2 * shape.batch
        work = forward_backward(shape, sequences, shape.seq, dropout=True, linear_inputs=_linear_inputs(shape),
                                logits_copies=hf_loss_logits(shape) if shape.stage == "sft" else 0.0,
                                trained_norms=not shape.lora)
        phases = {"init": _init(shape, params, trainable, state, []),
                  "training": state + kept + step_transient(shape, work, made)}
        if shape.stage == "rm":
            phases["evaluation"] = state + (kept if shape.zero >= 3 else Terms()) + forward_only(
                shape, sequences, shape.seq)
        return phases
    if shape.stage == "grpo":
        return _grpo(shape)
    policy, policy_trained = role_params(shape, "actor", shape.lora)
    value = role_params(shape, "critic", 0)[0]
    params, trainable = policy + value, policy_trained + value
    state, kept, made = accelerate_engine(shape, params, trainable)
    frozen_roles = ("reward",) if shape.lora else ("ref", "reward")  # peft's reference: adapters disabled
    frozen = total([_frozen(shape, role) for role in frozen_roles])
    partition = kept if shape.zero >= 3 else Terms()  # ZeRO-3's gradient partition stays from the build on
    resident = state + partition + frozen
    answer, seq = shape.answer_len, shape.seq
    scores = Terms(logits=shape.batch * answer * arch.vocab * 4)  # fp32 scores of every generated step
    gathered = Terms(buffers=vb * params) if shape.zero >= 3 else Terms()
    hidden_states = Terms(activations=(arch.layers + 1) * shape.batch * seq * arch.hidden * vb)
    # the update: the policy's logits, their log-softmax and its gradient, and the value model's pass beside it
    policy_pass = forward_backward(shape, shape.batch, seq, logits_copies=3, linear_inputs=_linear_inputs(shape),
                                   trained_norms=not shape.lora)
    value_pass = forward_backward(shape, shape.batch, seq)
    frozen_params = [role_params(shape, role, 0)[0] for role in frozen_roles]
    return {
        "init": _init(shape, params, trainable, state, frozen_params),
        "generation": resident + gathered + generation_cache(shape) + forward_only(shape, shape.batch, 1)
        + scores + scores,  # the list of steps and its stacked copy
        "experience": resident + scores + generation_cache(shape) + hidden_states
        + forward_only(shape, shape.batch, seq, logits_copies=1),
        "training": state + kept + frozen + step_transient(shape, policy_pass + value_pass, made),
    }


def _grpo(shape: RunShape) -> dict[str, Terms]:
    """GRPOTrainer: the policy alone, batch x num_generations answers a rank; the reference only at beta > 0."""
    arch = shape.arch
    group = int((shape.options.get("grpo") or {}).get("num_generations", 4))
    with_ref = float((shape.options.get("grpo") or {}).get("beta", 0.0)) > 0
    answers = shape.batch * group
    params, trainable = role_params(shape, "actor", shape.lora)
    state, kept, made = accelerate_engine(shape, params, trainable)
    frozen = _frozen(shape, "ref") if with_ref and not shape.lora else Terms()
    partition = kept if shape.zero >= 3 else Terms()
    resident = state + partition + frozen
    # logits over the answers only (logits_to_keep), divided by the temperature (a copy), log-softmax saved
    kept_logits = 3 * logits_bytes(arch, answers, shape.answer_len + 1, shape.tp, shape.value_bytes)
    work = forward_backward(shape, answers, shape.seq, dropout=True, linear_inputs=_linear_inputs(shape),
                            trained_norms=not shape.lora) + Terms(logits=kept_logits)
    cache = generation_cache(shape, copies=group)
    reference = forward_only(shape, answers, shape.seq, logits_copies=1) if with_ref else Terms()
    return {
        "init": _init(shape, params, trainable, state, [role_params(shape, "ref", 0)[0]] if with_ref else []),
        "generation": resident + cache + forward_only(shape, answers, 1),
        "experience": resident + reference,
        "training": state + kept + frozen + step_transient(shape, work, made),
    }
