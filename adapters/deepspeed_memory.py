"""What DeepSpeed's engine holds per trained model beyond weights and optimizer states (DS-Chat and trlx both
train through it), for the planner's memory model. Imports no framework.

Read from DeepSpeed 0.19.8 (runtime/zero/stage_1_and_2.py, stage3.py, bf16_optimizer.py) and measured with
scripts/diagnostics/engine_buffers.py: the backward fills each parameter's half-precision `.grad` and copies it into the
reduce bucket (`reduce_bucket_size`, 5e8 elements by default; the host counts the pages one step writes, about
one value per trained parameter; ZeRO-2 then drops the `.grad`), all-reduces a flattened copy of the bucket,
and keeps the rank's part in a partition of the model's dtype, which the step flattens and casts to fp32
(zero2_made_bytes). At ZeRO-0 with bf16 the BF16_Optimizer keeps a whole fp32 gradient per parameter.
"""

from __future__ import annotations

from collections.abc import Iterable

from bench.plan.model_state import DEEPSPEED_BUCKET, zero2_step_bytes
from bench.plan.physics import Terms, peak

# DeepSpeed's defaults for stage3_max_reuse_distance and stage3_param_persistence_threshold (runtime/zero/config.py):
# neither framework sets the distance; DS-Chat sets the threshold to 1e4 (ds_utils.py), trlx's accelerate plugin
# leaves it
REUSE_DISTANCE_ELEMENTS = 1_000_000_000
PERSISTENCE_THRESHOLD = 100_000


def gradient_terms(trainable: float, value_bytes: int, zero: int, dp: int, precision: str = "bf16",
                   bucket_elements: int | None = None) -> tuple[Terms, Terms]:
    """(kept, made): gradient bytes of one trained model in its backward and step on one rank, on top of the eager fp32
    gradients (eager_gradient_bytes), split by lifetime. `kept` lives from the engine's build on, through every
    phase: ZeRO-3's partition of the gradients in the model's dtype (stage3's grad_partitions_flat_buffer, allocated
    with torch.zeros at the end of the build and never freed; its pages were resident after the build and through
    generation, experience and update alike: scripts/diagnostics/peak_moment.py and a residency count by mincore,
    DS-Chat PPO, llama-base with 2 layers, fp32, 2 ranks). `made` is the most the backward's end and the step
    allocate and free within each step (run_shape.step_transient): the half gradients on the parameters (ZeRO-0/1,
    until the step) and their fp32 partition, the fp32 gradients the step flattens at ZeRO-3, and ZeRO-2's larger
    moment (zero2_made_bytes)."""
    if zero == 2:
        reduce, step = zero2_made_bytes(trainable, value_bytes, dp, bucket_elements)
        return Terms(), Terms(buffers=reduce) if reduce >= step else Terms(grads=step)
    # ZeRO-3 keeps the rank's partition of the half gradients; ZeRO-0/1 keep them whole until the step
    half = value_bytes * trainable / (dp if zero >= 3 else 1)
    fp32 = 0.0 if eager_gradient_bytes(trainable, precision, zero) else 4 * trainable / (dp if zero >= 1 else 1)
    if zero >= 3:
        return Terms(grads=half), Terms(grads=fp32)
    return Terms(), Terms(grads=half + fp32)


def zero2_made_bytes(trainable: float, value_bytes: int, dp: int, bucket_elements: int | None = None
                     ) -> tuple[float, float]:
    """(at the reduction, at the step): what ZeRO-2 (stage_1_and_2.py, contiguous gradients; neither DS-Chat nor
    trlx sets a gradient-accumulation dtype, so it is the model's and the partition is per parameter, not the
    compact fp32 one) holds at its two moments.
    - The reduction at the backward's end: the reduce bucket (`bucket_elements`: ds.reduce_bucket_size, None for
      DeepSpeed's default; each gradient is copied into it as its hook fires and dropped) and the flattened copy
      `allreduce_bucket` makes of it to all-reduce (use_multi_rank_bucket_allreduce, DeepSpeed's default; neither
      framework sets it), so twice the bucket. Then the rank's part is copied into its partition
      (grads_in_partition, the model's dtype) and both are freed.
    - The step: that partition, the flattened copy of it `step` makes, and, under a half precision, that copy
      cast to fp32 for the optimizer (model_state.zero2_step_bytes, which the GPU planner shares).
    On the host only the bucket's written pages count (min of the trained values and the bucket); on a GPU the
    caching allocator holds the whole bucket (bench.plan.cluster.zero2_reduce_bytes)."""
    bucket = value_bytes * min(trainable, bucket_elements or DEEPSPEED_BUCKET)
    return 2 * bucket, zero2_step_bytes(trainable, value_bytes, dp)


def offloaded_gradients(kept: Terms, made: Terms, trainable: float, value_bytes: int, zero: int,
                        bucket_elements: int | None = None) -> tuple[Terms, Terms]:
    """gradient_terms' (kept, made) under ZeRO-Offload on a GPU (offload_optimizer cpu): ZeRO-3's gradient
    partition is allocated on the optimizer's device, the host (stage3.py: `self.device` is cpu when the optimizer
    is offloaded), and ZeRO-1/2 copy each reduced bucket into the fp32 partition on the host
    (stage_1_and_2.py's cpu_offload); the step's fp32 gradients are the host's too. The GPU keeps the reduce bucket
    and its flattened copy at ZeRO-1/2 (ZeRO-3's bucket is resident_buffers')."""
    moved = Terms(host=kept.device + kept.host + made.device)
    if zero >= 3:
        return moved, Terms()
    bucket = value_bytes * min(trainable, bucket_elements or DEEPSPEED_BUCKET)
    return moved, Terms(buffers=2 * bucket)


def held_gradient_bytes(trainable: float, value_bytes: int, zero: int, dp: int, precision: str) -> float:
    """What an engine keeps of the accumulated gradients between micro-batches (gradient_accumulation_steps
    > 1): ZeRO-2/3 the rank's partition in the model's dtype (measured, DS-Chat PPO at glm-base ZeRO-2 on 2
    ranks: the generation and experience phases of the second rollout hold 209 MiB more, actor + critic
    partitions 208 MiB); ZeRO-0/1 the whole gradients on the parameters (not measured), except bf16 at ZeRO-0,
    whose optimizer accumulates into the fp32 gradients it made at build (eager_gradient_bytes), and ZeRO-3, whose
    partition is resident from the build whatever the accumulation (gradient_terms' `kept`)."""
    if eager_gradient_bytes(trainable, precision, zero) or zero >= 3:
        return 0.0
    return value_bytes * trainable / (dp if zero >= 2 else 1)


def resident_buffers(trainable: float, value_bytes: int, zero: int, device: str,
                     bucket_elements: int | None = None) -> Terms:
    """ZeRO-3's reduce bucket (`bucket_elements`, None for DeepSpeed's default), allocated with the engine and
    kept: whole on a GPU; on the host only the pages a backward writes (about one value per trained
    parameter) become resident."""
    if zero < 3:
        return Terms()
    bucket_elements = bucket_elements or DEEPSPEED_BUCKET
    touched = bucket_elements if device == "cuda" else min(trainable, bucket_elements)
    return Terms(buffers=value_bytes * touched)


def zero3_kept_gathered(tensor_numels: Iterable[int], value_bytes: int, persistence_threshold: int) -> float:
    """What a ZeRO-3 engine keeps gathered whole when its forward turns into its backward, once it has traced a step (a
    loop that repeats one forward and backward: SFT, RM training, and DS-Chat's RM scoring between them). After a
    module's forward it releases a parameter only if the parameter's next use in the trace lies more than
    stage3_max_reuse_distance elements ahead (partitioned_param_coordinator.__params_to_release); the backward uses
    every one again within that distance on a model of up to 1e9 elements, so the whole model stays gathered.
    Parameters of at most `persistence_threshold` elements are never partitioned (the state counts them whole).
    Measured with scripts/diagnostics/peak_moment.py (llama-base, fp32, 2 ranks): 476 MiB gathered at once in DS-
    Chat's and trlx's SFT (the whole LM), 382 MiB in their RM training (the backbone) and DS-Chat's RM scoring;
    PPO's engines, whose traces the rollouts keep changing, release each module after use (at most 118-288 MiB)."""
    gathered = sum(n for n in tensor_numels if n > persistence_threshold)
    return value_bytes * min(gathered, REUSE_DISTANCE_ELEMENTS)


def eager_gradient_bytes(trainable: float, precision: str, zero: int) -> float:
    """fp32 gradients allocated when the engine is built: the BF16_Optimizer's at ZeRO-0."""
    return 4 * trainable if (zero == 0 and precision == "bf16") else 0.0


def engine_build(params: float, trainable: float, value_bytes: int, zero: int, dp: int, mixed: bool,
                 returned: bool = False) -> tuple[Terms, Terms]:
    """(peak while DeepSpeed wraps a model built whole, what the engine keeps after) at ZeRO-1/2, measured
    with RSS around `deepspeed.initialize` (DS-Chat and trlx, glm-base): the weights are cast in place, the
    trained ones copied into a flat buffer (their own tensors then freed: the engine keeps the weights once),
    then the fp32 master partition and the fp32 gradient partition are made (16-bit) -- Adam's moments wait for
    the first step. In fp32 the flat copy is the peak and no separate gradient partition is made up front.
    With the freed heap kept resident the trained weights' freed pages stay under the partitions made after;
    `returned` (run_shape.RunShape.freed_returned) gives them back first, and the build peaks at the flat copy
    or at what the engine keeps, whichever is more."""
    shard = dp if zero >= 1 else 1
    fp32_states = (8 if mixed else 4) * trainable / shard
    weights = value_bytes * params
    after = Terms(params=weights, optimizer=fp32_states)
    flat_copy = Terms(params=weights, buffers=value_bytes * trainable)
    if returned:
        return peak(flat_copy, after), after
    return flat_copy + Terms(optimizer=fp32_states if mixed else 0.0), after
