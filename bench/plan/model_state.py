"""Model-state memory per device: the ZeRO paper's per-stage formulas and DeepSpeed's own estimators.

Model states are what an optimizer step needs alive between steps: the trained weights in the compute dtype,
their gradients, and the optimizer's fp32 states. Activations, caches, buckets and allocator slack are not
model states; the planner adds them separately. Both sources here count bytes per device for Ψ parameters.

ZeRO paper (Rajbhandari et al., SC'20, section 3): mixed-precision Adam holds 2Ψ of fp16 parameters, 2Ψ of
fp16 gradients and KΨ of optimizer states (fp32 master copy, momentum, variance: K = 12). Stage 1 partitions
the optimizer states over the N_d data-parallel ranks, stage 2 also the gradients, stage 3 also the
parameters.

DeepSpeed (0.19.8 here) ships `estimate_zero2_model_states_mem_needs` and `estimate_zero3_model_states_mem_needs`
with different bookkeeping: 18Ψ of partitioned state (fp16 and fp32 gradients, fp32 master, Adam's two moments),
a 1.5x "additional buffer factor" on the host, and for ZeRO-3 the largest layer gathered whole (4 bytes per
parameter: its fp16 weights and gradients). Before DeepSpeed PR #5099 (2024) the ZeRO-2 GPU line was
4Ψ + 16Ψ/N; that variant is kept because older installs and many calculators still print it. The integer
truncations sit where DeepSpeed puts them, so the figures match its output to the byte.
"""

from __future__ import annotations

from dataclasses import dataclass

DEEPSPEED_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size default (values); DS-Chat and trlx leave it
ADAM_K = 12  # bytes of optimizer state per parameter in the ZeRO paper: fp32 master + momentum + variance
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class ModelStateBytes:
    """Per device, in bytes."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class DeviceHostBytes:
    """What a DeepSpeed estimator prints: bytes per GPU, and bytes of host memory per node."""

    device: int
    host: int


def _check(name: str, value: int, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an integer >= {low}")


def zero_paper_bytes(params: int, stage: int, data_parallel: int, k: int = ADAM_K) -> ModelStateBytes:
    """Model states per device at a ZeRO stage (0 = plain data parallelism), the paper's formulas:
    (2 + 2 + K)Ψ, 4Ψ + KΨ/N_d, 2Ψ + (2 + K)Ψ/N_d, (2 + 2 + K)Ψ/N_d."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"stage={stage!r} is not a ZeRO stage; allowed: {', '.join(map(str, ZERO_STAGES))}")
    _check("params", params, 0)
    _check("data_parallel", data_parallel, 1)
    _check("k", k, 0)

    def share(partitioned: bool) -> float:
        return 1 / data_parallel if partitioned else 1.0

    return ModelStateBytes(params=2 * params * share(stage >= 3), grads=2 * params * share(stage >= 2),
                           optimizer=k * params * share(stage >= 1))


def zero2_step_bytes(trained: float, value_bytes: int, data_parallel: int) -> float:
    """What DeepSpeed's ZeRO-2 step holds of one model's gradients per rank (stage_1_and_2.py `step`, no
    gradient-accumulation dtype set, so the partition is the model's dtype and per parameter): the rank's
    partition, the flattened copy `step` makes of it and, under a half precision, that copy cast to fp32 for
    the optimizer: (2 x value bytes + 4) per trained parameter over the data-parallel ranks, 8 in fp32 (the cast
    is the same tensor). Measured on the CPU with the engine's counters (adapters/deepspeed_memory.py)."""
    cast = 0 if value_bytes == 4 else 4
    return (2 * value_bytes + cast) * trained / data_parallel


def deepspeed_zero2_estimate(params: int, gpus_per_node: int = 1, nodes: int = 1, cpu_offload: bool = True,
                             buffer_factor: float = 1.5, before_pr_5099: bool = False) -> DeviceHostBytes:
    """DeepSpeed's `estimate_zero2_model_states_mem_needs`. With the optimizer offloaded the GPU keeps only the
    fp16 parameters and the host the fp32 states (at least 16 bytes a parameter, 4 per GPU of the job);
    without, the GPU adds its 1/N of 18 bytes a parameter (4Ψ + 16Ψ/N before PR #5099) and the host holds a
    fp32 copy per GPU of the node while loading."""
    for name, value in (("params", params), ("gpus_per_node", gpus_per_node), ("nodes", nodes)):
        _check(name, value, 0 if name == "params" else 1)
    gpus = gpus_per_node * nodes
    if cpu_offload:
        return DeviceHostBytes(device=int(2 * params), host=int(params * max(4 * gpus, 16) * buffer_factor))
    # the fp16 parameters whole, 1/N of the rest (PR #5099 moved the fp16 gradients into the partitioned part)
    whole, partitioned = (4, 16) if before_pr_5099 else (2, 18)
    device = whole * params + int(partitioned * params / gpus)
    return DeviceHostBytes(device=int(device), host=int(params * 4 * gpus_per_node * buffer_factor))


def deepspeed_zero3_estimate(params: int, largest_layer_params: int, gpus_per_node: int = 1, nodes: int = 1,
                             cpu_offload: bool = True, cpu_offload_params: bool = True, zero_init: bool = True,
                             buffer_factor: float = 1.5) -> DeviceHostBytes:
    """DeepSpeed's `estimate_zero3_model_states_mem_needs`. Every GPU gathers the largest layer whole (its fp16
    weights and gradients, 4 bytes a parameter) on top of its partition: nothing else with parameters and
    optimizer offloaded, 2Ψ/N with the optimizer alone offloaded, 18Ψ/N with nothing offloaded. The host holds
    the offloaded states per node (18 or 16 bytes a parameter, divided over the nodes) or, without zero.Init,
    at least a fp32 copy of the model per GPU of the node while it loads."""
    for name, value in (("params", params), ("largest_layer_params", largest_layer_params),
                        ("gpus_per_node", gpus_per_node), ("nodes", nodes)):
        _check(name, value, 0 if "params" in name else 1)
    gpus = gpus_per_node * nodes
    per_node = 1 / nodes
    largest_layer = 4 * largest_layer_params
    if cpu_offload and cpu_offload_params:
        states = 18
        device = largest_layer
    elif cpu_offload:
        states = 16
        device = largest_layer + int(2 * params / gpus)
    else:
        device = largest_layer + int(18 * params / gpus)
        loading = largest_layer_params if zero_init else params
        return DeviceHostBytes(device=int(device), host=int(loading * 4 * gpus_per_node * buffer_factor))
    if zero_init:
        host = params * states * per_node * buffer_factor
    else:
        host = params * max(4 * gpus_per_node, states * per_node) * buffer_factor
    return DeviceHostBytes(device=int(device), host=int(host))
