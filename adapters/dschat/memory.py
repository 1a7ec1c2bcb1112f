"""DS-Chat's memory as this adapter runs it, per phase, for the planner (bench.plan). Imports no framework.

Roles and lifetimes follow the fidelity table (README): SFT trains the actor, RM the reward model (a value
head on the trunk, chosen and rejected sequences in one batch); PPO keeps four DeepSpeed engines (actor and
critic trained, reference and reward eval-only, ZeRO-3 only when the trained ones use it). In experience
making the actor's and the reference's outputs (logits and KV caches) stay alive through the reward and
critic forwards; log-probs are taken in the model's dtype. LoRA wraps every block linear (alpha 1): only the
wrapped weights freeze, biases and unconverted parameters train.
"""

from __future__ import annotations

from adapters.deepspeed_memory import eager_gradient_bytes, gradient_terms, resident_buffers
from bench.plan.physics import Terms, peak, total
from bench.plan.run_shape import (
    RunShape,
    build_transient,
    forward_backward,
    forward_only,
    frozen_state,
    generation_cache,
    hf_loss_logits,
    role_state,
    without_moments,
)


def role_params(shape: RunShape, role: str, lora: int) -> tuple[int, int]:
    """(total, trainable) parameters of a role: the trunk (+ a bias-free value head for critic and reward);
    LoRA adds 16*r*h per block and freezes the wrapped 12*h^2 per block."""
    arch = shape.arch
    params = arch.total_params + (arch.hidden if role in ("critic", "reward") else 0)
    if not lora:
        return params, params
    added = arch.lora_params(lora)
    return params + added, params + added - 12 * arch.hidden ** 2 * arch.layers


def predict(shape: RunShape) -> dict[str, Terms]:
    vb, zero, dp = shape.value_bytes, shape.zero, shape.data_parallel
    shard = dp if zero >= 3 else 1

    def trained(role: str, lora: int) -> tuple[Terms, Terms, Terms]:
        """(state, gradients at the end of a backward, state at initialisation)."""
        params, trainable = role_params(shape, role, lora)
        state = role_state(params, trainable, vb, zero, dp, master=True)
        eager = Terms(grads=eager_gradient_bytes(trainable, shape.precision, zero))
        # ZeRO-1/2 at one rank makes Adam's moments at the first step (measured), more ranks at init; ZeRO-3's
        # bucket pages become resident at the first backward on the host, at allocation on a GPU
        at_init = without_moments(state, trainable, 1) if zero in (1, 2) and dp == 1 else state
        buffers = resident_buffers(trainable, vb, zero, shape.device)
        if shape.device == "cuda":
            at_init = at_init + buffers
        return state + buffers, gradient_terms(trainable, vb, zero, dp, shape.precision), at_init + eager

    if shape.stage in ("sft", "rm"):
        role = "actor" if shape.stage == "sft" else "reward"
        state, grads, init = trained(role, shape.lora)
        if zero < 3:  # built whole in fp32 outside zero.Init
            init = peak(init, build_transient(shape, role_params(shape, role, shape.lora)[0]))
        if shape.stage == "sft":
            work = forward_backward(shape, shape.batch, shape.seq, logits_copies=hf_loss_logits(shape), dropout=True)
        else:
            work = forward_backward(shape, 2 * shape.batch, shape.seq, dropout=True)
        phases = {"init": init, "training": state + Terms(grads=init.grads) + grads + work}
        if shape.stage == "rm":
            phases["evaluation"] = state + forward_only(shape, 2 * shape.batch, shape.seq)
        return phases

    actor, actor_grads, actor_init = trained("actor", shape.lora)
    critic, critic_grads, critic_init = trained("critic", shape.options.get("critic_lora_dim", 0))
    frozen = total([frozen_state(role_params(shape, role, 0)[0], vb, shard) for role in ("ref", "reward")])
    resident = actor + critic + frozen
    eager = Terms(grads=actor_init.grads + critic_init.grads)
    seq = shape.seq
    critic_dropout = shape.options.get("critic_dropout")
    critic_dropout = True if critic_dropout is None else critic_dropout > 0
    # the update: actor loss and backward (log-softmax over its logits in the model's dtype), then the critic's
    actor_pass = actor_grads + forward_backward(shape, shape.batch, seq, logits_copies=4,
                                                dropout=bool(shape.options.get("actor_dropout")))
    critic_pass = critic_grads + forward_backward(shape, shape.batch, seq, dropout=critic_dropout)
    heavier = actor_pass if actor_pass.device >= critic_pass.device else critic_pass
    return {
        "init": actor_init + critic_init + frozen,
        "generation": resident + generation_cache(shape) + forward_only(shape, shape.batch, 1),
        "experience": resident + generation_cache(shape, copies=2) + forward_only(shape, shape.batch, seq, 3),
        "training": resident + eager + heavier,
    }
