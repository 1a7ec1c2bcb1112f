"""Model registry: causal LMs of the families in bench.run.families, built from config with random weights,
or a local checkpoint.

GLM-10B is pre-LN with a fused QKV projection, a 4h GELU MLP, learned position embeddings and tied
input/output embeddings. A GPT-2-architecture config with GLM's proportions has exactly these traits,
so it stands in honestly (GLM's second, block-position table and its `mems` decoding are not modelled).
The Llama-style families (llama, qwen2, mistral, glm = GLM-4) are transformers' own classes.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    GlmConfig,
    GlmForCausalLM,
    GlmModel,
    GPT2Config,
    GPT2LMHeadModel,
    GPT2Model,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    MistralConfig,
    MistralForCausalLM,
    MistralModel,
    PretrainedConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2Model,
)

from bench.measure.params import ParamCounts
from bench.run.families import MODEL_TYPES, Family, family
from bench.run.spec import ModelSpec

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # precision -> dtype
# Each family's (config, causal LM, backbone) classes, imported here: transformers imports a model's module on
# first use, and a first use inside DeepSpeed's zero.Init (which patches tensor construction) fails to import it
CLASSES: dict[str, tuple[type, type, type]] = {
    "gpt2": (GPT2Config, GPT2LMHeadModel, GPT2Model), "llama": (LlamaConfig, LlamaForCausalLM, LlamaModel),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, Qwen2Model), "mistral": (MistralConfig, MistralForCausalLM, MistralModel),
    "glm": (GlmConfig, GlmForCausalLM, GlmModel)}


def gpt2_config(model: ModelSpec) -> GPT2Config:
    return GPT2Config(
        vocab_size=model.vocab,
        n_positions=model.positions,
        n_embd=model.hidden,
        n_layer=model.layers,
        n_head=model.heads,
        n_inner=model.intermediate,
        activation_function="gelu_new",
        resid_pdrop=model.dropout,
        embd_pdrop=model.dropout,
        attn_pdrop=model.dropout,
        tie_word_embeddings=model.tie_embeddings,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )


def family_config(model: ModelSpec) -> PretrainedConfig:
    """The transformers config of `model`'s family at its dimensions (rotary base, norm epsilon and the other
    settings that set no memory or FLOPs: transformers' defaults)."""
    if model.arch == "gpt2":
        return gpt2_config(model)
    config_class = CLASSES[model.arch][0]
    return config_class(
        hidden_size=model.hidden,
        intermediate_size=model.intermediate,
        num_hidden_layers=model.layers,
        num_attention_heads=model.heads,
        num_key_value_heads=model.kv_heads,
        head_dim=model.hidden // model.heads,
        vocab_size=model.vocab,
        max_position_embeddings=model.positions,
        tie_word_embeddings=model.tie_embeddings,
        attention_dropout=0.0,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
        **model.family.extra,
    )


def model_config(model: ModelSpec) -> PretrainedConfig:
    if model.path:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model.path, local_files_only=True)
    return family_config(model)


_build_seconds = [0.0]  # this process's time inside the builders below (read by the worker: model_build_s)


def _timed(build: Callable[[ModelSpec], torch.nn.Module]) -> Callable[[ModelSpec], torch.nn.Module]:
    """Adds the builder's wall time to _build_seconds, so that a run's init splits into model build (random
    initialisation or loading; under DeepSpeed's zero.Init also partitioning) and engine wrapping."""

    @functools.wraps(build)
    def timed(model: ModelSpec) -> torch.nn.Module:
        start = time.perf_counter()
        try:
            return build(model)
        finally:
            _build_seconds[0] += time.perf_counter() - start

    return timed


def model_build_seconds() -> float:
    """Seconds this process has spent building models with build_causal_lm and build_backbone."""
    return _build_seconds[0]


@_timed
def build_causal_lm(model: ModelSpec) -> torch.nn.Module:
    """A causal LM with random weights (or the local checkpoint at model.path). No downloads. Built in the
    ambient dtype and never cast afterwards: inside DeepSpeed's zero.Init the parameters are already the
    run's half-precision partitions, and a cast back to fp32 would make ZeRO-3 see an fp32 model (it then
    picks a static loss scale of 1 for fp16)."""
    if model.path:
        return AutoModelForCausalLM.from_pretrained(model.path, local_files_only=True, torch_dtype=torch.float32)
    return CLASSES[model.arch][1](family_config(model))


@_timed
def build_backbone(model: ModelSpec) -> torch.nn.Module:
    """The transformer without its LM head (reward models and critics put a value head on it), random weights
    or the local checkpoint at model.path."""
    if model.path:
        return AutoModel.from_pretrained(model.path, local_files_only=True)
    return CLASSES[model.arch][2](family_config(model))


def count_params(module: torch.nn.Module) -> ParamCounts:
    """Total and trainable parameters, and those a token multiplies through (`compute`, bench.measure.flops):
    all but the tables a token only looks up -- position tables, and an input embedding that is not also the
    LM head (untied, or a backbone under a value head)."""
    seen = {id(p): p for p in module.parameters()}
    multiplied = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Linear)}
    lookups = {id(m.weight): m.weight for m in module.modules()
               if isinstance(m, torch.nn.Embedding) and id(m.weight) not in multiplied}
    lookup = sum(_full_numel(p) for p in lookups.values())
    lookup_trainable = sum(_full_numel(p) for p in lookups.values() if p.requires_grad)
    total = sum(_full_numel(p) for p in seen.values())
    trainable = sum(_full_numel(p) for p in seen.values() if p.requires_grad)
    return ParamCounts(total=total, trainable=trainable, compute=total - lookup,
                       compute_trainable=trainable - lookup_trainable)


def _full_numel(param: torch.nn.Parameter) -> int:
    """ZeRO-3 partitions parameters in place; `ds_numel` keeps the full size."""
    return int(getattr(param, "ds_numel", param.numel()))


def meta_param_count(model: ModelSpec) -> ParamCounts:
    """Parameter counts of a model without allocating it (works for GLM-10B on a laptop)."""
    with torch.device("meta"):
        module = CLASSES[model.arch][1](family_config(model))
    return count_params(module)


def set_dropout(module: torch.nn.Module, p: float) -> None:
    """Every dropout layer of `module` to probability `p` (what a framework's --dropout flag intends)."""
    for layer in module.modules():
        if isinstance(layer, torch.nn.Dropout):
            layer.p = p


def backbone_prefix(model: ModelSpec) -> str:
    """Where a causal LM of `model`'s family keeps its backbone, as its state dict names it (GPT-2's transformer,
    Llama's model)."""
    return CLASSES[model.arch][1].base_model_prefix


def family_of(model: torch.nn.Module) -> Family:
    """The family of a built transformers model (a causal LM or its backbone), from its config's model_type."""
    return family(MODEL_TYPES[model.config.model_type])


def decoder_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The block list of a causal LM or a backbone of any family (GPT-2's transformer.h, Llama's model.layers)."""
    return getattr(model.base_model, family_of(model).blocks)


def final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The norm after the last block (GPT-2's ln_f, Llama's norm)."""
    return getattr(model.base_model, family_of(model).final_norm)
