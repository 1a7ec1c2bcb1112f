"""Per-GPU memory of an RLHF (PPO) job on a GPU cluster, per role and per phase, for a given layout.

Four roles: actor (generation, inference, training), critic (inference, training), reference and reward
(inference). Each role runs under one layout (tensor, pipeline and data parallel degrees, a ZeRO stage,
optimizer offload, activation recomputation). Roles placed on the same GPUs add up: in every phase each GPU
holds every colocated role's resident bytes plus what the running phase needs on top, as DS-Chat runs it:
the actor's KV (or GLM `mems`) cache while generating; in experience making the actor's and the reference's
logits alive together with their caches; in training the actor's and the critic's passes one after the
other. Formulas: model states as the ZeRO paper (bench.plan.model_state) plus DeepSpeed's buffers (ZeRO-2's
reduce buckets of 5e8 values, two under overlap_comm, and the flattened copy it all-reduces; at ZeRO-3 a reduce
bucket, the gathered layer and the one prefetched; ZeRO-2's step, where its flattened and fp32 copies of the
gradient partition can outweigh the backward), activations as
Korthikanti et al. (bench.plan.physics; GLM's own attention materialises its scores, so the 5*a*s/h term is
kept unless the workload says flash attention), logits as b*s*v/t with an fp32 log-softmax and its gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bench.plan.model_state import DEEPSPEED_BUCKET, zero2_step_bytes
from bench.plan.physics import (
    Arch,
    Terms,
    cache_bytes,
    dtype_bytes,
    layer_activation_bytes,
    logits_bytes,
    peak,
)

GB = 1e9  # vendors' gigabyte, for bandwidths and host memory
GIB = 2**30  # torch reports device memory in bytes; its messages quote GiB
PHASES = ("generation", "inference", "training")
ROLES = ("actor", "critic", "reference", "reward")
ROLE_PHASES = {"actor": PHASES, "critic": ("inference", "training"), "reference": ("inference",),
               "reward": ("inference",)}
TRAINED = ("actor", "critic")
SAFETY = 0.9  # the share of a GPU's memory (torch's total_memory) a plan or a run may fill: the rest is headroom
MASTER_AND_MOMENTS = 12  # fp32 master weights, Adam's two moments: bytes per trained parameter
OFFLOADED_GRADS = 4  # ZeRO-Offload keeps an fp32 gradient per trained parameter on the host
LORA_TRAINS = ("factors", "unwrapped")


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float  # the vendor's nominal size (the name's "40GB")
    total_memory_gib: float  # what torch.cuda.get_device_properties().total_memory reports, GiB: the driver keeps
    # some of the nominal size, and how much moves by a few hundredths with driver, CUDA and ECC settings
    memory_source: str  # where total_memory_gib was read (a public CUDA out-of-memory report quoting it)
    bf16: bool
    tflops_16bit: float  # dense tensor-core peak, fp16/bf16
    hbm_gbps: float

    @property
    def total_memory_bytes(self) -> float:
        return self.total_memory_gib * GIB


# total_memory as torch reports it, from public out-of-memory messages ("GPU 0 has a total capacity of X GiB");
# where reports differ, the smallest seen, so a plan that fits the table fits the card under any driver seen.
GPUS = {g.name: g for g in (
    GPU("V100-16GB", 16, 15.77, "meta-llama/llama#918 (8 x Tesla V100 16GB)", False, 125, 900),
    GPU("V100-32GB", 32, 31.74, "liucongg/ChatGLM-Finetuning#73 (V100 32GB)", False, 125, 900),
    GPU("T4-16GB", 16, 14.75, "hpcaitech/Open-Sora#697 (Colab T4)", False, 65, 320),
    GPU("A10-24GB", 24, 22.06, "A10G out-of-memory reports (22.06 GiB); huggingface/local-gemma#25: ~22 GB", True,
        125, 600),
    GPU("A100-40GB", 40, 39.50, "TianheWu/CoSeR#10 (one A100 40GB; 39.59 elsewhere)", True, 312, 1555),
    GPU("A100-80GB", 80, 79.14, "lianqi1008/Control-GIC#6 (A100 80GB; 79.15-79.35 elsewhere)", True, 312, 2039),
    GPU("A800-80GB", 80, 79.33, "hahnyuan/PB-LLM#3 (A800-80G)", True, 312, 2039),
    GPU("H100-80GB", 80, 79.11, "vllm-project/vllm#27508 (H100; 79.19 elsewhere)", True, 989, 3350),
    GPU("H800-80GB", 80, 79.11, "no H800 report found: the H100 SXM's 80 GB HBM3 figure", True, 989, 3350),
    GPU("H200-141GB", 141, 139.80, "8 x H200 out-of-memory reports (139.80 GiB; 139.72-139.81)", True, 989, 4800),
)}


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu: str = "A100-40GB"  # name in GPUS: memory as torch reports it, peak FLOP/s, HBM bandwidth, bf16 support
    gpu_memory_gib: float | None = None  # your GPU's own total_memory / 2**30; None = the table's figure for gpu
    host_mem_gb: float = 1024.0  # per node
    intra_node_gbps: float = 150.0  # per-GPU bus bandwidth inside a node (NVLink), GB/s
    inter_node_gbps: float = 25.0  # per-GPU bandwidth across nodes (200 Gb/s InfiniBand), GB/s
    pcie_gbps: float = 16.0  # host <-> GPU, for offload
    mfu: float = 0.4  # achievable share of the peak in dense compute
    safety: float = SAFETY  # plans must stay under this share of the device

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"cluster.{name}={value!r} must be an integer >= 1")
        for name in ("gpu_memory_gib", "host_mem_gb", "intra_node_gbps", "inter_node_gbps", "pcie_gbps"):
            value = getattr(self, name)
            if name == "gpu_memory_gib" and value is None:
                continue
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
    def total_memory_bytes(self) -> float:
        """The device memory as torch reports it (total_memory): the figure a run's preflight also budgets."""
        if self.gpu_memory_gib is not None:
            return self.gpu_memory_gib * GIB
        return self.spec.total_memory_bytes

    @property
    def limit_bytes(self) -> float:
        return self.safety * self.total_memory_bytes

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
    lora: int = 0  # LoRA rank of the actor (and the critic unless critic_lora says otherwise); 0 = full fine-tuning
    critic_lora: int | None = None  # the critic's own rank (DS-Chat's --critic_lora_dim, 0 by default); None = lora
    lora_trains: str = "factors"  # factors: only the LoRA factors train (peft, coati); unwrapped: only the wrapped
    # weights freeze, everything else trains (DS-Chat's LinearLayer_LoRA without --only_optimize_lora)
    cache: str = "kv"  # kv | mems (GLM's own decoding: per-layer hidden states)
    flash_attention: bool = False  # GLM-10B's own attention materialises the scores
    release_inference_cache: bool = False  # DS-Chat's --release_inference_cache: the Hybrid Engine frees its KV
    # workspace after each rollout (by default it stays allocated through training)
    offload_reference: bool = False  # DS-Chat's --offload_reference_model: the reference's weights on the host
    offload_inference_models: bool = False  # ColossalChat: reference and reward on the host outside experience
    parallel_output: bool = True  # ColossalChat's parallel_output=False: every tp rank keeps whole-vocabulary logits
    keep_experience_caches: bool = True  # DS-Chat keeps each experience forward's whole output (its KV cache too)
    # until the experience is assembled; ColossalChat keeps only the logits (false)
    overlap_comm: bool = True  # DeepSpeed's overlap_comm, which DS-Chat's train config sets (DeepSpeed's own
    # default at ZeRO-1/2 is off): ZeRO-2 double-buffers its reduce bucket
    hydra_layers: int = 0  # trlx's hydra layout (num_layers_unfrozen = k > 0): only the actor's top k blocks (with
    # the final norm, learned positions and an untied head) train, the reference is a branch of k frozen blocks and
    # a head on the actor's trunk, the critic a value head on the actor's hidden states; 0 = separate models

    def __post_init__(self) -> None:
        if self.precision not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"workload.precision={self.precision!r}; allowed: bf16, fp16, fp32")
        for name in ("micro_batch", "global_batch", "prompt_len", "answer_len", "ppo_epochs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"workload.{name}={value!r} must be an integer >= 1")
        for name in ("lora", "critic_lora"):
            value = getattr(self, name)
            if (value is not None or name == "lora") and (isinstance(value, bool) or not isinstance(value, int)
                                                          or value < 0):
                raise ValueError(f"workload.{name}={value!r} must be an integer >= 0")
        if self.lora_trains not in LORA_TRAINS:
            raise ValueError(f"workload.lora_trains={self.lora_trains!r}; allowed: {', '.join(LORA_TRAINS)}")
        for name in ("flash_attention", "release_inference_cache", "offload_reference", "offload_inference_models",
                     "parallel_output", "keep_experience_caches", "overlap_comm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"workload.{name}={getattr(self, name)!r} must be true or false")
        if isinstance(self.hydra_layers, bool) or not isinstance(self.hydra_layers, int) or self.hydra_layers < 0:
            raise ValueError(f"workload.hydra_layers={self.hydra_layers!r} must be an integer >= 0")
        if self.hydra_layers and (self.lora or self.critic_lora):
            raise ValueError(f"workload.hydra_layers={self.hydra_layers} with LoRA: trlx builds no hydra branch under "
                             "peft (its reference is the adapter-disabled model); set hydra_layers=0")
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
    lora_trains: str = "factors"  # Workload.lora_trains
    hydra: int = 0  # Workload.hydra_layers: trlx's branch depth (0: separate models)

    @property
    def trained(self) -> bool:
        return self.name in TRAINED

    @property
    def params(self) -> int:
        """The causal LM; critic and reward: the backbone (no LM head) and a scalar value head (h -> 1). Under
        trlx's hydra the critic is its value head alone, an MLP h -> 2h -> 1 on the actor's hidden states, and
        the reference the branch: the top k blocks, the final norm and its own copy of the LM head."""
        arch = self.arch
        if self.hydra and self.name == "critic":
            return 2 * arch.hidden ** 2 + 4 * arch.hidden + 1
        if self.hydra and self.name == "reference":
            return self.hydra * arch.layer_params + arch.norm_params + arch.vocab * arch.hidden
        if self.name in ("critic", "reward"):
            return arch.backbone_params + arch.hidden
        return arch.total_params

    @property
    def trained_layers(self) -> int:
        """The blocks whose activations the backward needs: all, or under hydra the actor's top k."""
        return self.hydra if self.hydra and self.name == "actor" else self.arch.layers

    @property
    def lora_params(self) -> int:
        return self.arch.lora_params(self.lora) if self.trained and self.lora else 0

    @property
    def dense_trainable(self) -> int:
        """Trained parameters other than LoRA factors: all of them in full fine-tuning; with LoRA none
        (factors) or all but the wrapped block weights (unwrapped: DS-Chat's embeddings, norms, biases, head)."""
        if not self.trained:
            return 0
        if self.hydra and self.name == "actor":  # trlx freezes the word embedding (and a tied head) and the
            arch = self.arch  # blocks below the top k
            return self.params - arch.vocab * arch.hidden - (arch.layers - self.hydra) * arch.layer_params
        if not self.lora:
            return self.params
        return self.params - self.arch.block_weights() if self.lora_trains == "unwrapped" else 0

    @property
    def trainable(self) -> int:
        """Every parameter that trains: the dense ones and the LoRA factors."""
        return self.dense_trainable + self.lora_params


def _shard(layout: Layout) -> int:
    return layout.tp * layout.pp


def resident(role: Role, layout: Layout, workload: Workload) -> Terms:
    """What a role keeps on each of its GPUs in every phase: weights (split over tp x pp, and dp at ZeRO-3),
    optimizer states (the fp32 master copy and moments, split over dp from ZeRO-1; on the host with offload),
    LoRA factors with their gradients and states, and ZeRO-3's kept reduce bucket and gradient partition."""
    vb, shard = workload.value_bytes, _shard(layout)
    zero3 = layout.zero >= 3
    weights = role.params * vb / shard / (layout.dp if zero3 else 1)
    on_host = (zero3 and layout.offload) or (role.name == "reference" and workload.offload_reference)
    terms = Terms(params=0.0 if on_host else weights, host=weights if on_host else 0.0)
    if _kept_workspace(role, layout, workload):
        terms = terms + Terms(cache=hybrid_cache(role, layout, workload))
    if not role.trained:
        return terms
    master = MASTER_AND_MOMENTS if vb < 4 else 8
    if role.lora:  # the factors, their gradients and optimizer states, partitioned as ZeRO partitions any
        dp = layout.dp  # trained parameter: states from ZeRO-1, gradients from 2, weights at 3
        per_factor = (vb / (dp if zero3 else 1) + vb / (dp if layout.zero >= 2 else 1)
                      + master / (dp if layout.zero >= 1 else 1))
        terms = terms + Terms(lora=role.lora_params * per_factor / shard)
    if zero3:  # stage3.py allocates its reduce bucket whole at build and keeps it, whatever the trained values
        terms = terms + Terms(buffers=vb * DEEPSPEED_BUCKET)  # (LoRA factors alone included)
    dense = role.dense_trainable
    if not dense:
        return terms
    states = dense * master / shard / (layout.dp if layout.zero >= 1 else 1)
    if layout.offload:
        terms = terms + Terms(host=states + OFFLOADED_GRADS * dense / shard / layout.dp)
    else:
        terms = terms + Terms(optimizer=states)
    if zero3 and not layout.offload:  # and its gradient partition (grad_partitions_flat_buffer, zeroed at the
        terms = terms + Terms(grads=dense * vb / shard / layout.dp)  # build's end, kept: measured on the host)
    return terms


def parked(role: Role, workload: Workload) -> bool:
    """ColossalChat's offload_inference_models: the reference and reward models go to the host after each
    experience making and come back for the next, so they hold no GPU memory while the trained roles train."""
    return workload.offload_inference_models and role.name in ("reference", "reward")


def host_bytes(role: Role, layout: Layout, workload: Workload) -> float:
    """What a role keeps in host memory: offloaded states and weights, and a parked role's weights."""
    held = resident(role, layout, workload)
    return held.host + (held.params if parked(role, workload) else 0.0)


def hybrid_cache(role: Role, layout: Layout, workload: Workload) -> float:
    """The Hybrid Engine's KV workspace per GPU: tp x micro-batch sequences (the prompts all-gathered over the
    generation tp group) of the whole rollout, on 1/tp of the heads: a whole micro-batch's cache."""
    gen = layout.generation
    b, t = workload.micro_batch, gen.tp
    return cache_bytes(role.arch, b * t, workload.seq, t, 1, workload.value_bytes, workload.cache)


def _kept_workspace(role: Role, layout: Layout, workload: Workload) -> bool:
    """DeepSpeed's inference workspace stays allocated between rollouts unless --release_inference_cache."""
    return role.name == "actor" and bool(layout.generation_tp) and not workload.release_inference_cache


def _gathered(role: Role, layout: Layout, workload: Workload) -> float:
    """ZeRO-3 gathers a layer before it runs and prefetches the next: two of the largest module whole."""
    if layout.zero < 3:
        return 0.0
    return 2 * role.arch.largest_layer_params * workload.value_bytes / layout.tp


def training(role: Role, layout: Layout, workload: Workload) -> Terms:
    """On top of `resident`, at the peak of the role's backward: gradients (but ZeRO-3's partition, resident),
    the reduce bucket, the activations of the micro-batch (the first pipeline stage holds the whole model's worth
    under 1F1B) and, for the actor, the logits with an fp32 log-softmax and its gradient."""
    arch, vb, shard = role.arch, workload.value_bytes, _shard(layout)
    b, s, t = workload.micro_batch, workload.seq, layout.tp
    per_layer = layer_activation_bytes(arch, b, s, t, layout.recompute, vb, workload.flash_attention)
    activations = role.trained_layers * per_layer
    if role.trained_layers < arch.layers and arch.traits.learned_positions:
        # hydra under a learned position table (GPT-2's, which trlx leaves trainable): the gradient runs through
        # the frozen blocks to it, so they keep what their input gradients need; a rotary family's keep nothing
        activations += (arch.layers - role.trained_layers) * layer_activation_bytes(
            arch, b, s, t, layout.recompute, vb, workload.flash_attention, frozen=True)
    if layout.recompute:
        activations += layer_activation_bytes(arch, b, s, t, False, vb)
    if role.hydra and role.name == "critic":  # the value head's fp32 hidden layer, on the actor's hidden states
        activations = b * s * 2 * arch.hidden * 4 / t
    dense = role.dense_trainable
    # ZeRO-3's partition is resident (`resident`) but under offload, where it lives on the host and the GPU
    # holds the rank's gradients on their way there
    kept = layout.zero >= 3 and not layout.offload
    grads = 0.0 if kept else dense * vb / shard / (layout.dp if layout.zero >= 2 else 1)
    # ZeRO-2's buckets are allocated whole for any trained values, LoRA factors alone too
    trained = dense + role.lora_params
    bucket = zero2_reduce_bytes(trained / shard, vb, workload.overlap_comm) if layout.zero == 2 and trained else 0.0
    logits = logits_bytes(arch, b, s, _logit_split(layout, workload), 1) * (vb + 8) if role.name == "actor" else 0.0
    return Terms(grads=grads, activations=activations, logits=logits,
                 buffers=bucket + _gathered(role, layout, workload))


def zero2_reduce_bytes(trained: float, value_bytes: int, overlap_comm: bool) -> float:
    """DeepSpeed ZeRO-2's reduction buffers in the backward (stage_1_and_2.py, contiguous gradients, the model's
    dtype): the reduce bucket, allocated whole at reduce_bucket_size values whatever the model's size (an empty
    tensor on the device, all of which the caching allocator holds; the host counts only its written pages), a
    second one under overlap_comm (double buffering), and the flattened copy `allreduce_bucket` makes of a full
    bucket to all-reduce (use_multi_rank_bucket_allreduce, DeepSpeed's default), at most the trained values."""
    buckets = 2 if overlap_comm else 1
    return value_bytes * (buckets * DEEPSPEED_BUCKET + min(DEEPSPEED_BUCKET, trained))


def optimizer_step(role: Role, layout: Layout, workload: Workload) -> Terms:
    """On top of `resident`, at the optimizer step, once the backward has freed its activations: ZeRO-2's
    gradient partition with the flattened and fp32 copies the step makes of it (model_state.zero2_step_bytes);
    nothing the backward does not exceed at the other stages."""
    if layout.zero != 2 or not role.dense_trainable:
        return Terms()
    return Terms(grads=zero2_step_bytes(role.dense_trainable / _shard(layout), workload.value_bytes, layout.dp))


def training_peak(role: Role, layout: Layout, workload: Workload) -> Terms:
    """The training phase's peak on top of `resident`: the backward's end or the optimizer step, whichever holds
    more (a large model's ZeRO-2 step on a small micro-batch)."""
    return peak(training(role, layout, workload), optimizer_step(role, layout, workload))


def inference(role: Role, layout: Layout, workload: Workload) -> Terms:
    """On top of `resident`, a forward over the rollout without autograd: one layer's working set (its MLP
    and, without flash attention, its scores). The actor's and the reference's outputs that stay alive are
    `experience_keep`."""
    arch, vb = role.arch, workload.value_bytes
    b, s, t = workload.micro_batch, workload.seq, layout.tp
    work = s * b * _block_width(arch) / t * vb
    if not workload.flash_attention:
        work += 2 * b * arch.heads / t * s * s * vb
    if role.hydra and role.name == "reference":  # trlx's forward_hydra runs the trunk with every hidden state
        work += (arch.layers + 1) * b * s * arch.hidden / t * vb  # returned, and the branch on one of them
    if role.hydra and role.name == "critic":  # the value head rides on the actor's forward
        work = b * s * 2 * arch.hidden * 4 / t
    return Terms(activations=work, buffers=_gathered(role, layout, workload))


def _block_width(arch: Arch) -> float:
    """Values per token of one block's widest moment without autograd: its input and output and its MLP's
    intermediate tensors (GPT-2: the 4h GELU; SwiGLU: gate, up and their product, 3i). GPT-2 at 4h: 6h."""
    return 2 * arch.hidden + arch.intermediate * (3 if arch.traits.mlp == "swiglu" else 1)


def experience_keep(role: Role, layout: Layout, workload: Workload) -> Terms:
    """The actor's and the reference's outputs alive through the other forwards: logits, and where the
    framework keeps the whole output (DS-Chat) the KV cache transformers returns with it; but not the actor's
    when it recomputes: DS-Chat switches actor and critic to train mode before these forwards, and transformers
    returns no cache from a model training with gradient checkpointing."""
    if role.name not in ("actor", "reference"):
        return Terms()
    arch, vb = role.arch, workload.value_bytes
    b, s = workload.micro_batch, workload.seq
    kept = workload.keep_experience_caches and not (role.name == "actor" and layout.recompute)
    return Terms(logits=logits_bytes(arch, b, s, _logit_split(layout, workload), vb),
                 cache=cache_bytes(arch, b, s, layout.tp, layout.pp, vb, workload.cache) if kept else 0.0)


def _logit_split(layout: Layout, workload: Workload) -> int:
    """How many ways the vocabulary of the logits is split: tp (vocabulary-parallel output), or 1 where every
    tensor-parallel rank gathers the whole vocabulary (ColossalChat's parallel_output=False)."""
    return layout.tp if workload.parallel_output else 1


def generation(role: Role, layout: Layout, workload: Workload) -> Terms:
    """On top of `resident`, the actor decoding a micro-batch: its cache at the full rollout length, the
    prefill's working set and the last step's fp32 logits; with a generation layout of its own (the Hybrid
    Engine) also the weights gathered into that layout's shards, and the prompts all-gathered across the
    tensor-parallel group: each GPU decodes tp x micro-batch sequences on its share of the heads, so its
    cache is a whole micro-batch's (the Hybrid Engine's workspace, which `resident` keeps unless released). A
    training layout that already holds the generation layout's shard whole (ZeRO below 3, the same tp, no
    pipeline) gathers nothing: the engine decodes on the trained weights in place."""
    arch, vb = role.arch, workload.value_bytes
    gen = layout.generation
    b, t = workload.micro_batch, gen.tp
    if layout.generation_tp:
        sequences = b * t
        cache = 0.0 if _kept_workspace(role, layout, workload) else hybrid_cache(role, layout, workload)
    else:
        sequences = b
        cache = cache_bytes(arch, b, workload.seq, t, gen.pp, vb, workload.cache)
    prefill = workload.prompt_len * sequences * _block_width(arch) / t * vb
    if not workload.flash_attention:
        prefill += 2 * sequences * arch.heads / t * workload.prompt_len ** 2 * vb
    if not layout.generation_tp:
        gathered = _gathered(role, layout, workload)
    elif layout.zero == 3 or layout.tp != t or layout.pp > 1:  # the shards are gathered into the generation layout
        gathered = role.params * vb / t
    else:  # the training layout already holds the generation layout's whole shard: decoded in place
        gathered = 0.0
    return Terms(cache=cache, activations=prefill, logits=sequences * arch.vocab / t * 4, buffers=gathered)


TRANSIENT = {"generation": generation, "inference": inference, "training": training_peak}


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
        if phase == "training" and parked(role, workload):
            continue
        total = total + resident(role, layout, workload)
    running = [(r, lay) for r, lay in roles if phase in ROLE_PHASES[r.name]]
    if not running:
        return total
    if phase == "inference":
        for role, layout in running:
            total = total + experience_keep(role, layout, workload)
    return total + max((TRANSIENT[phase](r, lay, workload) for r, lay in running), key=lambda t: t.device)
