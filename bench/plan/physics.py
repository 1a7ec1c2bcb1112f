"""Bytes that follow from a model's shape: parameters, activations, logits, the generation cache and LoRA.

Pure arithmetic on a GPT-2-style block (pre-LN, fused QKV h -> 3h, attention output h -> h, a 4h GELU MLP,
biases, tied input/output embedding, learned positions): the GLM stand-in the adapters build, and GLM-10B's
own block (../shared/reference/memory-and-stability.md section 8). Activations follow Korthikanti et al. 2022
(per layer s*b*h*(34 + 5*a*s/h) bytes at 16 bits; with tensor parallelism t: s*b*h*(10 + 24/t + 5*a*s/(h*t));
with full recomputation only the layer input, 2*s*b*h). The figures are per device for the given degrees.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}
CACHE_KINDS = ("kv", "mems")  # HF-style K and V per layer, or GLM's per-layer input hidden states


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is not known; allowed: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


# A block's linear maps by their lora_targets names: (input, output) width in hidden sizes
LORA_LAYERS = {"qkv": (1, 3), "attn_out": (1, 1), "mlp_in": (1, 4), "mlp_out": (4, 1)}
ALL_LORA_LAYERS = tuple(LORA_LAYERS)


def lora_linear_inputs(targets: tuple[str, ...]) -> int:
    """h-values per token that the `targets` maps save for their weight (or LoRA) gradients: 7 for all four."""
    return sum(LORA_LAYERS[t][0] for t in targets)


@dataclass(frozen=True)
class Arch:
    """The shape of a GPT-2/GLM-style causal LM."""

    hidden: int
    layers: int
    heads: int
    vocab: int
    positions: int
    position_tables: int = 1  # GLM-10B has two (positions and block positions); the stand-in one

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "vocab", "positions", "position_tables"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.hidden % self.heads:
            raise ValueError(f"heads={self.heads} must divide hidden={self.hidden}")

    @property
    def layer_params(self) -> int:
        """QKV 3h^2 + 3h, output h^2 + h, MLP 8h^2 + 5h, two LayerNorms 4h: 12h^2 + 13h."""
        h = self.hidden
        return 12 * h * h + 13 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.position_tables * self.positions * self.hidden

    @property
    def total_params(self) -> int:
        """Unique parameters (the tied output embedding once), final LayerNorm included."""
        return self.layers * self.layer_params + self.embedding_params + 2 * self.hidden

    @property
    def largest_layer_params(self) -> int:
        """The largest single module's own parameters (DeepSpeed's ZeRO-3 estimator): the word embedding,
        or the MLP's 4h x h matrix in a model with a small vocabulary."""
        return max(self.vocab * self.hidden, 4 * self.hidden * self.hidden + 4 * self.hidden)

    def lora_params(self, rank: int, targets: tuple[str, ...] = ALL_LORA_LAYERS) -> int:
        """LoRA A and B on the `targets` linear maps of each block, r*(d_in + d_out) each: all four give
        r*(h + 3h) + r*(h + h) + r*(h + 4h) + r*(4h + h) = 16*r*h per layer."""
        if rank < 0:
            raise ValueError(f"lora rank={rank} must be >= 0")
        return rank * self.hidden * self.layers * sum(sum(LORA_LAYERS[t]) for t in targets)

    def block_weights(self, targets: tuple[str, ...] = ALL_LORA_LAYERS) -> int:
        """The weights (no biases) of the `targets` linear maps over all blocks: all four give 12*h^2 per layer."""
        return self.hidden ** 2 * self.layers * sum(d_in * d_out for d_in, d_out in (LORA_LAYERS[t] for t in targets))


@dataclass(frozen=True)
class Terms:
    """Bytes per device, by kind; `host` is what sits in host memory instead (offloaded states). `lora` holds
    LoRA factors with their gradients and optimizer states where a model counts them apart."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    logits: float = 0.0
    cache: float = 0.0
    buffers: float = 0.0
    lora: float = 0.0
    other: float = 0.0
    host: float = 0.0

    def __add__(self, other: Terms) -> Terms:
        return Terms(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def device(self) -> float:
        """Everything but the host term."""
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "host")

    @property
    def model_state(self) -> float:
        return self.params + self.optimizer

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def peak(*alternatives: Terms) -> Terms:
    """The alternative with the most device bytes: a phase's peak is whichever moment in it holds most."""
    return max(alternatives, key=lambda t: t.device)


def total(parts: list[Terms]) -> Terms:
    out = Terms()
    for part in parts:
        out = out + part
    return out


def layer_activation_bytes(arch: Arch, batch: int, seq: int, tp: int = 1, recompute: bool = False,
                           bytes_per_value: int = 2) -> float:
    """Activations one block keeps for its backward, per device (Korthikanti et al. 2022, without sequence
    parallelism). The paper counts 16-bit values; fp32 doubles every term but the 1-byte dropout masks,
    which is close enough to scale the whole by bytes/2."""
    sbh = seq * batch * arch.hidden
    scale = bytes_per_value / 2
    if recompute:
        return 2 * sbh * scale
    return sbh * (10 + 24 / tp + 5 * arch.heads * seq / (arch.hidden * tp)) * scale


LINEAR_INPUTS = lora_linear_inputs(ALL_LORA_LAYERS)  # 7: h-values per token the four linear maps of a block save
# to form their weight gradients


def standin_layer_bytes(arch: Arch, batch: int, seq: int, bytes_per_value: int = 2, dropout: bool = False,
                        device: str = "cpu", linear_inputs: float = LINEAR_INPUTS) -> float:
    """What one block of the GLM stand-in (transformers' GPT-2 block: sdpa attention, the tanh GELU as
    elementwise ops) saves for its backward, counted from autograd's saved tensors on transformers 4.51 and
    torch 2.13 (tests/test_plan_physics.py repeats the census). Per token, in values of the compute dtype:
    the two LayerNorm inputs, Q, K, V and the attention output (6 x h), the GELU's fc output, tanh output,
    0.5*x and 1 + tanh (4 x 4h): 22*h whatever trains, plus the inputs the linear maps keep for their weight
    gradients (`linear_inputs`: 7*h when all four train or carry LoRA, 0 when they are frozen; autograd keeps
    an input only for a weight that needs a gradient). With dropout on the CPU, sdpa takes its math path in
    fp32: Q, K, V at 4 bytes, the softmax, its dropout mask and the dropped probabilities at 4 bytes per
    score (3*a*s scores per token) and no separate attention output; the two residual dropouts keep a mask
    in the compute dtype (2*h). On CUDA the fused kernels keep Q, K, V and the output as without dropout,
    and the residual masks are 1-byte bools."""
    sbh = seq * batch * arch.hidden
    kept = (22 + linear_inputs) * bytes_per_value * sbh
    if not dropout:
        return kept
    if device == "cuda":
        return kept + 2 * sbh
    scores = 3 * 4 * arch.heads * seq * seq * batch
    return kept - 4 * bytes_per_value * sbh + 2 * bytes_per_value * sbh + 3 * 4 * sbh + scores


def inference_activation_bytes(arch: Arch, batch: int, seq: int, tp: int = 1, bytes_per_value: int = 2) -> float:
    """A forward without autograd keeps nothing between blocks: the widest transient is one block's MLP
    (4h) plus its input and the attention scores of one block."""
    scores = batch * arch.heads / tp * seq * seq
    return (seq * batch * 6 * arch.hidden / tp + scores) * bytes_per_value


def logits_bytes(arch: Arch, batch: int, seq: int, tp: int = 1, bytes_per_value: int = 2) -> float:
    """One [batch, seq, vocab] tensor, split over tensor-parallel ranks (vocabulary-parallel output)."""
    return batch * seq * arch.vocab / tp * bytes_per_value


def cache_bytes(arch: Arch, batch: int, tokens: int, tp: int = 1, pp: int = 1, bytes_per_value: int = 2,
                kind: str = "kv") -> float:
    """The generation cache at `tokens` of context per device: K and V of every layer (2*L*h per token), or
    GLM's `mems`, the input hidden states of every layer plus the last ((L+1)*h per token: half a KV cache, at
    the price of recomputing the QKV projection over the whole context each step)."""
    if kind not in CACHE_KINDS:
        raise ValueError(f"cache kind={kind!r} is not known; allowed: {', '.join(CACHE_KINDS)}")
    per_token = 2 * arch.layers * arch.hidden if kind == "kv" else (arch.layers + 1) * arch.hidden
    return per_token / (tp * pp) * batch * tokens * bytes_per_value
