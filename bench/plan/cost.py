"""The planner's step-time estimate: a simple, stated cost model, for ranking plans, not for quoting.

Per role and phase, seconds = compute + communication, the phases of a PPO step one after another:
- compute: FLOPs (bench.measure.flops's formula: forward 2N + 4LCH per token, training 6N_trained + 4N_frozen +
  12LCH, recomputation one more forward) over the role's GPUs x the GPU's 16-bit peak x cluster.mfu, times
  the pipeline fill (m + pp - 1) / m for m micro-batches per data-parallel replica;
- decoding: each new token reads the stage's weights and cache from HBM (memory-bound at these batch sizes),
  max'ed with its FLOPs; (m + pp - 1) steps per token for m micro-batches;
- communication: ring all-reduce / all-gather volumes over the group's bandwidth (inside a node NVLink,
  across nodes the network; tensor parallel groups are placed inside a node, data parallel groups span
  nodes once tp x dp exceeds a node), plus 10 us (inside) / 30 us (across) per collective: gradient
  reduction per optimizer step, ZeRO-3's parameter gathers for every forward and backward (every decoded
  token when generating), tensor parallelism's 2 all-reduces per layer per forward (4 with the backward);
- offload: the gradients to the host and the weights back over PCIe, and the host's Adam at 20 GB/s;
- a generation layout of its own (the Hybrid Engine): the actor's weights gathered into it once per step
  (each GPU receives its generation shard), then decoding as above on that layout.
Parameter reallocation between phases, overlap of communication with compute and kernel efficiency by
shape are not modelled.
"""

from __future__ import annotations

from bench.plan.cluster import GB, ROLE_PHASES, Cluster, Layout, Role, Workload

LATENCY_INTRA_S = 10e-6
LATENCY_INTER_S = 30e-6
HOST_ADAM_GBPS = 20.0


def _bandwidth(cluster: Cluster, span: int) -> tuple[float, float]:
    """(bytes/s, latency) of a group whose members lie `span` GPUs apart at most."""
    if span <= cluster.gpus_per_node:
        return cluster.intra_node_gbps * GB, LATENCY_INTRA_S
    return cluster.inter_node_gbps * GB, LATENCY_INTER_S


def _ring(volume: float, size: int, bandwidth: float, latency: float, collectives: float) -> float:
    if size <= 1:
        return 0.0
    return 2 * (size - 1) / size * volume / bandwidth + collectives * latency


def phase_seconds(role: Role, layout: Layout, workload: Workload, cluster: Cluster, phase: str) -> float:
    if phase not in ROLE_PHASES[role.name]:
        return 0.0
    arch, vb = role.arch, workload.value_bytes
    n, trained = role.params + role.lora_params, role.trainable
    peak = cluster.spec.tflops_16bit * 1e12 * cluster.mfu
    gpus, tp, pp, dp = layout.gpus, layout.tp, layout.pp, layout.dp
    micro = max(1, workload.global_batch // (dp * workload.micro_batch))
    fill = (micro + pp - 1) / micro
    tp_bw, tp_lat = _bandwidth(cluster, tp)
    dp_bw, dp_lat = _bandwidth(cluster, tp * dp)
    stage_weights = role.params * vb / (tp * pp)
    layers_here = arch.layers / pp
    attention = 4 * arch.layers * workload.seq * arch.hidden
    if role.hydra and role.name == "critic":  # trlx's value head: no blocks of its own
        attention = 0
    elif role.hydra and role.name == "reference":  # forward_hydra runs the whole trunk again, then the branch
        n = arch.total_params + role.params
        attention = 4 * (arch.layers + role.hydra) * workload.seq * arch.hidden
    if phase == "generation" and layout.generation_tp:
        # the Hybrid Engine: gather the trained shards into the generation layout once, then decode on it
        gen = layout.generation
        weights = role.params * vb / gen.tp
        bandwidth, latency = _bandwidth(cluster, layout.gpus)
        reshard = weights / bandwidth + arch.layers * latency
        return reshard + phase_seconds(role, gen, workload, cluster, phase)
    if phase == "generation":
        prompts = workload.global_batch * workload.prompt_len
        prefill = (2 * n + attention) * prompts / (gpus * peak) * fill
        cache_stage = workload.micro_batch * workload.seq * 2 * arch.layers * arch.kv_width * vb / (tp * pp)
        per_token = max((stage_weights + cache_stage) / (cluster.spec.hbm_gbps * GB),
                        2 * n * workload.micro_batch / (tp * pp * peak))
        decode = workload.answer_len * (micro + pp - 1) * per_token
        tp_comm = workload.answer_len * micro * layers_here * _ring(
            workload.micro_batch * arch.hidden * vb, tp, tp_bw, tp_lat, 2)
        gather = 0.0
        if layout.zero >= 3:  # every decoded token gathers the stage's weights again
            gather = workload.answer_len * micro * _ring(stage_weights / 2, dp, dp_bw, dp_lat, layers_here)
        return prefill + decode + tp_comm + gather
    tokens = workload.global_batch * workload.seq
    activation_bytes = workload.micro_batch * workload.seq * arch.hidden * vb
    if phase == "inference":
        compute = (2 * n + attention) * tokens / (gpus * peak) * fill
        tp_comm = micro * layers_here * _ring(activation_bytes, tp, tp_bw, tp_lat, 2)
        gather = micro * _ring(stage_weights / 2, dp, dp_bw, dp_lat, layers_here) if layout.zero >= 3 else 0.0
        return compute + tp_comm + gather
    epochs = workload.ppo_epochs
    # frozen weights cost a forward and, where the gradient passes through them, its input gradient; under trlx's
    # hydra nothing flows below the top k blocks, so those run forward only
    below = (arch.layers - role.hydra) * arch.layer_params if role.hydra and role.name == "actor" else 0
    backward_attention = 2 * attention * (role.hydra / arch.layers if below else 1)
    flops = (6 * trained + 4 * (n - trained - below) + 2 * below + attention + backward_attention) * tokens
    if layout.recompute:
        flops += (2 * n + attention) * tokens
    compute = epochs * flops / (gpus * peak) * fill
    tp_comm = epochs * micro * layers_here * _ring(activation_bytes, tp, tp_bw, tp_lat, 4 + 2 * layout.recompute)
    grads = trained * vb / (tp * pp)
    reduce = epochs * _ring(grads / 2 if layout.zero >= 2 else grads, dp, dp_bw, dp_lat, 1)
    if layout.zero >= 3:
        reduce += epochs * micro * 2 * _ring(stage_weights / 2, dp, dp_bw, dp_lat, layers_here)
    offload = 0.0
    if layout.offload:
        shard = trained / (tp * pp * dp)
        offload = epochs * (shard * (4 + vb) / (cluster.pcie_gbps * GB) + shard * 16 / (HOST_ADAM_GBPS * GB))
    return compute + tp_comm + reduce + offload
