"""Where LoRA goes in a model of each family, and what a built model actually carries.

The common `lora_targets` knob names a block's linear maps by what they compute (q, k, v, o, gate, up, down:
bench.run.families MEANINGS); each family keeps them in its own modules (GPT-2, the GLM stand-in: `attn.c_attn`
computes q, k and v, `attn.c_proj` o, `mlp.c_fc` up, `mlp.c_proj` down; Llama-style: `self_attn.q_proj`, ...,
`mlp.down_proj`; GLM-4 fuses gate and up in `mlp.gate_up_proj`). Each adapter turns the meanings into its
framework's own selection mechanism, and `lora_layout` reads back from the built model which maps carry
adapters and with which alpha, so the record holds what the engine does, not what was asked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bench.run.families import FAMILIES, MEANINGS, family
from bench.run.spec import RunSpec, UnsupportedError

if TYPE_CHECKING:
    from torch import nn

# a block module's name -> the meanings it computes, over every family (no two families name a module alike
# with different meanings)
MODULE_MEANINGS: dict[str, tuple[str, ...]] = {
    module: traits.fused_with(meaning) for traits in FAMILIES.values() for meaning, module in traits.modules.items()}


# peft's default LoRA targets (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, peft 0.13.2) as meanings: what
# trlx's and TRL's peft configs adapt without target_modules. peft has none for model_type "glm": its
# get_peft_model then asks for target_modules (tests/test_lora_targets.py reads peft's own table)
PEFT_DEFAULTS: dict[str, tuple[str, ...]] = {"gpt2": ("q", "k", "v"), "llama": ("q", "v"), "qwen2": ("q", "v"),
                                             "mistral": ("q", "v")}


def peft_targets(targets: tuple[str, ...] | None, arch: str) -> tuple[str, ...] | None:
    """The meanings a peft LoRA adapts: lora_targets, else peft's default for the family (None: it has none)."""
    return targets if targets is not None else PEFT_DEFAULTS.get(arch)


def require_peft_default(spec: RunSpec, framework: str) -> None:
    """Refuses LoRA without lora_targets on a family peft has no default for: peft's get_peft_model raises
    there (ValueError "Please specify `target_modules` in `peft_config`")."""
    if spec.lora and spec.lora_target_set is None and spec.model.arch not in PEFT_DEFAULTS:
        raise UnsupportedError(
            f"lora={spec.lora} with lora_targets=null on a {spec.model.arch} model: {framework} passes LoRA to peft "
            f"without target_modules, and peft 0.13.2 has no default for model_type {spec.model.family.model_type!r} "
            "(its get_peft_model raises); name them, e.g. lora_targets=all or lora_targets=[q,v]")


def suffixes(targets: tuple[str, ...], arch: str) -> list[str]:
    """The module-name suffixes that hold the `targets` meanings in a block of `arch`, each module once (peft's
    target_modules matches these against full names)."""
    traits = family(arch)
    return [m for m in traits.distinct_modules if any(traits.modules[t] == m for t in targets if t in traits.modules)]


def _kinds(name: str) -> tuple[str, ...]:
    for module, meanings in MODULE_MEANINGS.items():
        if name.endswith(module):
            return meanings
    return (name.rsplit(".", 1)[-1],)  # outside the blocks: wte, embed_tokens, value_head, ... by their own names


def _alpha(module: nn.Module, rank: int) -> float | None:
    """alpha = scaling x rank, from whichever LoRA implementation `module` is (DS-Chat's lora_scaling, coati's
    and peft's scaling; peft keeps one per adapter name)."""
    scaling: Any = getattr(module, "lora_scaling", getattr(module, "scaling", None))
    if isinstance(scaling, dict):
        scaling = scaling.get("default")
    return None if scaling is None else float(scaling) * rank


def _rank(module: nn.Module) -> int:
    if hasattr(module, "lora_right_weight"):  # DS-Chat: [d_in, r]
        return int(module.lora_right_weight.shape[1])
    a = module.lora_A
    if hasattr(a, "keys"):  # peft: a ModuleDict of one nn.Linear(d_in, r) per adapter name
        return int(a["default"].weight.shape[0])
    return int(a.shape[0])  # coati: [r, d_in]


def lora_layout(models: dict[str, nn.Module]) -> dict[str, dict[str, Any]]:
    """Per trained role: the block's maps that carry a LoRA path (`targets`, meanings in MEANINGS order), the
    other modules that do (`other`: embeddings, a value head), and the alpha of the block maps' paths
    (`alpha`; None where none carries one)."""
    layout: dict[str, dict[str, Any]] = {}
    for role, model in models.items():
        kinds: dict[str, float | None] = {}
        for name, module in model.named_modules():
            if hasattr(module, "lora_right_weight") or (hasattr(module, "lora_A") and not name.endswith("lora_A")):
                for kind in _kinds(name):
                    kinds.setdefault(kind, _alpha(module, _rank(module)))
        if not kinds:
            continue
        targets = [t for t in MEANINGS if t in kinds]
        alphas = {kinds[t] for t in targets}
        layout[role] = {"targets": targets, "other": sorted(k for k in kinds if k not in MEANINGS),
                        "alpha": alphas.pop() if len(alphas) == 1 else sorted(alphas) or None}
    return layout
