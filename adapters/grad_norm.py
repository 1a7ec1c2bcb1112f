"""Global gradient norm of whole gradients on a module, without materialising fp32 copies of them."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def global_grad_norm(parameters: Iterable[torch.nn.Parameter]) -> float | None:
    """L2 norm over every gradient, accumulated in fp32 one tensor at a time: a measurement inside the
    training phase must not add a copy of all gradients to the peak it measures."""
    squares = [torch.linalg.vector_norm(p.grad, dtype=torch.float32) ** 2 for p in parameters if p.grad is not None]
    if not squares:
        return None
    return float(torch.stack(squares).sum().sqrt())
