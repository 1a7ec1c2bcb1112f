"""Bytes that follow from a model's shape: parameters, activations, logits, the generation cache and LoRA.

Pure arithmetic on the blocks of bench.run.families: GPT-2's (pre-LN, fused QKV h -> 3h, attention output
h -> h, a 4h GELU MLP, biases, tied input/output embedding, learned positions: the GLM stand-in the adapters
build, and GLM-10B's own block, conf/model/glm-10b.yaml from THUDM/glm-10b's config.json), and the Llama-style
ones (RMSNorm, rotary positions, grouped-query attention, a SwiGLU MLP, an untied head). Activations follow
Korthikanti et al. 2022 (per layer s*b*h*(34 + 5*a*s/h) bytes at 16 bits; with tensor parallelism t:
s*b*h*(10 + 24/t + 5*a*s/(h*t)); with full recomputation only the layer input, 2*s*b*h). The figures are
per device for the given degrees.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from bench.run.families import MEANINGS, Family
from bench.run.families import family as family_of

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}
CACHE_KINDS = ("kv", "mems")  # HF-style K and V per layer, or GLM's per-layer input hidden states


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is not known; allowed: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


ALL_LORA_LAYERS = MEANINGS  # LoRA arithmetic names a block's maps by meaning (bench.run.families)


@dataclass(frozen=True)
class Arch:
    """The shape of a causal LM of one of the families in bench.run.families (GPT-2/GLM stand-in by default)."""

    hidden: int
    layers: int
    heads: int
    vocab: int
    positions: int
    position_tables: int = 1  # GLM-10B has two (positions and block positions); the stand-in one
    family: str = "gpt2"
    kv_heads: int | None = None  # grouped-query attention: K and V heads; None = heads
    intermediate: int | None = None  # the MLP's width; None = 4 x hidden (GPT-2's rule)
    tied: bool | None = None  # LM head shares the input embedding; None = the family's default

    def __post_init__(self) -> None:
        family_of(self.family)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.intermediate is None:
            object.__setattr__(self, "intermediate", 4 * self.hidden)
        if self.tied is None:
            object.__setattr__(self, "tied", family_of(self.family).tied_default)
        for name in ("hidden", "layers", "heads", "vocab", "positions", "position_tables", "kv_heads",
                     "intermediate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.hidden % self.heads:
            raise ValueError(f"heads={self.heads} must divide hidden={self.hidden}")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads={self.kv_heads} must divide heads={self.heads}")

    @property
    def traits(self) -> Family:
        return family_of(self.family)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        """K (or V) values per token and layer: kv_heads x head_dim (= hidden without grouped-query attention)."""
        return self.kv_heads * self.head_dim

    def linear_shape(self, meaning: str) -> tuple[int, int]:
        """(inputs, outputs) of a block's linear map by meaning; a fused module is the sum of its meanings'."""
        h, i = self.hidden, self.intermediate
        return {"q": (h, h), "k": (h, self.kv_width), "v": (h, self.kv_width), "o": (h, h), "gate": (h, i),
                "up": (h, i), "down": (i, h)}[meaning]

    def _modules(self, targets: tuple[str, ...]) -> dict[str, tuple[int, int]]:
        """(inputs, outputs) of each module `targets` touch, fused meanings summed."""
        modules: dict[str, tuple[int, int]] = {}
        for meaning in self.traits.meanings:
            if meaning in targets:
                d_in, d_out = self.linear_shape(meaning)
                name = self.traits.modules[meaning]
                modules[name] = (d_in, modules.get(name, (d_in, 0))[1] + d_out)
        return modules

    @property
    def layer_params(self) -> int:
        """One block: its linear weights, their biases and two norms. GPT-2: QKV 3h^2 + 3h, output h^2 + h,
        MLP 8h^2 + 5h, two LayerNorms 4h: 12h^2 + 13h."""
        traits = self.traits
        biases = sum(self.linear_shape(m)[1] for m in traits.meanings if m in traits.biased)
        return self.block_weights(traits.meanings) // self.layers + biases + 2 * self.norm_params

    @property
    def norm_params(self) -> int:
        """One norm: LayerNorm's weight and bias, or RMSNorm's weight."""
        return (2 if self.traits.norm == "layernorm" else 1) * self.hidden

    @property
    def embedding_params(self) -> int:
        """The input embedding and any learned position tables."""
        positions = self.position_tables * self.positions * self.hidden if self.traits.learned_positions else 0
        return self.vocab * self.hidden + positions

    @property
    def head_params(self) -> int:
        """The LM head's own matrix: none when it is the tied input embedding."""
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def backbone_params(self) -> int:
        """The transformer without its LM head (what a value head sits on), final norm included."""
        return self.layers * self.layer_params + self.embedding_params + self.norm_params

    @property
    def total_params(self) -> int:
        """The causal LM's unique parameters (a tied output embedding once)."""
        return self.backbone_params + self.head_params

    def tensor_numels(self, lm_head: bool = True) -> list[int]:
        """The element count of each parameter tensor (`lm_head` False: the backbone a value head sits on):
        the word embedding and any position tables, each block's linear weights (a fused module once), their
        biases and norms, the final norm and an untied head. What ZeRO-3 partitions or keeps whole goes by
        these (adapters/deepspeed_memory.py)."""
        traits = self.traits
        norm = [self.hidden] * (2 if traits.norm == "layernorm" else 1)
        block = []
        for name, (d_in, d_out) in self._modules(traits.meanings).items():
            block.append(d_in * d_out)
            if any(traits.modules[m] == name for m in traits.biased):
                block.append(d_out)
        block += 2 * norm
        positions = [self.positions * self.hidden] * self.position_tables if traits.learned_positions else []
        head = [self.vocab * self.hidden] if lm_head and not self.tied else []
        return [self.vocab * self.hidden, *positions, *block * self.layers, *norm, *head]

    @property
    def largest_layer_params(self) -> int:
        """The largest single module's own parameters (DeepSpeed's ZeRO-3 estimator): the word embedding,
        or a block's widest linear map in a model with a small vocabulary."""
        traits = self.traits
        widest = 0
        for name, (d_in, d_out) in self._modules(traits.meanings).items():
            biased = any(traits.modules[m] == name for m in traits.biased)
            widest = max(widest, d_in * d_out + (d_out if biased else 0))
        return max(self.vocab * self.hidden, widest)

    def lora_params(self, rank: int, targets: tuple[str, ...] = ALL_LORA_LAYERS) -> int:
        """LoRA A and B on each module the `targets` meanings name, r*(d_in + d_out) each (a fused module once,
        with its whole width). GPT-2 with all four modules: r*(h + 3h) + r*(h + h) + r*(h + 4h) + r*(4h + h) =
        16*r*h per layer."""
        if rank < 0:
            raise ValueError(f"lora rank={rank} must be >= 0")
        return rank * self.layers * sum(d_in + d_out for d_in, d_out in self._modules(targets).values())

    def lora_numels(self, rank: int, targets: tuple[str, ...] = ALL_LORA_LAYERS) -> list[int]:
        """The element count of each LoRA factor lora_params counts: A (r x d_in) and B (d_out x r) per module."""
        if not rank:
            return []
        return [n for d_in, d_out in self._modules(targets).values() for n in (rank * d_in, rank * d_out)
                ] * self.layers

    def block_weights(self, targets: tuple[str, ...] = ALL_LORA_LAYERS) -> int:
        """The weights (no biases) of the `targets` linear maps over all blocks: GPT-2's four give 12*h^2 per
        layer."""
        return self.layers * sum(self.linear_shape(m)[0] * self.linear_shape(m)[1]
                                 for m in self.traits.meanings if m in targets)

    def block_rows(self, targets: tuple[str, ...] = ALL_LORA_LAYERS) -> int:
        """Output rows of the `targets` linear maps over all blocks (a quantizer keeps a scale per row)."""
        return self.layers * sum(self.linear_shape(m)[1] for m in self.traits.meanings if m in targets)

    def linear_inputs(self, targets: tuple[str, ...] = ALL_LORA_LAYERS) -> float:
        """h-values per token the `targets` maps save for their weight (or LoRA) gradients: maps that read the
        same tensor save it once (q, k, v read the normed input; gate and up the other). GPT-2's four: 1 + 1 +
        1 + 4 = 7."""
        return sum(d_in for d_in, _ in self._inputs(targets).values()) / self.hidden

    def lora_dropout_inputs(self, targets: tuple[str, ...], device: str, bytes_per_value: int) -> float:
        """h-values per token (in the compute dtype) peft's LoRA keeps for its gradients with dropout on, in place of
        linear_inputs: each adapted module drops its input on its own and lora_A's weight gradient keeps that
        dropped copy, so modules that read one tensor no longer share it (Llama's q and v: 2 where linear_inputs
        counts 1), and each dropout keeps its mask for the input's gradient -- on the CPU a noise tensor in the
        input's dtype (ATen's unfused dropout multiplies by it), on CUDA the fused kernel's 1-byte mask. Counted in
        every block (the first block's input needs no gradient and keeps no masks: 1/layers of them over)."""
        dropped = sum(d_in for d_in, _ in self._modules(targets).values()) / self.hidden
        return dropped * (2 if device == "cpu" else 1 + 1 / bytes_per_value)

    def _inputs(self, targets: tuple[str, ...]) -> dict[str, tuple[int, int]]:
        groups = {"q": "qkv", "k": "qkv", "v": "qkv", "o": "o", "gate": "mlp_in", "up": "mlp_in", "down": "down"}
        return {groups[m]: self.linear_shape(m) for m in self.traits.meanings if m in targets}


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
                           bytes_per_value: int = 2, flash: bool = False, frozen: bool = False) -> float:
    """Activations one block keeps for its backward, per device (Korthikanti et al. 2022, without sequence
    parallelism), in 16-bit values (s b h units; i = the MLP width, a = heads, t = tensor parallel):

    - GPT-2 (GLM's block): outside the tensor-parallel regions the two LayerNorm inputs, the QKV and MLP
      inputs and the two dropout masks (10); inside Q, K, V and the attention output's input (8), the MLP's
      fc output and GELU output (4i/h: 16 at i = 4h), all / t; the scores 5as/h / t (softmax output, dropout
      mask, dropped probabilities). At i = 4h: 34 + 5as/h.
    - RMSNorm/SwiGLU families (no dropout): the two norm inputs and the QKV and MLP inputs (8); Q, the attention
      output's input (4), K and V at the K/V width (grouped-query attention: 4 kv/h), SwiGLU's gate, up, SiLU
      and product (8i/h), all / t; the softmax output 2as/h / t.

    `flash`: fused attention keeps no scores. `frozen`: a block whose weights do not train but which a gradient
    passes (something under it trains): its linear maps keep no input for a weight gradient -- the QKV and MLP
    inputs outside (4), the attention output's input (2) and the last MLP map's input (GPT-2's GELU output,
    SwiGLU's product: 2i/h) inside. The paper counts 16-bit values; fp32 doubles every term but the 1-byte
    dropout masks, which is close enough to scale the whole by bytes/2."""
    sbh = seq * batch * arch.hidden
    scale = bytes_per_value / 2
    if recompute:
        return 2 * sbh * scale
    i_per_h = arch.intermediate / arch.hidden
    if arch.traits.norm == "rmsnorm":
        outside, inside, score_values = 8, 4 + 4 * arch.kv_width / arch.hidden + 8 * i_per_h, 2
    else:
        outside, inside, score_values = 10, 8 + 4 * i_per_h, 5
    if frozen:
        outside, inside = outside - 4, inside - 2 - 2 * i_per_h
    scores = 0 if flash else score_values * arch.heads * seq / arch.hidden
    return sbh * (outside + (inside + scores) / tp) * scale


def layer_saved_bytes(arch: Arch, batch: int, seq: int, bytes_per_value: int = 2, dropout: bool = False,
                      device: str = "cpu", linear_inputs: float | None = None, trained_norms: bool = True) -> float:
    """What one block saves for its backward, as transformers 4.51 builds it (sdpa attention), counted from
    autograd's saved tensors on torch 2.13 (tests/test_plan_physics.py repeats the census for each family).
    Per token, v = bytes per value of the compute dtype, i = the MLP width:

    - GPT-2 (the GLM stand-in): the two LayerNorm inputs, Q, K, V and the attention output (6*h values), the
      tanh GELU's fc output, tanh output, 0.5*x and 1 + tanh (4*i): 22*h at i = 4h, whatever trains.
    - RMSNorm/SwiGLU families: each RMSNorm's input in fp32 (2 x 4*h bytes whatever the dtype), Q and K, V
      repeated to every head (grouped-query attention saves K and V at full width) and the output (4*h), the
      gate output, its SiLU and the up output (3*i; GLM-4's fused gate-up output and the SiLU are the same
      bytes), plus each norm's output when its weight trains (`trained_norms`, 2*h).

    Both add the inputs the linear maps keep for their weight gradients (`linear_inputs` h-values, default:
    all the block's maps, arch.linear_inputs(); 0 when frozen; autograd keeps an input only for a weight
    that needs a gradient). With dropout (GPT-2 only: the other families have none in their residual
    stream) on the CPU, sdpa takes its math path in fp32: Q, K, V at 4 bytes, the softmax, its dropout mask
    and the dropped probabilities at 4 bytes per score (3*a*s scores per token) and no separate attention
    output; the two residual dropouts keep a mask in the compute dtype (2*h). On CUDA the fused kernels keep
    Q, K, V and the output as without dropout, and the residual masks are 1-byte bools."""
    inputs = arch.linear_inputs() if linear_inputs is None else linear_inputs
    sbh = seq * batch * arch.hidden
    v = bytes_per_value
    i_per_h = arch.intermediate / arch.hidden
    if arch.traits.norm == "rmsnorm":
        if dropout:
            raise ValueError(f"the {arch.family} family has no residual dropout; its blocks are counted without")
        return (2 * 4 + (4 + 3 * i_per_h + inputs + (2 if trained_norms else 0)) * v) * sbh
    kept = (6 + 4 * i_per_h + inputs) * v * sbh
    if not dropout:
        return kept
    if device == "cuda":
        return kept + 2 * sbh
    scores = 3 * 4 * arch.heads * seq * seq * batch
    return kept - 4 * v * sbh + 2 * v * sbh + 3 * 4 * sbh + scores


def inference_activation_bytes(arch: Arch, batch: int, seq: int, tp: int = 1, bytes_per_value: int = 2) -> float:
    """A forward without autograd keeps nothing between blocks: the widest transient is one block's MLP (GPT-2
    its 4h GELU output, SwiGLU gate, up and their product, 3i) plus its input and output (2h) and the attention
    scores of one block."""
    scores = batch * arch.heads / tp * seq * seq
    mlp = arch.intermediate * (3 if arch.traits.mlp == "swiglu" else 1)
    return (seq * batch * (2 * arch.hidden + mlp) / tp + scores) * bytes_per_value


def logits_bytes(arch: Arch, batch: int, seq: int, tp: int = 1, bytes_per_value: int = 2) -> float:
    """One [batch, seq, vocab] tensor, split over tensor-parallel ranks (vocabulary-parallel output)."""
    return batch * seq * arch.vocab / tp * bytes_per_value


def cache_bytes(arch: Arch, batch: int, tokens: int, tp: int = 1, pp: int = 1, bytes_per_value: int = 2,
                kind: str = "kv") -> float:
    """The generation cache at `tokens` of context per device: K and V of every layer (2*L*kv_width per token:
    2*L*h without grouped-query attention; transformers caches K and V before repeating them to every head),
    or GLM-10B's `mems`, the input hidden states of every layer plus the last ((L+1)*h per token: half a KV
    cache, at the price of recomputing the QKV projection over the whole context each step)."""
    if kind not in CACHE_KINDS:
        raise ValueError(f"cache kind={kind!r} is not known; allowed: {', '.join(CACHE_KINDS)}")
    per_token = 2 * arch.layers * arch.kv_width if kind == "kv" else (arch.layers + 1) * arch.hidden
    return per_token / (tp * pp) * batch * tokens * bytes_per_value
