"""DeepSpeed-Chat's own LoRA (dschat/utils/module/lora.py), not peft.

Kept faithful where it matters for memory and numerics: rank r factors named `lora_right_weight`
(d_in x r, kaiming-uniform) and `lora_left_weight` (r x d_out, zeros), scaling = lora_scaling / r with
lora_scaling = 1 (effective alpha 1; the common `lora_alpha` sets it), no dropout, every linear whose name
contains a substring converted (`lora_targets` picks the substring, options.lora_module_names). LinearLayer_LoRA
freezes only the weight it wraps: its bias and every unconverted parameter keep training unless the opt-in
`only_optimize_lora` freezes everything else. It also wraps GPT-2's Conv1D (a linear with a transposed
weight), which the GLM-shaped stand-in uses for its fused QKV and MLP.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

UPSTREAM_LORA_SCALING = 1.0  # convert_linear_layer_to_lora's default; no DS-Chat script passes another


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, rank: int, lora_scaling: float = 1.0) -> None:
        super().__init__()
        if isinstance(base, Conv1D):
            d_in, d_out = base.nx, base.nf
        else:
            d_in, d_out = base.in_features, base.out_features
        self.base = base
        self.lora_right_weight = nn.Parameter(torch.empty(d_in, rank))
        self.lora_left_weight = nn.Parameter(torch.zeros(rank, d_out))
        nn.init.kaiming_uniform_(self.lora_right_weight, a=math.sqrt(5))
        self.lora_scaling = lora_scaling / rank
        self.base.weight.requires_grad_(False)  # the bias keeps training, as in LinearLayer_LoRA

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_right_weight @ self.lora_left_weight) * self.lora_scaling

    def fused_weight(self) -> torch.Tensor:
        """The base weight with the adapter folded in, in the base layer's own layout."""
        delta = (self.lora_right_weight @ self.lora_left_weight).float() * self.lora_scaling  # [d_in, d_out]
        weight = self.base.weight.float()
        return weight + (delta if isinstance(self.base, Conv1D) else delta.t())


def convert_to_lora(model: nn.Module, module_names: str | tuple[str, ...], rank: int,
                    lora_scaling: float = 1.0) -> int:
    """Replace every Linear/Conv1D whose qualified name contains `module_names` (upstream takes one substring;
    several convert every layer any of them names); `lora_scaling` is upstream's argument of that name (the
    scripts leave it 1). Returns how many layers were converted."""
    names = (module_names,) if isinstance(module_names, str) else module_names
    targets = [
        name
        for name, module in model.named_modules()
        if any(n in name for n in names) and isinstance(module, (nn.Linear, Conv1D)) and not name.endswith("lm_head")
    ]
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(getattr(parent, child), rank, lora_scaling))
    return len(targets)


def only_optimize_lora(model: nn.Module, keep_trainable: tuple[str, ...] = ()) -> None:
    """DS-Chat's `only_optimize_lora_parameters` with its `force_optimize_params` (e.g. the RM's v_head)."""
    for name, param in model.named_parameters():
        param.requires_grad_("lora_right_weight" in name or "lora_left_weight" in name
                             or any(k in name for k in keep_trainable))


def fused_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """State dict with every adapter folded into its base layer, as DS-Chat's convert_lora_to_linear_layer
    does before saving, so the next stage loads a plain model (and may add fresh adapters)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            prefix = f"{name}." if name else ""
            state[f"{prefix}weight"] = module.fused_weight().detach()
            if module.base.bias is not None:  # Llama-family projections have none (bias=False)
                state[f"{prefix}bias"] = state.pop(f"{prefix}base.bias")
            for key in ("base.weight", "lora_right_weight", "lora_left_weight"):
                state.pop(f"{prefix}{key}")
    return state
