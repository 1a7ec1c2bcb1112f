"""ColossalChat's (coati's) memory as this adapter runs it, per phase, for the planner (bench.plan). Imports
no framework.

Roles and lifetimes follow the fidelity table (docs/frameworks/colossalai.md): SFT trains the actor with
dropout and transformers'
loss (an fp32 upcast of the logits), RM scores chosen and rejected sequences in one batch; PPO boosts actor
and critic with their own HybridAdam (moments made at the first step) and the frozen reference and reward
without an optimizer; dropout is disabled in the actor and critic; experience making joins the actor's and
the reference's chunked logits into two [B, T, V] tensors alive through the reward and critic calls, with
no KV cache; the update runs the actor's backward, then the critic's forward and backward, and steps both
after, so the actor's gradients are alive through the critic's pass. The booster's plugins: data parallel
with AMP (`3d` at tp = pp = 1) at ZeRO-0 keeps whole fp32 master weights and moments and casts its half
gradients to fp32 at the step; LowLevelZero (ZeRO-1/2) partitions them and reduces through a 12 M-element
bucket. LoRA (coati's own) wraps the block linears, the embeddings, the LM head and the value head (with
lora_targets: the block linears coati's name rule matches, nothing else), drops the wrapped linears' biases
and trains only the LoRA weights (norms frozen).
"""

from __future__ import annotations

from adapters.colossalai.lora_match import matched_layers
from adapters.colossalai.options import bucket_in_mi
from bench.plan.physics import Terms, peak, total
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
    without_moments,
)

MI = 2**20
REDUCE_BUCKET_ELEMENTS = 12 * MI  # LowLevelZeroPlugin(reduce_bucket_size_in_m=12): 12 x 1,048,576 values


def reduce_bucket_elements(shape: RunShape) -> int:
    """The plugin's reduce bucket: ds.reduce_bucket_size in whole Mi values, as the adapter hands it to the
    plugin (options.bucket_in_mi), else the default."""
    if shape.reduce_bucket is None:
        return REDUCE_BUCKET_ELEMENTS
    return bucket_in_mi(shape.reduce_bucket) * MI


def role_params(shape: RunShape, role: str, lora: int) -> tuple[int, int]:
    """(total, trainable) parameters: the causal LM, or the backbone with a value head (h -> 1 with bias) for
    critic and reward. LoRA (train_bias none) adds r*(d_in + d_out) to every block map, the input embedding, a
    position table, and the LM head or value head, and drops the biases of the layers it wraps; with
    lora_targets only the block maps coati's name rule matches."""
    arch = shape.arch
    h = arch.hidden
    head = role in ("critic", "reward")
    params = arch.backbone_params + h + 1 if head else arch.total_params
    if not lora:
        return params, params
    if shape.lora_targets is not None:  # target_modules: the matched block maps only, their biases dropped
        layers = matched_layers(shape.lora_targets, arch.family)
        added = arch.lora_params(lora, layers)
        return params + added - _biases(shape, layers), added
    added = arch.lora_params(lora) + lora * (arch.vocab + h)
    if arch.traits.learned_positions:
        added += lora * (arch.positions + h)
    added += lora * (h + 1) if head else lora * (h + arch.vocab)
    dropped_biases = _biases(shape, arch.traits.meanings) + (1 if head else 0)
    return params + added - dropped_biases, added


def _biases(shape: RunShape, meanings: tuple[str, ...]) -> int:
    """The biases of the block maps `meanings` name, over all blocks (GPT-2's four modules: 9h a block)."""
    arch = shape.arch
    return arch.layers * sum(arch.linear_shape(m)[1] for m in meanings if m in arch.traits.biased)


def _linear_inputs(shape: RunShape) -> float:
    """What the block maps keep for gradients: all carry LoRA by default, else the matched ones."""
    if not shape.lora or shape.lora_targets is None:
        return shape.arch.linear_inputs()
    return shape.arch.linear_inputs(matched_layers(shape.lora_targets, shape.arch.family))


def _working(trainable: float, shape: RunShape) -> Terms:
    """The working gradients a backward writes (whole until reduced; partitioned at ZeRO-2) and the reduce bucket
    (ZeRO-1/2)."""
    dp, zero, vb = shape.data_parallel, shape.zero, shape.value_bytes
    bucket = vb * min(trainable, reduce_bucket_elements(shape)) if zero >= 1 else 0.0
    return Terms(grads=vb * trainable / (dp if zero >= 2 else 1), buffers=bucket)


def _step_copy(trainable: float, shape: RunShape) -> Terms:
    """The fp32 gradients the step makes under mixed precision for this rank's part of the master. At fp32 the
    step hands the master its part as it is (LowLevelZero's `grad.to(master dtype)` copies nothing), and without
    ZeRO DDP keeps whole fp32 gradients."""
    return Terms(grads=4 * trainable / (shape.data_parallel if shape.zero >= 1 else 1) if shape.mixed else 0.0)


def _gradients(trainable: float, shape: RunShape) -> Terms:
    """The working gradients and the step's fp32 copy, all made within a step and freed by its zero_grad
    (run_shape.step_transient)."""
    return _working(trainable, shape) + _step_copy(trainable, shape)


def _at_step(trainable: float, shape: RunShape) -> Terms:
    """A role's gradients while its optimizer steps on a GPU: the fp32 copy, beside the working gradients under
    LowLevelZero (ZeRO-1/2), which keeps its working partitions in the grad store until every copy is made; at
    ZeRO-0 the AMP optimizer (MixedPrecisionOptimizer.step) frees each working gradient as it makes its copy."""
    return _step_copy(trainable, shape) + (_working(trainable, shape) if shape.zero >= 1 else Terms())


def _gpu_update(shape: RunShape, actor_t: float, critic_t: float, critic_work: Terms) -> Terms:
    """PPO's update on a GPU, whose allocated bytes follow the tensors alive (the CPU's retained heap sums every
    transient): the actor's working gradients through the critic's backward, then the actor's step beside the
    critic's gradients, then after the actor's zero_grad the critic's step."""
    critic_grads = _working(critic_t, shape)
    return peak(_working(actor_t, shape) + critic_work + critic_grads, _at_step(actor_t, shape) + critic_grads,
                _at_step(critic_t, shape))


def predict(shape: RunShape) -> dict[str, Terms]:
    vb, zero, dp = shape.value_bytes, shape.zero, shape.data_parallel
    # LowLevelZero (ZeRO-1/2) clones each rank's shard to fp32 as its master whatever the working dtype
    # (master_weights=True, the plugin's default), so an fp32 run holds the shard twice; at ZeRO-0 only the 3d
    # plugin's AMP optimizer keeps one (mixed precision; fp32 runs TorchDDPPlugin's plain optimizer)
    master = shape.mixed or zero in (1, 2)
    mp = shape.tp * shape.pp  # the 3d plugin's tensor and pipeline shards: each rank holds 1/(tp x pp) of a model

    def trained(role: str, lora: int) -> tuple[Terms, Terms, float]:
        params, trainable = role_params(shape, role, lora)
        state = offloaded(shape, role_state(params / mp, trainable / mp, vb, zero, dp, master))
        return state, _gradients(trainable / mp, shape), params

    def before_first_step(role: str, lora: int) -> Terms:
        """HybridAdam makes its moments at the first step; the master copy exists from boosting on (on the host
        under offload)."""
        params, trainable = role_params(shape, role, lora)
        state = role_state(params / mp, trainable / mp, vb, zero, dp, master)
        return offloaded(shape, without_moments(state, trainable / mp, dp if zero >= 1 else 1))

    if shape.stage in ("sft", "rm"):
        role = "actor" if shape.stage == "sft" else "reward"
        state, grads, params = trained(role, shape.lora)
        init = peak(before_first_step(role, shape.lora), build_transient(shape, params))
        if shape.stage == "sft":
            work = forward_backward(shape, shape.batch, shape.seq, logits_copies=hf_loss_logits(shape), dropout=True,
                                    linear_inputs=_linear_inputs(shape), trained_norms=not shape.lora)
        else:
            work = forward_backward(shape, 2 * shape.batch, shape.seq, dropout=True,
                                    linear_inputs=_linear_inputs(shape), trained_norms=not shape.lora)
        if shape.device == "cuda":  # the fp32 copy is made at the step, after the backward freed the activations
            trainable = role_params(shape, role, shape.lora)[1] / mp
            update = peak(work + _working(trainable, shape), _at_step(trainable, shape))
        else:
            update = step_transient(shape, work, grads)
        phases = {"init": init, "training": state + update}
        if shape.stage == "rm":
            phases["evaluation"] = state + forward_only(shape, 2 * shape.batch, shape.seq)
        return phases

    actor, actor_grads, _ = trained("actor", shape.lora)
    critic, critic_grads, _ = trained("critic", shape.lora)
    frozen = total([frozen_role(shape, role, role_params(shape, role, 0)[0] / mp, vb) for role in ("ref", "reward")])
    resident = actor + critic + frozen
    seq = shape.seq
    # the reward model is built last, whole in fp32, while the others are boosted already
    reward_params = role_params(shape, "reward", 0)[0]
    init = (before_first_step("actor", shape.lora) + before_first_step("critic", shape.lora)
            + frozen_role(shape, "ref", role_params(shape, "ref", 0)[0] / mp, vb)
            + build_transient(shape, reward_params))
    # the critic's pass with the actor's gradients still alive (both step after it)
    inputs = _linear_inputs(shape)
    norms = not shape.lora  # coati's LoRA freezes every norm
    critic_work = forward_backward(shape, shape.batch, seq, linear_inputs=inputs, trained_norms=norms)
    if shape.device == "cuda":
        update = _gpu_update(shape, role_params(shape, "actor", shape.lora)[1] / mp,
                             role_params(shape, "critic", shape.lora)[1] / mp, critic_work)
    else:
        update = actor_grads + step_transient(shape, critic_work, critic_grads)
    # on a GPU the actor's backward holds its working gradients only (the fp32 copy comes at the step, _gpu_update)
    actor_backward = _working(role_params(shape, "actor", shape.lora)[1] / mp, shape) if shape.device == "cuda" \
        else actor_grads
    actor_pass = step_transient(shape, forward_backward(shape, shape.batch, seq, logits_copies=4,
                                                        linear_inputs=inputs, trained_norms=norms), actor_backward)
    heavier = update if update.device >= actor_pass.device else actor_pass
    # grad_accum > 1: coati's counter steps after the last rollout's update, so the earlier ones' gradients stay
    # in the ZeRO grad store (the rank's partition at ZeRO-2, whole below) through the next rollouts
    held = Terms(grads=sum(vb * role_params(shape, role, shape.lora)[1] / mp / (dp if zero >= 2 else 1)
                           for role in ("actor", "critic"))) if shape.grad_accum > 1 else Terms()
    # offload_inference_models (non-Gemini plugins): the reference and reward go to the host after experience
    # making and come back before the next; on a CPU host the move stays on the device the run measures
    shuttled = (shape.device == "cuda" and zero < 3
                and (shape.options.get("ppo") or {}).get("offload_inference_models", True))
    updating = actor + critic + (Terms(host=frozen.device + frozen.host) if shuttled else frozen)
    return {
        "init": init,
        "onload": resident + held,
        "generation": resident + held + generation_cache(shape) + forward_only(shape, shape.batch, 1),
        "experience": resident + held + forward_only(shape, shape.batch, seq, logits_copies=3),
        "offload": updating + held,
        "training": updating + heavier,
    }
