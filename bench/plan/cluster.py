"""Per-GPU memory of an RLHF (PPO) job on a GPU cluster, per role and per phase, for a given layout.

Four roles: actor (generation, inference, training), critic (inference, training), reference and reward
(inference). Each role runs under one layout (tensor, pipeline and data parallel degrees, a ZeRO stage,
optimizer offload, activation recomputation). Roles placed on the same GPUs add up: in every phase each GPU
holds every colocated role's resident bytes plus what the running phase needs on top, as DS-Chat runs it:
the actor's KV (or GLM `mems`) cache while generating; in experience making the actor's and the reference's
logits alive together with their caches; in training the actor's and the critic's passes one after the
other. Formulas: model states as the ZeRO paper (bench.plan.model_state) plus DeepSpeed's buffers (a reduce
bucket of up to 5e8 values at ZeRO >= 2; at ZeRO-3 the gathered layer and the one prefetched), activations as
Korthikanti et al. (bench.plan.physics; GLM's own attention materialises its scores, so the 5*a*s/h term is
kept unless the workload says flash attention), logits as b*s*v/t with an fp32 log-softmax and its gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bench.plan.physics import (
    Arch,
    Terms,
    cache_bytes,
    dtype_bytes,
    layer_activation_bytes,
    logits_bytes,
)

GB = 1e9  # vendors' gigabyte: an "A100 40GB" has 40e9 bytes and change
PHASES = ("generation", "inference", "training")
ROLES = ("actor", "critic", "reference", "reward")
ROLE_PHASES = {"actor": PHASES, "critic": ("inference", "training"), "reference": ("inference",),
               "reward": ("inference",)}
TRAINED = ("actor", "critic")
DEEPSPEED_BUCKET = 500_000_000  # reduce_bucket_size default (values)
MASTER_AND_MOMENTS = 12  # fp32 master weights, Adam's two moments: bytes per trained parameter
OFFLOADED_GRADS = 4  # ZeRO-Offload keeps an fp32 gradient per trained parameter on the host


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float
    bf16: bool
    tflops_16bit: float  # dense tensor-core peak, fp16/bf16
    hbm_gbps: float


GPUS = {g.name: g for g in (
    GPU("V100-16GB", 16, False, 125, 900), GPU("V100-32GB", 32, False, 125, 900),
    GPU("T4-16GB", 16, False, 65, 320), GPU("A10-24GB", 24, True, 125, 600),
    GPU("A100-40GB", 40, True, 312, 1555), GPU("A100-80GB", 80, True, 312, 2039),
    GPU("H100-80GB", 80, True, 989, 3350), GPU("H200-141GB", 141, True, 989, 4800),
)}


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_mem_gb: float
    gpu: str = "A100-40GB"  # name in GPUS: peak FLOP/s, HBM bandwidth, bf16 support
    host_mem_gb: float = 1024.0  # per node
    intra_node_gbps: float = 150.0  # per-GPU bus bandwidth inside a node (NVLink), GB/s
    inter_node_gbps: float = 25.0  # per-GPU bandwidth across nodes (200 Gb/s InfiniBand), GB/s
    pcie_gbps: float = 16.0  # host <-> GPU, for offload
    mfu: float = 0.4  # achievable share of the peak in dense compute
    safety: float = 0.9  # plans must stay under this share of the device

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"cluster.{name}={value!r} must be an integer >= 1")
        for name in ("gpu_mem_gb", "host_mem_gb", "intra_node_gbps", "inter_node_gbps", "pcie_gbps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"cluster.{name}={value!r} must be a positive finite number")
        if self.gpu not in GPUS:
            raise ValueError(f"cluster.gpu={self.gpu!r} is not known; allowed: {', '.join(GPUS)}")
        if not 0 < self.mfu <= 1 or not 0 < self.safety <= 1:
            raise ValueError(f"cluster.mfu={self.mfu!r} and cluster.safety={self.safety!r} must be in (0, 1]")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def limit_bytes(self) -> float:
        return self.safety * self.gpu_mem_gb * GB

    @property
    def spec(self) -> GPU:
        return GPUS[self.gpu]


@dataclass(frozen=True)
class Workload:
    precision: str = "bf16"
    micro_batch: int = 1  # sequences per GPU per forward/backward (and per generation batch)
    global_batch: int = 64  # prompts per PPO step
    prompt_len: int = 512
    answer_len: int = 512
    ppo_epochs: int = 1
    lora: int = 0  # LoRA rank of the trained roles; 0 = full fine-tuning
    cache: str = "kv"  # kv | mems (GLM's own decoding: per-layer hidden states)
    flash_attention: bool = False  # GLM-10B's own attention materialises the scores

    def __post_init__(self) -> None:
        if self.precision not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"workload.precision={self.precision!r}; allowed: bf16, fp16, fp32")
        for name in ("micro_batch", "global_batch", "prompt_len", "answer_len", "ppo_epochs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"workload.{name}={value!r} must be an integer >= 1")
        if isinstance(self.lora, bool) or not isinstance(self.lora, int) or self.lora < 0:
            raise ValueError(f"workload.lora={self.lora!r} must be an integer >= 0")
        if self.cache not in ("kv", "mems"):
            raise ValueError(f"workload.cache={self.cache!r}; allowed: kv, mems")

    @property
    def seq(self) -> int:
        return self.prompt_len + self.answer_len

    @property
    def value_bytes(self) -> int:
        return dtype_bytes(self.precision)


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 0
    offload: bool = False
    recompute: bool = False
    generation_tp: int = 0  # the actor only: generate on its own tensor-parallel layout (0 = the same)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def generation(self) -> Layout:
        """The layout generation runs on: DS-Chat's Hybrid Engine gathers the trained weights into
        `generation_tp`-way tensor-parallel shards (pipeline 1, the rest data parallel) for the rollout."""
        if not self.generation_tp:
            return self
        return Layout(tp=self.generation_tp, pp=1, dp=self.gpus // self.generation_tp)

    @property
    def notation(self) -> str:
        """ReaL's d{dp}p{pp}m{tp}, then the ZeRO stage and the switches that are on."""
        extra = "".join((" offload" if self.offload else "", " recompute" if self.recompute else "",
                         f" gen d{self.generation.dp}p1m{self.generation_tp}" if self.generation_tp else ""))
        return f"d{self.dp}p{self.pp}m{self.tp} z{self.zero}{extra}"


@dataclass(frozen=True)
class Role:
    name: str
    arch: Arch
    lora: int = 0

    @property
    def trained(self) -> bool:
        return self.name in TRAINED

    @property
    def params(self) -> int:
        """The causal LM; critic and reward: the backbone (no LM head) and a scalar value head (h -> 1)."""
        if self.name in ("critic", "reward"):
            return self.arch.backbone_params + self.arch.hidden
        return self.arch.total_params

    @property
    def lora_params(self) -> int:
        return self.arch.lora_params(self.lora) if self.trained and self.lora else 0

    @property
    def trainable(self) -> int:
        if not self.trained:
            return 0
        return self.lora_params if self.lora else self.params


def _shard(layout: Layout) -> int:
    return layout.tp * layout.pp


def resident(role: Role, layout: Layout, workload: Workload) -> Terms:
    """What a role keeps on each of its GPUs in every phase: weights (split over tp x pp, and dp at ZeRO-3),
    optimizer states (the fp32 master copy and moments, split over dp from ZeRO-1; on the host with offload),
    LoRA factors with their gradients and states, and ZeRO-3's kept reduce bucket."""
    vb, shard = workload.value_bytes, _shard(layout)
    zero3 = layout.zero >= 3
    weights = role.params * vb / shard / (layout.dp if zero3 else 1)
    terms = Terms(params=0.0 if (zero3 and layout.offload) else weights,
                  host=weights if (zero3 and layout.offload) else 0.0)
    if not role.trained:
        return terms
    master = MASTER_AND_MOMENTS if vb < 4 else 8
    if role.lora:  # the factors, their gradients and optimizer states, partitioned as ZeRO partitions any
        dp = layout.dp  # trained parameter: states from ZeRO-1, gradients from 2, weights at 3
        per_factor = (vb / (dp if zero3 else 1) + vb / (dp if layout.zero >= 2 else 1)
                      + master / (dp if layout.zero >= 1 else 1))
        return terms + Terms(lora=role.lora_params * per_factor / shard)
    states = role.trainable * master / shard / (layout.dp if layout.zero >= 1 else 1)
    if layout.offload:
        terms = terms + Terms(host=states + OFFLOADED_GRADS * role.trainable / shard / layout.dp)
    else:
        terms = terms + Terms(optimizer=states)
    if zero3:
        terms = terms + Terms(buffers=vb * min(DEEPSPEED_BUCKET, role.trainable / shard))
    return terms


def _gathered(role: Role, layout: Layout, workload: Workload) -> float:
    """ZeRO-3 gathers a layer before it runs and prefetches the next: two of the largest module whole."""
    if layout.zero < 3:
        return 0.0
    return 2 * role.arch.largest_layer_params * workload.value_bytes / layout.tp


def training(role: Role, layout: Layout, workload: Workload) -> Terms:
    """On top of `resident`, at the peak of the role's backward: gradients, the reduce bucket, the
    activations of the micro-batch (the first pipeline stage holds the whole model's worth under 1F1B) and,
    for the actor, the logits with an fp32 log-softmax and its gradient."""
    arch, vb, shard = role.arch, workload.value_bytes, _shard(layout)
    b, s, t = workload.micro_batch, workload.seq, layout.tp
    per_layer = layer_activation_bytes(arch, b, s, t, layout.recompute, vb, workload.flash_attention)
    activations = arch.layers * per_layer
    if layout.recompute:
        activations += layer_activation_bytes(arch, b, s, t, False, vb)
    grads = 0.0 if role.lora else role.trainable * vb / shard / (layout.dp if layout.zero >= 2 else 1)
    bucket = 0.0
    if layout.zero == 2 and not role.lora:
        bucket = vb * min(DEEPSPEED_BUCKET, role.trainable / shard)
    logits = logits_bytes(arch, b, s, t, 1) * (vb + 8) if role.name == "actor" else 0.0
    return Terms(grads=grads, activations=activations, logits=logits,
                 buffers=bucket + _gathered(role, layout, workload))


def inference(role: Role, layout: Layout, workload: Workload) -> Terms:
    """On top of `resident`, a forward over the rollout without autograd: one layer's working set (its MLP
    and, without flash attention, its scores). The actor's and the reference's outputs that stay alive are
    `experience_keep`."""
    arch, vb = role.arch, workload.value_bytes
    b, s, t = workload.micro_batch, workload.seq, layout.tp
    work = s * b * _block_width(arch) / t * vb
    if not workload.flash_attention:
        work += 2 * b * arch.heads / t * s * s * vb
    return Terms(activations=work, buffers=_gathered(role, layout, workload))


def _block_width(arch: Arch) -> float:
    """Values per token of one block's widest moment without autograd: its input and output and its MLP's
    intermediate tensors (GPT-2: the 4h GELU; SwiGLU: gate, up and their product, 3i). GPT-2 at 4h: 6h."""
    return 2 * arch.hidden + arch.intermediate * (3 if arch.traits.mlp == "swiglu" else 1)


def experience_keep(role: Role, layout: Layout, workload: Workload) -> Terms:
    """The actor's and the reference's outputs alive through the other forwards: logits and cache."""
    if role.name not in ("actor", "reference"):
        return Terms()
    arch, vb = role.arch, workload.value_bytes
    b, s = workload.micro_batch, workload.seq
    return Terms(logits=logits_bytes(arch, b, s, layout.tp, vb),
                 cache=cache_bytes(arch, b, s, layout.tp, layout.pp, vb, workload.cache))


def generation(role: Role, layout: Layout, workload: Workload) -> Terms:
    """On top of `resident`, the actor decoding a micro-batch: its cache at the full rollout length, the
    prefill's working set and the last step's fp32 logits; with a generation layout of its own (the Hybrid
    Engine) also the weights gathered into that layout's shards."""
    arch, vb = role.arch, workload.value_bytes
    gen = layout.generation
    b, t = workload.micro_batch, gen.tp
    cache = cache_bytes(arch, b, workload.seq, t, gen.pp, vb, workload.cache)
    prefill = workload.prompt_len * b * _block_width(arch) / t * vb
    if not workload.flash_attention:
        prefill += 2 * b * arch.heads / t * workload.prompt_len ** 2 * vb
    gathered = role.params * vb / t if layout.generation_tp else _gathered(role, layout, workload)
    return Terms(cache=cache, activations=prefill, logits=b * arch.vocab / t * 4, buffers=gathered)


TRANSIENT = {"generation": generation, "inference": inference, "training": training}


def role_phase(role: Role, layout: Layout, workload: Workload, phase: str) -> Terms:
    """What one role adds on top of its resident bytes in a phase it runs (its outputs kept included)."""
    added = TRANSIENT[phase](role, layout, workload)
    return added + experience_keep(role, layout, workload) if phase == "inference" else added


def phase_terms(roles: list[tuple[Role, Layout]], phase: str, workload: Workload) -> Terms:
    """Per GPU of a set of colocated roles in one phase: every role's resident bytes, plus the phase's own:
    the roles run one after another, so the largest working set counts, but the actor's and the reference's
    experience outputs (logits, caches) are alive together."""
    total = Terms()
    for role, layout in roles:
        total = total + resident(role, layout, workload)
    running = [(r, lay) for r, lay in roles if phase in ROLE_PHASES[r.name]]
    if not running:
        return total
    if phase == "inference":
        for role, layout in running:
            total = total + experience_keep(role, layout, workload)
    return total + max((TRANSIENT[phase](r, lay, workload) for r, lay in running), key=lambda t: t.device)
