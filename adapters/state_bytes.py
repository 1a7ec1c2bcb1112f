"""Bytes of parameters and optimizer state a rank holds, read from the engine's own tensors."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from adapters.base import ModelState


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's (FSDP2) local shard, any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(t: torch.Tensor) -> int:
    t = local(t)
    return t.numel() * t.element_size()


def model_state(parameters: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer | None,
                held: Callable[[torch.nn.Parameter], int] = lambda p: tensor_bytes(p.data),
                masters: Iterable[torch.Tensor] = ()) -> ModelState:
    """`held(param)` is what this rank keeps for one module parameter (a ZeRO-3 partition adds to it).
    Optimizer bytes are its state tensors plus master copies that are not the module's own tensors (the
    fp32 copies of mixed precision, ZeRO's shards); `optimizer` is the innermost torch optimizer. `masters`
    are master copies an engine keeps outside the optimizer's parameter groups between steps."""
    module_ptrs = set()
    param_bytes = trainable = accelerator = 0
    for param in parameters:
        param_bytes += held(param)
        if param.requires_grad:
            trainable += held(param)
        if param.device.type != "cpu":
            accelerator += held(param)
        module_ptrs.add(local(param.data).data_ptr())
    optimizer_tensors: list[torch.Tensor] = []
    if optimizer is not None and hasattr(optimizer, "state"):
        for state in optimizer.state.values():
            optimizer_tensors += [v for v in state.values() if torch.is_tensor(v) and v.dim()]
        for group in optimizer.param_groups:
            for param in group["params"]:
                if local(param.data).data_ptr() not in module_ptrs and param.numel():
                    optimizer_tensors.append(param.data)
    counted = {local(t).data_ptr() for t in optimizer_tensors} | module_ptrs
    for master in masters:
        if master.numel() and master.data_ptr() not in counted:
            counted.add(master.data_ptr())
            optimizer_tensors.append(master)
    optimizer_bytes = sum(tensor_bytes(t) for t in optimizer_tensors)
    accelerator += sum(tensor_bytes(t) for t in optimizer_tensors if t.device.type != "cpu")
    return ModelState(param_bytes=param_bytes, optimizer_state_bytes=optimizer_bytes, trainable_param_bytes=trainable,
                      accelerator_bytes=accelerator)
