"""ColossalChat's LoRA (coati/models/lora.py): every linear and embedding layer gets a low-rank path,
scaled alpha / r, and every other parameter is frozen.

coati converts `nn.Linear` and `nn.Embedding` (target_modules=None); GPT-2 stores its block projections as
transformers' Conv1D (the same linear map with a transposed weight), so Conv1D is converted too -- on a
Llama-style model the converted set is exactly coati's. Linear paths: A kaiming-uniform, B zero, dropout
on the LoRA input. Embedding paths: A zero, B normal. Weights are never merged (coati sets
able_to_merge=False for PPO), so the base weights stay frozen and shared.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from adapters.colossalai.options import LoraOptions


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Module, in_features: int, out_features: int, transposed: bool, rank: int,
                 options: LoraOptions) -> None:
        super().__init__()
        self.base = base
        self.transposed = transposed  # Conv1D keeps its weight as [in, out]
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.dropout = nn.Dropout(options.linear_dropout)
        self.scaling = options.alpha / rank

    @property
    def weight(self) -> nn.Parameter:  # callers read a head's weight dtype/device through it
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = F.linear(F.linear(self.dropout(x), self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype))
        return self.base(x) + lora * self.scaling


class LoraEmbedding(nn.Module):
    def __init__(self, base: nn.Embedding, rank: int, options: LoraOptions) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(torch.zeros(rank, base.num_embeddings))
        self.lora_B = nn.Parameter(torch.empty(base.embedding_dim, rank))
        nn.init.normal_(self.lora_B)
        self.dropout = nn.Dropout(options.embedding_dropout)
        self.scaling = options.alpha / rank

    @property
    def weight(self) -> nn.Parameter:  # tied heads (GPT-2's lm_head) and HF's resize code read this
        return self.base.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        lora = F.embedding(ids, self.lora_A.t()) @ self.lora_B.t()
        return self.base(ids) + self.dropout(lora) * self.scaling


def _lora_module(child: nn.Module, rank: int, options: LoraOptions, embeddings: bool) -> nn.Module | None:
    from transformers.pytorch_utils import Conv1D

    if isinstance(child, nn.Linear):
        return LoraLinear(child, child.in_features, child.out_features, False, rank, options)
    if isinstance(child, Conv1D):
        in_features, out_features = child.weight.shape
        return LoraLinear(child, in_features, out_features, True, rank, options)
    if embeddings and isinstance(child, nn.Embedding):
        return LoraEmbedding(child, rank, options)
    return None


def convert_to_lora(model: nn.Module, rank: int, options: LoraOptions, embeddings: bool = True,
                    skip: tuple[str, ...] = ()) -> int:
    """Wrap every linear/Conv1D (and embedding, unless `embeddings` is false) in place, except children
    named in `skip`; freeze the rest. Returns how many were converted."""
    converted = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, (LoraLinear, LoraEmbedding)) or name in skip:
                continue
            wrapped = _lora_module(child, rank, options, embeddings)
            if wrapped is not None:
                setattr(module, name, wrapped)
                converted += 1
    for name, param in model.named_parameters():
        trainable = "lora_" in name
        if options.train_bias == "all":
            trainable = trainable or name.endswith("bias")
        elif options.train_bias == "lora":
            trainable = trainable or (name.endswith("bias") and ".base." in name)
        param.requires_grad_(trainable)
    return converted


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights with every LoRA path folded into its base weight, under the original names, so
    the next stage loads it into a plain model."""
    state: dict[str, torch.Tensor] = {}
    lora_modules = {name: m for name, m in model.named_modules() if isinstance(m, (LoraLinear, LoraEmbedding))}
    for name, tensor in model.state_dict().items():
        if "lora_" in name:
            continue
        owner = next((prefix for prefix in lora_modules if name.startswith(prefix + ".base.")), None)
        if owner is None:
            state[name] = tensor
            continue
        module = lora_modules[owner]
        key = name.replace(".base.", ".", 1)
        if name.endswith(".weight"):
            delta = (module.lora_B @ module.lora_A).detach() * module.scaling
            if isinstance(module, LoraEmbedding) or module.transposed:
                delta = delta.t()
            tensor = tensor + delta.to(tensor.dtype)
        state[key] = tensor
    return state
