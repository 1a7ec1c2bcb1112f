"""trlx's memory as this adapter runs it, per phase, for the planner (bench.plan). Imports no framework.

Roles and lifetimes follow the fidelity table (docs/frameworks/trlx.md). ZeRO-0 is accelerate's DDP with the
weights in fp32
(bf16 through autocast, which keeps a half copy of every weight it casts until the forward ends; DDP's
reducer holds a bucket per gradient); ZeRO >= 1 is DeepSpeed (adapters/deepspeed_memory.py). Forwards run
in eval mode (no dropout) but the RM stage's, which stays in train mode. SFT trains the whole LM; RM
(GPTRewardModel) freezes the bottom 70 % of the blocks; PPO trains one model: the trunk's top
`num_layers_unfrozen` blocks, the final norm, a position table, an untied head and a value head (h -> 2h -> 1),
with the reference as a "hydra" branch (frozen copies of the top blocks, final norm and the LM head), a whole
fp32 copy (num_layers_unfrozen=-1), or with LoRA (peft, on peft's default maps for the family: GPT-2's fused
QKV, Llama-style q and v) the same model with its adapters disabled. Experience making keeps the
policy's logits, KV cache and hidden states alive through the reference forward (which runs the trunk again);
the reward function is the RM-stage model on rank 0. The update runs `ppo_epochs` forward/backward passes
over the whole rollout.
"""

from __future__ import annotations

from adapters.accelerate_memory import accelerate_engine
from adapters.deepspeed_memory import (
    PERSISTENCE_THRESHOLD,
    engine_build,
    zero3_kept_gathered,
)
from adapters.lora_targets import PEFT_DEFAULTS
from adapters.trlx.options import default_layers_unfrozen
from bench.plan.physics import Terms, peak
from bench.plan.run_shape import (
    RunShape,
    build_transient,
    forward_backward,
    forward_only,
    frozen_role,
    generation_cache,
    hf_loss_logits,
    quantized_weight_bytes,
    step_transient,
)

# ZeRO-0 is accelerate's DDP (fp32 weights, autocast), not DeepSpeed: its allocator residual is its own, so the
# calibration fits it apart (bench.plan.calibration; at ZeRO-0 trlx's PPO experience keeps ~200 MiB more heap
# beyond its tensors than at ZeRO-2)
ZERO0_OWN_ENGINE = True


def _unfrozen(shape: RunShape, key: str, default: float) -> int:
    layers = shape.arch.layers
    if key == "rm_unfrozen_fraction":
        return int(shape.options.get(key, default) * layers)
    value = _raw_unfrozen(shape)
    return layers if value < 0 else min(value, layers)


def _targets(shape: RunShape) -> tuple[str, ...]:
    """The block's maps peft adapts: lora_targets, else peft's default for the family (GPT-2: c_attn, q k v;
    Llama-style: q and v)."""
    return shape.lora_targets or PEFT_DEFAULTS.get(shape.arch.family, ())


def _linear_inputs(shape: RunShape) -> float:
    """What the block's linear maps keep for gradients: all of them without LoRA, else the adapted ones (with
    peft's LoRA dropout, 0.1 in trlx's peft example, a dropped copy and a mask per adapted module)."""
    if not shape.lora:
        return shape.arch.linear_inputs()
    if (shape.options.get("lora") or {}).get("dropout", 0) > 0:
        return shape.arch.lora_dropout_inputs(_targets(shape), shape.device, shape.value_bytes)
    return shape.arch.linear_inputs(_targets(shape))


def _full_reference(shape: RunShape) -> bool:
    """The full reference (framework.reference=full, or auto at num_layers_unfrozen=-1, without LoRA): every layer
    trains and the reference is a whole fp32 copy."""
    reference = shape.options.get("reference", "auto")
    return not shape.lora and (reference == "full" or reference == "auto" and _raw_unfrozen(shape) < 0)


def _raw_unfrozen(shape: RunShape) -> int:
    value = shape.options.get("num_layers_unfrozen")
    return default_layers_unfrozen(shape.arch.family) if value is None else int(value)


def role_params(shape: RunShape, role: str, lora: int) -> tuple[int, int]:
    """(total, trainable) parameters of the one trained model of a stage. RM: GPTRewardModel, the backbone and
    a bias-free value head. PPO: the causal LM and a value head (h -> 2h -> 1); freezing the bottom blocks
    freezes the input embedding (and a head tied to it), so the top blocks, the final norm, a position table
    and an untied head train; the hydra branch adds frozen copies of the top blocks, the final norm and the
    head."""
    arch = shape.arch
    h = arch.hidden
    base = arch.total_params
    adapters = arch.lora_params(lora, _targets(shape))
    if role == "sft":
        return (base + adapters, adapters) if lora else (base, base)
    if role == "rm":
        backbone = arch.backbone_params + h
        if lora:
            return backbone + adapters, adapters + h
        top = _unfrozen(shape, "rm_unfrozen_fraction", 0.3)
        return backbone, top * arch.layer_params + arch.norm_params + arch.embedding_params + h
    value_head = 2 * h * h + 2 * h + 2 * h + 1
    if lora:  # peft on its targets; the reference: the same model, adapters off
        added = adapters + value_head
        return base + added, added
    if _full_reference(shape):
        return base + value_head, base + value_head
    top = _unfrozen(shape, "num_layers_unfrozen", 2)
    branch = top * arch.layer_params + arch.norm_params + arch.vocab * h
    positions = arch.embedding_params - arch.vocab * h  # a learned position table trains; rotary has none
    trainable = top * arch.layer_params + arch.norm_params + positions + arch.head_params + value_head
    return base + branch + value_head, trainable


def _quantized_branch(shape: RunShape, weight_bytes: int) -> Terms:
    """What reference.quant changes in the policy's state: the hydra branch's block weights (GPT-2: 12h^2 a
    block) in 8 or 4 bits instead of `weight_bytes` each; its LM head copy stays (adapters/quantize.py)."""
    arch = shape.arch
    top = _unfrozen(shape, "num_layers_unfrozen", 2)
    weights, rows = arch.block_weights() * top // arch.layers, arch.block_rows() * top // arch.layers
    mode = dict(shape.quant)["ref"]
    return Terms(params=quantized_weight_bytes(weights, rows, mode, shape.quant_library, weight_bytes)
                 - weights * weight_bytes)


def kept_gathered(shape: RunShape) -> Terms:
    """ZeRO-3's parameters kept gathered through a traced SFT or RM training step
    (adapters/deepspeed_memory.zero3_kept_gathered): every tensor of the LM, or of the reward model's backbone and
    value head (its frozen blocks too, measured), with peft's factors. RM scoring runs outside the trace and
    releases each module after use (at most the word embedding gathered, measured)."""
    if shape.zero < 3:
        return Terms()
    arch = shape.arch
    numels = arch.tensor_numels(lm_head=shape.stage == "sft") + arch.lora_numels(shape.lora, _targets(shape))
    if shape.stage == "rm":
        numels.append(arch.hidden)  # the value head
    return Terms(buffers=zero3_kept_gathered(numels, shape.value_bytes, PERSISTENCE_THRESHOLD))


def predict(shape: RunShape) -> dict[str, Terms]:
    vb = shape.value_bytes
    fp32_logits = 4 / vb  # one fp32 [B, T, V] tensor in units of the compute dtype
    role = shape.stage
    params, trainable = role_params(shape, role, shape.lora)
    state, kept_grads, made_grads = accelerate_engine(shape, params, trainable)
    # built whole in fp32 on every rank (ZeRO-3 too: no zero.Init, see the fidelity table), then wrapped
    if shape.zero == 0:  # DDP's construction broadcasts every parameter (frozen ones too) through copies
        init = Terms(params=state.params, buffers=4 * params)
    elif shape.zero < 3:  # measured around accelerator.prepare (bench.plan's engine_build)
        init = peak(build_transient(shape, params),
                    engine_build(params, trainable, vb, shape.zero, shape.data_parallel, shape.mixed,
                                 shape.freed_returned)[0])
    else:  # ZeRO-3's bucket pages become resident at the first backward on the host
        at_init = state if shape.device == "cuda" else Terms(params=state.params, optimizer=state.optimizer)
        init = peak(at_init, build_transient(shape, params))
    if role == "sft":
        work = forward_backward(shape, shape.batch, shape.seq, logits_copies=hf_loss_logits(shape),
                                linear_inputs=_linear_inputs(shape), trained_norms=not shape.lora)
        return {"init": init,
                "training": state + kept_grads + kept_gathered(shape) + step_transient(shape, work, made_grads)}
    if role == "rm":
        frozen = 0 if shape.lora else shape.arch.layers - _unfrozen(shape, "rm_unfrozen_fraction", 0.3)
        work = forward_backward(shape, 2 * shape.batch, shape.seq, dropout=True, frozen_layers=frozen,
                                linear_inputs=_linear_inputs(shape), trained_norms=not shape.lora)
        return {"init": init,
                "training": state + kept_grads + kept_gathered(shape) + step_transient(shape, work, made_grads),
                "evaluation": state + (kept_grads if shape.zero >= 3 else Terms())
                + forward_only(shape, 2 * shape.batch, shape.seq)}
    rm_params = shape.arch.backbone_params + shape.arch.hidden
    reward_fn = frozen_role(shape, "reward", rm_params, vb)  # rank 0
    if dict(shape.quant).get("ref", "none") != "none":
        state = state + _quantized_branch(shape, 4 if shape.zero == 0 else vb)
    # ZeRO-3's gradient partition stays from the build on (kept at ZeRO-0 is DDP's buckets and autocast's
    # copies, which live through a training step only)
    partition = kept_grads if shape.zero >= 3 else Terms()
    others = reward_fn
    if _full_reference(shape):  # a whole fp32 copy of the LM on every rank, outside accelerate
        others = others + frozen_role(shape, "ref", shape.arch.total_params, 4)
    resident = state + partition + others
    # the reward function's model is built in fp32 and loads the RM checkpoint's fp32 state dict, after the
    # policy's engine (ZeRO-3: its gradient partition made, its bucket's pages not yet written on the host)
    built = state if shape.zero < 3 or shape.device == "cuda" else Terms(params=state.params,
                                                                           optimizer=state.optimizer)
    init = peak(init + reward_fn, built + partition + build_transient(shape, rm_params) + Terms(other=4 * rm_params))
    seq = shape.seq
    logits_out = (fp32_logits if shape.zero == 0 and shape.mixed else 1)
    hidden_states = Terms(activations=2 * (shape.arch.layers + 1) * shape.batch * seq * shape.arch.hidden * vb)
    trained_all = shape.lora or _full_reference(shape)
    frozen = 0 if trained_all else shape.arch.layers - _unfrozen(shape, "num_layers_unfrozen", 2)
    # under the frozen blocks only a learned position table trains (the input embedding is frozen): a rotary
    # family's frozen blocks record nothing for autograd. Autograd's saved tensors of one update minibatch at
    # llama-base (ZeRO-2, 2 ranks) were 143 and 213 MiB at batch 2 and 4: 70 MiB a 2 x 256 tokens (the rest
    # weights), as the two trained blocks, the final norm and the log-softmax output are (69); with the ten
    # frozen blocks recording it would be 189
    position_table = shape.arch.traits.learned_positions
    work = forward_backward(shape, shape.batch, seq, logits_copies=logits_out + 3, frozen_layers=frozen,
                            linear_inputs=_linear_inputs(shape), trained_norms=not shape.lora,
                            trained_below=position_table)
    return {
        "init": init,
        "generation": resident + generation_cache(shape) + forward_only(shape, shape.batch, 1),
        "experience": resident + generation_cache(shape, copies=2) + hidden_states
        + forward_only(shape, shape.batch, seq, logits_copies=2 * logits_out + 1),
        "training": state + kept_grads + others + step_transient(shape, work, made_grads),
    }
