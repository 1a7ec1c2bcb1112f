"""What a DeepSpeed engine holds, read for the record's model state (DS-Chat and trlx both run on it).

ZeRO-3 keeps each parameter's shard in `param.ds_tensor` and its fp32 master partitions in the optimizer
wrapper's `fp32_partitioned_groups_flat`: it puts them in the torch optimizer's parameter groups only for
the step and empties the groups again (stage3.py `_optimizer_step`), so a reading after the step finds
them there no more. ZeRO-0/1/2 keep their masters in the groups, where `model_state` finds them.
"""

from __future__ import annotations

from typing import Any

import torch

from adapters.state_bytes import tensor_bytes


def held_bytes(param: torch.nn.Parameter) -> int:
    """A ZeRO-3 partition (`ds_tensor`) plus any gathered or persistent copy."""
    return tensor_bytes(param.data) + (tensor_bytes(param.ds_tensor) if hasattr(param, "ds_tensor") else 0)


def zero3_masters(wrapper: Any) -> list[torch.Tensor]:
    """The fp32 master partitions a ZeRO-3 optimizer wrapper keeps outside its optimizer's groups (none at
    other stages or without an optimizer)."""
    return list(getattr(wrapper, "fp32_partitioned_groups_flat", None) or [])
