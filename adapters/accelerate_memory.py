"""What a model trained through accelerate holds (trlx and TRL both prepare theirs with it), for the planner's
memory models. Imports no framework.

At ZeRO-0 accelerate wraps the model in DDP with its weights in fp32 (bf16 or fp16 through autocast, which keeps a
half copy of every weight it casts until the forward ends; the reducer holds a bucket per gradient); at ZeRO >= 1
it hands the model to DeepSpeed (adapters/deepspeed_memory.py), which keeps the weights in the compute dtype.
"""

from __future__ import annotations

from adapters.deepspeed_memory import gradient_terms, offloaded_gradients, resident_buffers
from bench.plan.physics import Terms
from bench.plan.run_shape import RunShape, offloaded, role_state


def accelerate_engine(shape: RunShape, params: float, trainable: float) -> tuple[Terms, Terms, Terms]:
    """(state, gradients kept from step to step, gradients made in each step: run_shape.step_transient) of one
    prepared model: DDP with fp32 weights at ZeRO-0 (its reducer's buckets and autocast's copies kept, the fp32
    gradients made), else DeepSpeed (deepspeed_memory.gradient_terms)."""
    vb, zero, dp = shape.value_bytes, shape.zero, shape.data_parallel
    if zero == 0:
        state = role_state(params, trainable, 4, 0, dp, master=False)
        autocast_copies = 2 * params if shape.mixed else 0.0
        return state, Terms(buffers=4 * trainable + autocast_copies), Terms(grads=4 * trainable)
    bucket = shape.reduce_bucket
    state = offloaded(shape, role_state(params, trainable, vb, zero, dp, master=True)) + resident_buffers(
        trainable, vb, zero, shape.device, bucket)
    grads = gradient_terms(trainable, vb, zero, dp, shape.precision, bucket)
    if shape.offload and shape.device == "cuda":
        grads = offloaded_gradients(*grads, trainable, vb, zero, bucket)
    return (state, *grads)
