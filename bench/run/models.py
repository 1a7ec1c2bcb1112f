"""Model registry: GLM-shaped causal LMs built from config with random weights, or a local checkpoint.

GLM-10B is pre-LN with a fused QKV projection, a 4h GELU MLP, learned position embeddings and tied
input/output embeddings. A GPT-2-architecture config with GLM's proportions has exactly these traits,
so it stands in honestly (GLM's second, block-position table and its `mems` decoding are not modelled).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
from transformers import AutoModel, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, GPT2Model, PretrainedConfig

from bench.measure.params import ParamCounts
from bench.run.spec import ModelSpec

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # precision -> dtype


def gpt2_config(model: ModelSpec) -> GPT2Config:
    return GPT2Config(
        vocab_size=model.vocab,
        n_positions=model.positions,
        n_embd=model.hidden,
        n_layer=model.layers,
        n_head=model.heads,
        n_inner=4 * model.hidden,
        activation_function="gelu_new",
        resid_pdrop=model.dropout,
        embd_pdrop=model.dropout,
        attn_pdrop=model.dropout,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )


def model_config(model: ModelSpec) -> PretrainedConfig:
    if model.path:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model.path, local_files_only=True)
    return gpt2_config(model)


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
        loaded = AutoModelForCausalLM.from_pretrained(model.path, local_files_only=True, torch_dtype=torch.float32)
        if loaded.config.vocab_size < model.vocab:
            raise ValueError(
                f"model.path={model.path} has vocab_size {loaded.config.vocab_size} < model.vocab={model.vocab}, "
                "the synthetic data's token range; set model.vocab to at most the checkpoint's vocabulary"
            )
        return loaded
    return GPT2LMHeadModel(gpt2_config(model))


@_timed
def build_backbone(model: ModelSpec) -> torch.nn.Module:
    """The transformer without its LM head (reward models and critics put a value head on it), random weights
    or the local checkpoint at model.path."""
    if model.path:
        return AutoModel.from_pretrained(model.path, local_files_only=True)
    return GPT2Model(gpt2_config(model))


def count_params(module: torch.nn.Module) -> ParamCounts:
    seen: dict[int, torch.nn.Parameter] = {}
    positional = positional_trainable = 0
    for name, param in module.named_parameters(remove_duplicate=True):
        numel = _full_numel(param)
        seen[id(param)] = param
        if name.endswith("wpe.weight") or "position_embeddings" in name:
            positional += numel
            positional_trainable += numel if param.requires_grad else 0
    total = sum(_full_numel(p) for p in seen.values())
    trainable = sum(_full_numel(p) for p in seen.values() if p.requires_grad)
    return ParamCounts(total=total, trainable=trainable, compute=total - positional,
                       compute_trainable=trainable - positional_trainable)


def _full_numel(param: torch.nn.Parameter) -> int:
    """ZeRO-3 partitions parameters in place; `ds_numel` keeps the full size."""
    return int(getattr(param, "ds_numel", param.numel()))


def meta_param_count(model: ModelSpec) -> ParamCounts:
    """Parameter counts of a model without allocating it (works for GLM-10B on a laptop)."""
    with torch.device("meta"):
        module = GPT2LMHeadModel(gpt2_config(model))
    return count_params(module)


def set_dropout(module: torch.nn.Module, p: float) -> None:
    """Every dropout layer of `module` to probability `p` (what a framework's --dropout flag intends)."""
    for layer in module.modules():
        if isinstance(layer, torch.nn.Dropout):
            layer.p = p
