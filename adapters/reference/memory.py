"""The plain-PyTorch reference's memory as this adapter runs it, per phase, for the planner (bench.plan). Imports
no framework.

Layouts (options.LAYOUTS): ZeRO-0 is DDP, ZeRO-1 DDP with ZeroRedundancyOptimizer (AdamW's moments split over
the ranks), ZeRO-2 and ZeRO-3 FSDP2's fully_shard, one unit per block and one for the rest (embeddings, final
norm, head), without and with resharding after the forward. Trained models keep fp32 parameters and AdamW's fp32
moments (made at the first step); under DDP the forward runs in autocast, which keeps a half copy of each
weight it casts until the forward's saved tensors are freed, and DDP's reducer holds an fp32 bucket per
gradient from its construction; FSDP2 keeps fp32 shards and gathers them in the run's precision (its mixed
precision policy), reducing gradients in fp32. Frozen roles are held in the run's precision, sharded at ZeRO-3.
Every role is built whole in fp32 on every rank before it is wrapped, one after another. SFT keeps the model's
dropout (train mode); PPO disables it in the actor and critic. LoRA is peft's on every block map (or
lora_targets), without dropout; the value head trains beside it. Experience making runs one model at a time,
the actor's logits dropped before the reference runs; the update steps the actor before the critic's pass.
"""

from __future__ import annotations

from bench.plan.physics import Terms, peak, total
from bench.plan.run_shape import (
    RunShape,
    forward_backward,
    forward_only,
    frozen_role,
    generation_cache,
    hf_loss_logits,
    without_moments,
)


def role_params(shape: RunShape, role: str, lora: int) -> tuple[int, int]:
    """(total, trainable) parameters: the causal LM, or the backbone with a bias-free value head (h -> 1) for
    critic and reward; with LoRA, peft's factors on the block maps (lora_targets or all of them) and the value
    head train, nothing else."""
    arch = shape.arch
    head = role in ("critic", "reward")
    params = arch.backbone_params + arch.hidden if head else arch.total_params
    if not lora:
        return params, params
    added = arch.lora_params(lora, shape.lora_targets or arch.traits.meanings)
    return params + added, added + (arch.hidden if head else 0)


def _linear_inputs(shape: RunShape) -> float:
    if not shape.lora:
        return shape.arch.linear_inputs()
    return shape.arch.linear_inputs(shape.lora_targets or shape.arch.traits.meanings)


def _fsdp(shape: RunShape) -> bool:
    return shape.zero >= 2


def _gather_bytes(shape: RunShape) -> int:
    """FSDP2 gathers parameters in the run's precision (fp32 weights cast by its mixed precision policy)."""
    return shape.value_bytes


def _held(shape: RunShape, params: float) -> Terms:
    """What FSDP2 at ZeRO-2 (no resharding after the forward) keeps gathered of a role from a forward until that
    role's next backward ends: the whole role. A forward without autograd (rollout, experience, scoring) has no
    backward to reshard after, so what it gathered stays until the role trains again (read back from FSDP2's
    registered parameters: plain tensors after such a forward, sharded DTensors after the backward). ZeRO-3
    reshards after every forward, the root unit too."""
    return Terms(buffers=_gather_bytes(shape) * params) if shape.zero == 2 else Terms()


def _running(shape: RunShape, params: float) -> Terms:
    """ZeRO-3's parameters gathered while a role's forward or backward runs: the root unit (everything outside
    the blocks, gathered from the root's forward to its end) and two blocks (the one running and the one
    prefetched)."""
    if shape.zero < 3:
        return Terms()
    outside = params - shape.arch.layers * shape.arch.layer_params
    return Terms(buffers=_gather_bytes(shape) * (outside + 2 * shape.arch.layer_params))


def _gathered(shape: RunShape, params: float) -> Terms:
    """What FSDP2 holds gathered of a role while it runs."""
    return _held(shape, params) + _running(shape, params)


def _trained(shape: RunShape, params: float, trainable: float) -> tuple[Terms, Terms, Terms]:
    """(state after the first step, what the layout keeps beside it, the gradients a step makes and frees) of a
    trained role on one rank."""
    dp = shape.data_parallel
    shard = dp if _fsdp(shape) else 1
    moments_shard = dp if shape.zero >= 1 else 1
    state = Terms(params=4 * params / shard, optimizer=8 * trainable / moments_shard)
    if _fsdp(shape):  # the reduce-scattered fp32 gradient shard (zero_grad(set_to_none) frees it each step)
        return state, Terms(), Terms(grads=4 * trainable / dp)
    # DDP: the reducer's fp32 buckets cover every trained parameter from the wrapper's construction; the
    # gradients themselves are made by each backward (set_to_none at the step)
    return state, Terms(buffers=4 * trainable if dp > 1 else 0.0), Terms(grads=4 * trainable)


def _autocast_copies(shape: RunShape, params: float) -> Terms:
    """DDP's autocast casts each weight to the half dtype once per forward and keeps the copy while the
    forward's saved tensors hold it (FSDP2 gathers in that dtype instead, counted in _gathered)."""
    return Terms(buffers=2 * params) if shape.mixed and not _fsdp(shape) else Terms()


def _built(shape: RunShape, params: float) -> Terms:
    """A role built whole in fp32 on the rank before it is sharded or cast."""
    return Terms(other=4 * params)


def _pass(shape: RunShape, params: float, work: Terms, made: Terms) -> Terms:
    """A training step's transient of one role: the forward's saved tensors with what the layout gathers or
    casts for them, and the gradients its backward makes (run_shape.step_transient)."""
    forward = work + _gathered(shape, params) + _autocast_copies(shape, params)
    return peak(forward, made + _gathered(shape, params)) if shape.freed_returned else forward + made


def predict(shape: RunShape) -> dict[str, Terms]:
    vb, dp = shape.value_bytes, shape.data_parallel
    lora_norms = not shape.lora  # peft: only the factors (and a value head) train

    if shape.stage in ("sft", "rm"):
        role = "actor" if shape.stage == "sft" else "reward"
        params, trainable = role_params(shape, role, shape.lora)
        state, kept, made = _trained(shape, params, trainable)
        before = without_moments(state, trainable, dp if shape.zero >= 1 else 1)
        init = peak(_built(shape, params), before + kept)
        sequences = shape.batch if shape.stage == "sft" else 2 * shape.batch
        logits = hf_loss_logits(shape) if shape.stage == "sft" else 0.0
        work = forward_backward(shape, sequences, shape.seq, logits_copies=logits, dropout=True,
                                linear_inputs=_linear_inputs(shape), trained_norms=lora_norms)
        phases = {"init": init, "training": state + kept + _pass(shape, params, work, made)}
        if shape.stage == "rm":
            phases["evaluation"] = state + kept + _gathered(shape, params) + forward_only(shape, sequences, shape.seq)
        return phases

    trained = {role: role_params(shape, role, shape.lora) for role in ("actor", "critic")}
    states = {role: _trained(shape, *trained[role]) for role in trained}
    frozen_shard = dp if shape.zero >= 3 else 1
    frozen = {role: frozen_role(shape, role, role_params(shape, role, 0)[0], vb, frozen_shard)
              for role in ("ref", "reward")}
    resident = total([state + kept for state, kept, _ in states.values()] + list(frozen.values()))
    # built as setup builds them: actor and critic whole in fp32 (the critic loading the reward checkpoint's fp32
    # state dict beside them), both wrapped, then the reference and the reward one after the other, each whole in
    # fp32 with its checkpoint's state dict, cast to the run's precision (and sharded at ZeRO-3)
    wrapped = total([without_moments(states[role][0], trained[role][1], dp if shape.zero >= 1 else 1)
                     + states[role][1] for role in trained])
    frozen_params = {role: role_params(shape, role, 0)[0] for role in frozen}
    init = peak(_built(shape, trained["actor"][0] + 2 * trained["critic"][0]),
                wrapped + _built(shape, 2 * frozen_params["ref"]),
                wrapped + frozen["ref"] + _built(shape, 2 * frozen_params["reward"]))
    seq = shape.seq
    actor_params = trained["actor"][0]
    log_probs = 1 + 4 / vb  # gather_log_probs: the logits and their fp32 log-softmax
    actor_held, critic_held = _held(shape, actor_params), _held(shape, trained["critic"][0])
    # one model at a time: the actor's gathered weights kept from the rollout on, the critic's from its forward
    # (the last); the frozen roles are whole below ZeRO-3 and resharded after each forward at it
    experience = actor_held + peak(
        _running(shape, actor_params) + forward_only(shape, shape.batch, seq, logits_copies=log_probs),
        _running(shape, frozen_params["ref"]) + forward_only(shape, shape.batch, seq, logits_copies=log_probs),
        critic_held + _running(shape, trained["critic"][0]) + forward_only(shape, shape.batch, seq))
    passes = []
    # the actor's pass with the critic's weights still gathered from the experience; the critic's after the
    # actor's backward resharded the actor
    for role, logits, beside in (("actor", hf_loss_logits(shape), critic_held), ("critic", 0.0, Terms())):
        work = forward_backward(shape, shape.batch, seq, logits_copies=logits, linear_inputs=_linear_inputs(shape),
                                trained_norms=lora_norms)
        passes.append(beside + _pass(shape, trained[role][0], work, states[role][2]))
    return {
        "init": init,
        "generation": resident + _gathered(shape, actor_params) + generation_cache(shape)
        + forward_only(shape, shape.batch, 1),
        "experience": resident + experience,
        "training": resident + peak(*passes),
    }
