"""ColossalChat's LoRA (coati/models/lora.py): every linear and embedding layer gets a low-rank path.

`convert_to_lora_module` first freezes every parameter (biases stay trainable only with
train_bias="all"), then replaces each layer:
- Linear: `_lora_linear_wrapper` builds `LoraLinear(weight, bias, r)` and passes neither alpha nor
  dropout, so every linear layer gets LoraLinear's own alpha 32 and no dropout whatever the config
  says. With train_bias="none" the layer's bias is dropped (bias=None: it no longer exists); with
  "all" or "lora" it is kept and trainable, and a layer without one gets a fresh zero bias. A, kaiming-
  uniform; B, zero; scaling alpha / r.
- Embedding: LoraEmbedding with the config's alpha and embedding dropout; A zero, B normal.
With `target_modules` (the common `lora_targets`) a child is converted only when its own name is a substring
of one of them (`name in target_module`): on GPT-2's names the attention output and the MLP output are
both `c_proj`, so naming either converts both (lora_match.matched_layers); the value head and embeddings, named by
no target, are not converted and, frozen first, do not train.
coati converts `nn.Linear` only; GPT-2 stores its block projections as transformers' Conv1D (the same
linear map with a transposed weight), so Conv1D is converted too -- on a Llama-style model the converted
set is exactly coati's. Weights are never merged in PPO (coati sets able_to_merge=False), so the base
weights stay frozen and shared.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from adapters.colossalai.options import LoraOptions

LINEAR_ALPHA = 32.0  # LoraLinear's default, the only value a linear layer ever gets


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Module, transposed: bool, rank: int, train_bias: str) -> None:
        super().__init__()
        self.weight = base.weight  # frozen; Conv1D keeps it as [in, out]
        self.weight.requires_grad_(False)
        self.transposed = transposed
        in_features, out_features = self.weight.shape if transposed else self.weight.shape[::-1]
        self.had_bias = base.bias is not None
        self.bias: nn.Parameter | None = None
        if train_bias in ("all", "lora"):
            self.bias = base.bias if base.bias is not None else nn.Parameter(torch.zeros(out_features))
            self.bias.requires_grad_(True)
        self.lora_A = nn.Parameter(torch.empty(rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = LINEAR_ALPHA / rank

    def base_weight(self) -> torch.Tensor:
        """The weight as [out, in], as nn.Linear keeps it."""
        return self.weight.t() if self.transposed else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = F.linear(F.linear(x, self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype))
        return F.linear(x, self.base_weight(), self.bias) + lora * self.scaling


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
        return LoraLinear(child, False, rank, options.train_bias)
    if isinstance(child, Conv1D):
        return LoraLinear(child, True, rank, options.train_bias)
    if embeddings and isinstance(child, nn.Embedding):
        return LoraEmbedding(child, rank, options)
    return None


def convert_to_lora(model: nn.Module, rank: int, options: LoraOptions, embeddings: bool = True,
                    skip: tuple[str, ...] = (), target_modules: list[str] | None = None) -> int:
    """convert_to_lora_module in place: freeze everything (biases stay trainable with train_bias="all"),
    then wrap every linear/Conv1D (and embedding, unless `embeddings` is false) except children named in
    `skip`, and with `target_modules` only children whose name is a substring of one of them (coati's
    rule). Returns how many were converted."""
    for name, param in model.named_parameters():
        param.requires_grad_(options.train_bias == "all" and "bias" in name)
    converted = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, (LoraLinear, LoraEmbedding)) or name in skip:
                continue
            if target_modules is not None and not any(name in target for target in target_modules):
                continue
            wrapped = _lora_module(child, rank, options, embeddings)
            if wrapped is not None:
                setattr(module, name, wrapped)
                converted += 1
    return converted


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights with every LoRA path folded into its base weight, under the original names, so
    the next stage loads it into a plain model. A dropped bias is written as zeros (the layer computes
    without one); a bias coati added to a layer that had none has no place in the plain model and is left out."""
    state: dict[str, torch.Tensor] = {}
    lora_modules = {name: m for name, m in model.named_modules() if isinstance(m, (LoraLinear, LoraEmbedding))}
    for name, tensor in model.state_dict().items():
        if "lora_" in name:
            continue
        owner = next((prefix for prefix in lora_modules if name.startswith(prefix + ".")), None)
        if owner is None:
            state[name] = tensor
            continue
        module = lora_modules[owner]
        key = name.replace(".base.", ".", 1) if isinstance(module, LoraEmbedding) else name
        if isinstance(module, LoraLinear) and name.endswith(".bias") and not module.had_bias:
            continue
        if name.endswith(".weight"):
            delta = (module.lora_B @ module.lora_A).detach() * module.scaling  # [out, in] (embeddings: [dim, num])
            if isinstance(module, LoraEmbedding) or module.transposed:
                delta = delta.t()
            tensor = tensor + delta.to(tensor.dtype)
        state[key] = tensor
    for name, module in lora_modules.items():
        if isinstance(module, LoraLinear) and module.bias is None and module.had_bias:
            out_features = module.base_weight().shape[0]
            state[f"{name}.bias"] = torch.zeros(out_features, dtype=module.weight.dtype)
    return state
