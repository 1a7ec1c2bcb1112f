"""The model architectures a run can build, and where each keeps the parts the harness reaches into.

Torch-free: the spec, the memory models and the planner read these traits without importing transformers.
`gpt2` is the GLM stand-in (GLM-10B's pre-LN block: fused QKV, 4h GELU MLP, learned positions, tied
embeddings). The others are the Llama-style blocks teams train (RMSNorm, rotary positions, grouped-query
attention, SwiGLU MLP, untied head by default), each as transformers 4.51.3 builds it:

- llama: LlamaForCausalLM, no biases;
- qwen2: Qwen2ForCausalLM, biases on the q, k and v projections (no sliding window, as Qwen2.5's configs);
- mistral: MistralForCausalLM, Llama's block (the sliding window left off, as Mistral-7B v0.2 on);
- glm: GlmForCausalLM, the GLM-4 architecture (GLM-4-9B): q, k, v biases, a fused gate-and-up projection,
  rotary embedding on half of each head.

A block's linear maps are named by what they compute: q, k, v, o (attention) and gate, up, down (MLP). A
family that fuses several meanings into one module (GPT-2's c_attn computes q, k and v; GLM-4's gate_up_proj
gate and up) can only adapt or freeze them together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MEANINGS = ("q", "k", "v", "o", "gate", "up", "down")  # a block's linear maps, in this order everywhere


@dataclass(frozen=True)
class Family:
    name: str  # the value of model.arch
    model_type: str  # config.json's model_type of a checkpoint of this family
    norm: str  # layernorm (weight and bias, fused kernel) | rmsnorm (weight; computed in fp32 by transformers)
    mlp: str  # gelu (up, down) | swiglu (gate, up, down)
    modules: dict[str, str]  # meaning -> the module's name inside a block
    biased: frozenset[str]  # meanings whose module has a bias
    learned_positions: bool  # a position table (GPT-2) or rotary positions (no parameters)
    tied_default: bool  # input embedding and LM head share one matrix unless the config says otherwise
    blocks: str  # the block list's path inside the backbone
    final_norm: str  # the final norm's path inside the backbone
    residual_dropout: bool  # dropout on the embeddings and both residual branches (GPT-2); the Llama-style
    # families have attention dropout only
    layer_class: str  # the block's transformers class
    extra: dict[str, object] = field(default_factory=dict)  # config values the family always sets

    def fused_with(self, meaning: str) -> tuple[str, ...]:
        """Every meaning computed by the same module as `meaning` (itself included), in MEANINGS order."""
        module = self.modules[meaning]
        return tuple(m for m in MEANINGS if self.modules.get(m) == module)

    @property
    def meanings(self) -> tuple[str, ...]:
        return tuple(m for m in MEANINGS if m in self.modules)

    @property
    def distinct_modules(self) -> tuple[str, ...]:
        """The block's linear modules, once each, in MEANINGS order."""
        seen: list[str] = []
        for meaning in self.meanings:
            if self.modules[meaning] not in seen:
                seen.append(self.modules[meaning])
        return tuple(seen)


_LLAMA_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                  "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}

FAMILIES: dict[str, Family] = {
    "gpt2": Family(
        name="gpt2", model_type="gpt2", norm="layernorm", mlp="gelu",
        modules={"q": "attn.c_attn", "k": "attn.c_attn", "v": "attn.c_attn", "o": "attn.c_proj", "up": "mlp.c_fc",
                 "down": "mlp.c_proj"},
        biased=frozenset({"q", "k", "v", "o", "up", "down"}), learned_positions=True, tied_default=True,
        blocks="h", final_norm="ln_f", residual_dropout=True, layer_class="GPT2Block"),
    "llama": Family(
        name="llama", model_type="llama", norm="rmsnorm", mlp="swiglu", modules=dict(_LLAMA_MODULES),
        biased=frozenset(), learned_positions=False, tied_default=False, blocks="layers", final_norm="norm",
        residual_dropout=False, layer_class="LlamaDecoderLayer"),
    "qwen2": Family(
        name="qwen2", model_type="qwen2", norm="rmsnorm", mlp="swiglu", modules=dict(_LLAMA_MODULES),
        biased=frozenset({"q", "k", "v"}), learned_positions=False, tied_default=False, blocks="layers",
        final_norm="norm", residual_dropout=False, layer_class="Qwen2DecoderLayer",
        extra={"sliding_window": None}),  # Qwen2Config keeps a window of 4096 even with use_sliding_window off
    "mistral": Family(
        name="mistral", model_type="mistral", norm="rmsnorm", mlp="swiglu", modules=dict(_LLAMA_MODULES),
        biased=frozenset(), learned_positions=False, tied_default=False, blocks="layers", final_norm="norm",
        residual_dropout=False, layer_class="MistralDecoderLayer", extra={"sliding_window": None}),
    "glm": Family(
        name="glm", model_type="glm", norm="rmsnorm", mlp="swiglu",
        modules={**_LLAMA_MODULES, "gate": "mlp.gate_up_proj", "up": "mlp.gate_up_proj"},
        biased=frozenset({"q", "k", "v"}), learned_positions=False, tied_default=False, blocks="layers",
        final_norm="norm", residual_dropout=False, layer_class="GlmDecoderLayer"),
}
ARCHS = tuple(FAMILIES)
MODEL_TYPES = {family.model_type: family.name for family in FAMILIES.values()}  # config.json model_type -> arch


def family(arch: str) -> Family:
    if arch not in FAMILIES:
        raise ValueError(f"model.arch={arch!r} is not known; allowed: {', '.join(ARCHS)}")
    return FAMILIES[arch]
