"""Where LoRA goes in the GLM-shaped stand-in, and what a built model actually carries.

The stand-in is a GPT-2 module tree: a block's query/key/value projection is `attn.c_attn`, the attention
output `attn.c_proj`, the MLP's `mlp.c_fc` and `mlp.c_proj` (GLM: query_key_value, dense, dense_h_to_4h,
dense_4h_to_h). The common `lora_targets` knob names them by what they compute (bench.run.spec
LORA_TARGET_NAMES); each adapter turns that into its framework's own selection mechanism, and
`lora_layout` reads back from the built model which layers carry adapters and with which alpha, so the
record holds what the engine does, not what was asked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

# qualified-name suffix of each target layer in a block
BLOCK_LAYERS = {"qkv": "attn.c_attn", "attn_out": "attn.c_proj", "mlp_in": "mlp.c_fc", "mlp_out": "mlp.c_proj"}


def suffixes(targets: tuple[str, ...]) -> list[str]:
    """The module-name suffixes of `targets` (peft's target_modules matches these against full names)."""
    return [BLOCK_LAYERS[t] for t in targets]


def _kind(name: str) -> str:
    for target, suffix in BLOCK_LAYERS.items():
        if name.endswith(suffix):
            return target
    return name.rsplit(".", 1)[-1]  # outside the blocks: wte, wpe, value_head, ... by their own names


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
    """Per trained role: the block layers that carry a LoRA path (`targets`, in LORA_TARGET_NAMES order), the
    other modules that do (`other`: embeddings, a value head), and the alpha of the block layers' paths
    (`alpha`; None where none carries one)."""
    layout: dict[str, dict[str, Any]] = {}
    for role, model in models.items():
        kinds: dict[str, float | None] = {}
        for name, module in model.named_modules():
            if hasattr(module, "lora_right_weight") or (hasattr(module, "lora_A") and not name.endswith("lora_A")):
                kinds.setdefault(_kind(name), _alpha(module, _rank(module)))
        if not kinds:
            continue
        targets = [t for t in BLOCK_LAYERS if t in kinds]
        alphas = {kinds[t] for t in targets}
        layout[role] = {"targets": targets, "other": sorted(k for k in kinds if k not in BLOCK_LAYERS),
                        "alpha": alphas.pop() if len(alphas) == 1 else sorted(alphas) or None}
    return layout
