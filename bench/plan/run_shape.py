"""What a framework's memory model reads from a run spec, torch-free, and the building blocks it composes.

A framework's model (adapters/<framework>/memory.py, next to the code whose tensors it describes) returns, for
one stage, the bytes each phase adds over the post-import baseline on the busiest rank, split into terms
(bench.plan.physics.Terms). The model states come from arithmetic on the roles' parameter counts; the
transient terms (activations, logits, caches, gradients, buckets) from the shapes the phase runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from bench.plan.physics import (
    Arch,
    Terms,
    cache_bytes,
    dtype_bytes,
    inference_activation_bytes,
    layer_saved_bytes,
    logits_bytes,
    peak,
)
from bench.run.spec import RunSpec

# glibc's own starting mmap threshold: fixed there (or lower), every tensor of a size the memory model counts is
# mapped on its own and unmapped at its free, so freed tensors leave nothing resident; above it, a tensor class
# below the threshold stays in the heap (docs/performance.md "A lower threshold")
RETURNED_THRESHOLD = 128 * 2**10


def returns_freed(mmap_threshold: int | None) -> bool:
    """Whether a host run's freed tensors give their pages back: a fixed mmap threshold of at most
    RETURNED_THRESHOLD. glibc's own threshold (None) rises to the size of the blocks freed, after which the
    freed heap stays resident."""
    return mmap_threshold is not None and mmap_threshold <= RETURNED_THRESHOLD


@dataclass(frozen=True)
class RunShape:
    arch: Arch
    stage: str  # sft | rm | ppo
    precision: str
    zero: int
    lora: int
    batch: int
    prompt_len: int
    answer_len: int
    data_parallel: int
    tp: int
    pp: int
    grad_ckpt: bool
    offload: bool
    options: dict[str, Any]
    dropout: float = 0.0  # the model's dropout; each framework says which roles train with it
    quant: tuple[tuple[str, str], ...] = ()  # (frozen role, none | int8 | nf4): reference.quant, reward.quant
    quant_library: str = "torchao"
    reduce_bucket: int | None = None  # ds.reduce_bucket_size (values); None: each engine's default
    lora_targets: tuple[str, ...] | None = None  # block layers with LoRA (lora_targets); None: each framework's
    grad_accum: int = 1  # micro-batches (PPO: rollouts) per optimizer step
    device: str = "cpu"  # cpu | cuda: sdpa's attention keeps fp32 probabilities with dropout on the CPU only
    # the host allocator hands freed tensors' pages back (glibc's mmap threshold fixed at RETURNED_THRESHOLD or
    # below, memory_mmap_threshold): RSS follows the tensors alive at once (step_transient)
    freed_returned: bool = False
    # critic and reward built from another model (DS-Chat's --critic_model_name_or_path); None: the run's model
    critic_arch: Arch | None = None

    def for_role(self, role: str) -> RunShape:
        """The shape a role's model has: the critic's and the reward's arch where they have their own."""
        if role in ("critic", "reward") and self.critic_arch is not None:
            return dataclasses.replace(self, arch=self.critic_arch, critic_arch=None)
        return self

    @classmethod
    def from_spec(cls, spec: RunSpec, stage: str, device: str = "cpu") -> RunShape:
        model = spec.model
        arch = Arch(hidden=model.hidden, layers=model.layers, heads=model.heads, vocab=model.vocab,
                    positions=model.positions, family=model.arch, kv_heads=model.kv_heads,
                    intermediate=model.intermediate, tied=model.tie_embeddings)
        return cls(arch=arch, stage=stage, precision=spec.precision, zero=spec.zero, lora=spec.lora,
                   batch=spec.batch, prompt_len=spec.prompt_len, answer_len=spec.answer_len,
                   data_parallel=spec.data_parallel, tp=spec.tp, pp=spec.pp, grad_ckpt=spec.grad_ckpt,
                   offload=spec.offload, options=dict(spec.framework_options), dropout=model.dropout,
                   device=device, quant=(("ref", spec.reference.quant), ("reward", spec.reward.quant)),
                   quant_library=spec.quant_library, reduce_bucket=spec.ds.reduce_bucket_size,
                   lora_targets=spec.lora_target_set, grad_accum=spec.grad_accum,
                   freed_returned=device == "cpu" and returns_freed(spec.memory_mmap_threshold))

    @property
    def value_bytes(self) -> int:
        """Bytes of one value in the compute dtype."""
        return dtype_bytes(self.precision)

    @property
    def mixed(self) -> bool:
        return self.precision != "fp32"

    @property
    def seq(self) -> int:
        return self.prompt_len + self.answer_len


def adam_bytes(trainable: float, master: bool, shard: int = 1) -> float:
    """Adam's two fp32 moments, plus the fp32 master copy when the weights are half precision."""
    return (12 if master else 8) * trainable / shard


def role_state(params: float, trainable: float, weight_bytes: int, zero: int, dp: int, master: bool) -> Terms:
    """A role's weights and optimizer states on one rank: weights split at ZeRO-3, optimizer from ZeRO-1."""
    return Terms(params=params * weight_bytes / (dp if zero >= 3 else 1),
                 optimizer=adam_bytes(trainable, master, dp if zero >= 1 else 1))


def offloaded(shape: RunShape, state: Terms) -> Terms:
    """A trained role's model state under ZeRO-Offload (offload=true) on a GPU: the optimizer states (fp32 master
    and moments) in host memory, and at ZeRO-3 the weights' partitions too (DS-Chat's offload_param, Gemini's
    auto placement). On a CPU host nothing moves: the host is the device the run measures."""
    if not shape.offload or shape.device != "cuda":
        return state
    params = state.params if shape.zero < 3 else 0.0
    return dataclasses.replace(state, optimizer=0.0, params=params,
                               host=state.host + state.optimizer + state.params - params)


def frozen_state(params: float, weight_bytes: int, shard: int = 1) -> Terms:
    return Terms(params=params * weight_bytes / shard)


def quantized_weight_bytes(weights: float, rows: float, mode: str, library: str = "torchao",
                           value_bytes: int = 2) -> float:
    """Linear weights as the quantization library stores them (adapters/quantize.py): int8 in both, one fp32
    scale per output row; NF4 two values a byte and an 8-bit absmax per block of 64, whose 256-block groups
    keep one factor more: fp32 in bitsandbytes, the run's `value_bytes` in torchao."""
    if mode == "int8":
        return weights + 4 * rows
    factor_bytes = 4 if library == "bitsandbytes" else value_bytes
    return weights / 2 + weights / 64 + factor_bytes * weights / (64 * 256)


def frozen_role(shape: RunShape, role: str, params: float, weight_bytes: int, shard: int = 1) -> Terms:
    """A frozen whole-model role (reference or reward): in `weight_bytes` per value, sharded `shard` ways -- or,
    quantized (shape.quant), its blocks' linear weights (GPT-2: 12h^2 a block, 9h output rows) in 8 or 4 bits
    and the rest (embeddings, norms, biases, heads) as before, whole on every rank."""
    mode = dict(shape.quant).get(role, "none")
    if mode == "none":
        return frozen_state(params, weight_bytes, shard)
    weights = shape.arch.block_weights()
    return Terms(params=(params - weights) * weight_bytes + quantized_weight_bytes(
        weights, shape.arch.block_rows(), mode, shape.quant_library, weight_bytes))


def forward_backward(shape: RunShape, sequences: int, seq: int, logits_copies: float = 0.0, dropout: bool = False,
                     linear_inputs: float | None = None, frozen_layers: int = 0, trained_norms: bool = True,
                     trained_below: bool = True) -> Terms:
    """A trained forward and backward over `sequences` x `seq` tokens on one rank: what the blocks save for the
    backward (physics.layer_saved_bytes; every block's linear maps keep their inputs -- `linear_inputs`
    h-values, default all of them -- but `frozen_layers`, the bottom ones, which keep none; `trained_norms`:
    whether the norms' weights train, which an RMSNorm's saved output follows; with gradient checkpointing
    only the blocks' inputs plus one block rebuilt), the embedding and final norm outputs, and `logits_copies`
    [sequences, seq, vocab] tensors counted in units of the compute dtype (an fp32 upcast counts 2 at 16
    bits). `trained_below`: whether something under the frozen blocks trains (a learned position table, the
    embedding), so that the gradient runs through them and autograd records them; without, their forward
    records nothing (no input of theirs needs a gradient)."""
    arch = shape.arch
    vb = shape.value_bytes
    n = arch.layers
    sbh = sequences * seq * arch.hidden
    drop = dropout and shape.dropout > 0
    inputs = arch.linear_inputs() if linear_inputs is None else linear_inputs

    def block(inputs: float, norms: bool) -> float:
        return layer_saved_bytes(arch, sequences, seq, vb, drop, shape.device, inputs, norms) / shape.tp

    if shape.grad_ckpt:
        kept = n * 2 * sbh * vb + block(inputs, trained_norms)
    else:
        frozen = frozen_layers * block(0, False) if trained_below else 0.0
        kept = (n - frozen_layers) * block(inputs, trained_norms) + frozen
    # 1F1B: the first pipeline stage holds pp micro-batches of layers/pp blocks, the whole model's worth
    activations = kept + 3 * sbh * vb
    return Terms(activations=activations,
                 logits=logits_copies * logits_bytes(arch, sequences, seq, shape.tp, shape.value_bytes))


def step_transient(shape: RunShape, work: Terms, made: Terms) -> Terms:
    """A training step's transient on top of what stays: `work`, the tensors the forward saves for the backward
    (forward_backward), and `made`, what the backward and the optimizer step allocate and free again within the
    step (gradients and reduce buckets, per engine). The backward frees the saved tensors as it writes the
    gradients, so with the freed pages returned (shape.freed_returned) the step peaks at the backward's start or
    at its end, whichever holds more; with the freed heap kept resident, the gradients land in fresh pages beside
    the activations' freed ones and the peak is their sum (measured on the host, docs/performance.md "What 128
    KiB shows of the physics"). A GPU's allocated bytes keep the sum, not measured in this split (DeepSpeed's ZeRO-2
    allocates its bucket whole at the backward's start, before it frees anything)."""
    return peak(work, made) if shape.freed_returned else work + made


def forward_only(shape: RunShape, sequences: int, seq: int, logits_copies: float = 0.0) -> Terms:
    """A forward without autograd: one block's transient and `logits_copies` [sequences, seq, vocab] tensors."""
    arch = shape.arch
    return Terms(activations=inference_activation_bytes(arch, sequences, seq, shape.tp, shape.value_bytes),
                 logits=logits_copies * logits_bytes(arch, sequences, seq, shape.tp, shape.value_bytes))


def generation_cache(shape: RunShape, copies: int = 1) -> Terms:
    """The KV cache of `copies` forwards over the whole rollout (prompt + answer) of the rank's batch."""
    return Terms(cache=copies * cache_bytes(shape.arch, shape.batch, shape.seq, shape.tp, shape.pp,
                                            shape.value_bytes, "kv"))


def build_transient(shape: RunShape, params: float) -> Terms:
    """A model built whole in fp32 (random initialisation or a checkpoint's load) before its engine casts it
    to the compute dtype: the fp32 copy, plus the cast's new copy of the largest tensor. On a GPU the model is
    built on the host (from_pretrained) before the engine moves it: host memory of each rank, not the GPU's."""
    largest = shape.arch.largest_layer_params
    built = 4 * params + (shape.value_bytes * largest if shape.mixed else 0)
    return Terms(host=built) if shape.device == "cuda" else Terms(other=built)


def without_moments(state: Terms, trainable: float, shard: int) -> Terms:
    """A role's state before its first step, for optimizers that make Adam's moments then."""
    return Terms(params=state.params, optimizer=state.optimizer - 8 * trainable / shard, buffers=state.buffers)


def hf_loss_logits(shape: RunShape) -> float:
    """[B, T, V] tensors, in units of the compute dtype, alive when transformers' causal-LM loss starts its
    backward (counted by autograd's saved-tensor hooks): the fp32 log-softmax it saved and the gradient
    flowing back through it, in fp32 and then in the compute dtype. The forward's own logits and their fp32
    upcast are not kept."""
    return (2 * 4 + shape.value_bytes) / shape.value_bytes
