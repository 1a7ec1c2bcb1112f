"""DS-Chat's memory as this adapter runs it, per phase, for the planner (bench.plan). Imports no framework.

Roles and lifetimes follow the fidelity table (docs/frameworks/dschat.md): SFT trains the actor, RM the reward
model (a value
head on the trunk, chosen and rejected sequences in one batch); PPO keeps four DeepSpeed engines (actor and
critic trained, reference and reward eval-only, ZeRO-3 only when the trained ones use it). In experience
making the actor's and the reference's outputs (logits and KV caches) stay alive through the reward and
critic forwards; log-probs are taken in the model's dtype. LoRA wraps every block linear (alpha 1) or those
lora_targets names: only the wrapped weights freeze, biases and unconverted parameters train, so every linear
map keeps its input for a gradient whatever the targets.
"""

from __future__ import annotations

from dataclasses import replace

from adapters.deepspeed_memory import (
    eager_gradient_bytes,
    engine_build,
    gradient_terms,
    held_gradient_bytes,
    offloaded_gradients,
    resident_buffers,
    zero3_kept_gathered,
)
from adapters.dschat.ds_config import PERSISTENCE_THRESHOLD
from bench.plan.physics import ALL_LORA_LAYERS, Terms, peak
from bench.plan.run_shape import (
    RunShape,
    build_transient,
    forward_backward,
    forward_only,
    frozen_role,
    generation_cache,
    hf_loss_logits,
    offloaded,
    role_state,
    step_transient,
)


def role_params(shape: RunShape, role: str, lora: int) -> tuple[int, int]:
    """(total, trainable) parameters of a role: the causal LM, or the backbone with a bias-free value head for
    critic and reward (no LM head; the same parameters when the head is tied); LoRA on the target maps
    (lora_targets; DS-Chat's block-list default: all of them) adds r*(d_in + d_out) each and freezes only
    their weights (GPT-2: 16*r*h and 12*h^2 per block): the rest keeps training. Critic and reward have the
    critic's arch where it has its own (--critic_model_name_or_path)."""
    arch = shape.for_role(role).arch
    params = arch.backbone_params + arch.hidden if role in ("critic", "reward") else arch.total_params
    if not lora:
        return params, params
    targets = shape.lora_targets or ALL_LORA_LAYERS
    added = arch.lora_params(lora, targets)
    if shape.options.get("only_optimize_lora"):  # --only_optimize_lora: the factors alone train
        return params + added, added
    return params + added, params + added - arch.block_weights(targets)


def kept_gathered(shape: RunShape, role: str) -> Terms:
    """ZeRO-3's parameters kept gathered through a traced step (adapters/deepspeed_memory.zero3_kept_gathered): every
    tensor of the role's model (the LM, or the backbone and its value head), LoRA factors included."""
    if shape.zero < 3:
        return Terms()
    arch = shape.for_role(role).arch
    numels = arch.tensor_numels(lm_head=role not in ("critic", "reward")) + arch.lora_numels(
        shape.lora, shape.lora_targets or ALL_LORA_LAYERS)
    if role in ("critic", "reward"):
        numels.append(arch.hidden)  # the value head
    return Terms(buffers=zero3_kept_gathered(numels, shape.value_bytes, PERSISTENCE_THRESHOLD))


def predict(shape: RunShape) -> dict[str, Terms]:
    vb, zero, dp = shape.value_bytes, shape.zero, shape.data_parallel
    # the critic's own stage (--critic_zero_stage) and recomputation; reference and reward engines follow the
    # actor's and the critic's into ZeRO-3
    critic_option = shape.options.get("critic_zero_stage")
    stages = {"actor": zero, "critic": zero if critic_option is None else critic_option}
    stages.update(ref=stages["actor"], reward=stages["critic"])
    critic_ckpt = shape.options.get("critic_gradient_checkpointing")
    critic_shape = shape.for_role("critic")
    critic_shape = critic_shape if critic_ckpt is None else replace(critic_shape, grad_ckpt=critic_ckpt)

    def trained(role: str, lora: int, zero: int = zero) -> tuple[Terms, tuple[Terms, Terms], Terms, Terms]:
        """(state, gradients at the end of a backward (kept from step to step, made in each:
        gradient_terms), its engine's peak while built, what it holds after)."""
        params, trainable = role_params(shape, role, lora)
        state = offloaded(shape, role_state(params, trainable, vb, zero, dp, master=True))
        eager = Terms(grads=eager_gradient_bytes(trainable, shape.precision, zero))
        buffers = resident_buffers(trainable, vb, zero, shape.device, shape.reduce_bucket)
        grads = gradient_terms(trainable, vb, zero, dp, shape.precision, shape.reduce_bucket)
        if shape.offload and shape.device == "cuda":
            grads = offloaded_gradients(*grads, trainable, vb, zero, shape.reduce_bucket)
        if zero in (1, 2):  # built whole in fp32, then wrapped (measured around deepspeed.initialize)
            during, after = (offloaded(shape, t) for t in engine_build(params, trainable, vb, zero, dp, shape.mixed,
                                                                      shape.freed_returned))
            return state, grads, peak(build_transient(shape.for_role(role), params), during), after
        # ZeRO-0: the BF16_Optimizer makes every state and its fp32 gradients at once; ZeRO-3 builds the
        # partitions inside zero.Init, and its bucket's pages become resident at the first backward on the
        # host, at allocation on a GPU; its gradient partition (grads' kept) is made at the build's end, so the
        # engines built after it find it there
        at_init = state + eager + (buffers if shape.device == "cuda" else Terms())
        if zero == 0:
            at_init = peak(at_init, build_transient(shape.for_role(role), params))
        return state + buffers, grads, at_init, at_init + grads[0]

    if shape.stage in ("sft", "rm"):
        role = "actor" if shape.stage == "sft" else "reward"
        state, (kept_grads, made_grads), init, _ = trained(role, shape.lora)
        if shape.stage == "sft":
            work = forward_backward(shape, shape.batch, shape.seq, logits_copies=hf_loss_logits(shape), dropout=True)
        else:
            work = forward_backward(shape, 2 * shape.batch, shape.seq, dropout=True)
        kept = kept_gathered(shape, role)
        eager = Terms(grads=eager_gradient_bytes(role_params(shape, role, shape.lora)[1], shape.precision, zero))
        phases = {"init": init,
                  "training": state + eager + kept_grads + kept + step_transient(shape, work, made_grads)}
        if shape.stage == "rm":  # scoring follows the traced step's forward: it keeps the same gathered
            phases["evaluation"] = state + kept_grads + forward_only(shape, 2 * shape.batch, shape.seq) + kept
        return phases

    actor, actor_grads, actor_during, actor_after = trained("actor", shape.lora)
    critic, critic_grads, critic_during, critic_after = trained("critic", shape.options.get("critic_lora_dim", 0),
                                                                stages["critic"])
    frozen_params = {role: role_params(shape, role, 0)[0] for role in ("ref", "reward")}
    frozen_after = {role: frozen_role(shape.for_role(role), role, p, vb, dp if stages[role] >= 3 else 1)
                    for role, p in frozen_params.items()}
    # ZeRO-3's gradient partitions (kept) stay from the build through every phase
    resident = actor + critic + actor_grads[0] + critic_grads[0] + frozen_after["ref"] + frozen_after["reward"]
    eager = Terms(grads=eager_gradient_bytes(role_params(shape, "actor", shape.lora)[1], shape.precision, zero)
                  + eager_gradient_bytes(role_params(shape, "critic", 0)[1], shape.precision, stages["critic"]))
    # engines are built one after another (actor, reference, critic, reward): each one's build on top of
    # what the ones before it keep; outside zero.Init (ZeRO < 3, or a quantized role) a frozen model is also
    # built whole in fp32 first
    quant = dict(shape.quant)

    def build(role: str) -> Terms:
        whole = stages[role] < 3 or quant.get(role, "none") != "none"
        return build_transient(shape.for_role(role), frozen_params[role]) if whole else frozen_after[role]

    init = peak(
        actor_during,
        actor_after + build("ref"),
        actor_after + frozen_after["ref"] + critic_during,
        actor_after + frozen_after["ref"] + critic_after + build("reward"))
    seq = shape.seq
    critic_dropout = shape.options.get("critic_dropout")
    critic_dropout = True if critic_dropout is None else critic_dropout > 0
    # the update: actor loss and backward (log-softmax over its logits in the model's dtype), then the critic's
    actor_pass = step_transient(shape, forward_backward(
        shape, shape.batch, seq, logits_copies=4, dropout=bool(shape.options.get("actor_dropout"))), actor_grads[1])
    critic_pass = step_transient(shape, forward_backward(
        critic_shape, shape.batch, seq, dropout=critic_dropout), critic_grads[1])
    heavier = actor_pass if actor_pass.device >= critic_pass.device else critic_pass
    # grad_accum > 1: each rollout's update runs before the next rollout, so the accumulated gradients of both
    # trained engines stay through the next generation and experience making
    trained = (("actor", shape.lora), ("critic", shape.options.get("critic_lora_dim", 0)))
    held = Terms(grads=sum(held_gradient_bytes(role_params(shape, role, rank)[1], vb, stages[role], dp,
                                               shape.precision)
                           for role, rank in trained)) if shape.grad_accum > 1 else Terms()
    return {
        "init": init,
        "generation": resident + held + generation_cache(shape) + forward_only(shape, shape.batch, 1),
        "experience": resident + held + generation_cache(shape, copies=2) + forward_only(shape, shape.batch, seq, 3),
        "training": resident + eager + heavier,
    }
