"""Which tensors are alive at a chosen moment of a step: a census by the garbage collector.

The experience peak of PPO is set by what a framework keeps alive while its last inference models run
(logits, KV caches, hidden states). `LiveTensorProbe` hooks a module's forward (an adapter names the
moment, e.g. the reward model's call) and, the first time it fires, lists every tensor storage that is
alive and was not alive when the probe was armed (after setup: weights, optimizer state and engine
buffers are left out). Storages are listed once, with the shape of their largest view, grouped by
(shape, dtype, device). Tensors only C++ holds (autograd's saved tensors) are invisible to `gc`; the
moments probed run without gradients, where there are none.
"""

from __future__ import annotations

import gc
import warnings
from dataclasses import dataclass

import torch

MAX_GROUPS = 48


@dataclass(frozen=True)
class LiveGroup:
    shape: tuple[int, ...]  # of the largest tensor viewing the storage
    dtype: str
    device: str
    count: int  # storages of this kind
    storage_bytes: int  # of one storage (a view may cover only part of it, e.g. K and V of a fused QKV)

    def as_dict(self) -> dict[str, object]:
        return {"shape": list(self.shape), "dtype": self.dtype, "device": self.device, "count": self.count,
                "storage_bytes": self.storage_bytes, "total_bytes": self.count * self.storage_bytes}


def _has_storage(t: torch.Tensor) -> bool:
    """Wrapper subclasses (FSDP2's DTensor) own no storage of their own: their local tensors are counted."""
    try:
        t.untyped_storage().data_ptr()
    except RuntimeError:
        return False
    return t.device.type != "meta"


def _live_tensors() -> list[torch.Tensor]:
    with warnings.catch_warnings():  # isinstance on some torch module objects warns about deprecated names
        warnings.simplefilter("ignore")
        return [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and _has_storage(obj)]


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


def storages_alive() -> set[tuple[str, int]]:
    return {_storage_key(t) for t in _live_tensors()}


def census(exclude: set[tuple[str, int]]) -> list[LiveGroup]:
    """Live storages not in `exclude` and not parameters, largest groups first."""
    largest: dict[tuple[str, int], torch.Tensor] = {}
    for t in _live_tensors():
        if isinstance(t, torch.nn.Parameter):
            continue
        key = _storage_key(t)
        if key in exclude or key[1] == 0:
            continue
        if key not in largest or t.numel() > largest[key].numel():
            largest[key] = t
    groups: dict[tuple, list[int]] = {}
    for t in largest.values():
        nbytes = t.untyped_storage().nbytes()
        group = groups.setdefault((tuple(t.shape), str(t.dtype).removeprefix("torch."), str(t.device), nbytes), [0])
        group[0] += 1
    rows = [LiveGroup(shape=shape, dtype=dtype, device=device, count=n[0], storage_bytes=nbytes)
            for (shape, dtype, device, nbytes), n in groups.items()]
    rows.sort(key=lambda g: g.count * g.storage_bytes, reverse=True)
    return rows[:MAX_GROUPS]


class LiveTensorProbe:
    """Arms forward pre-hooks on named modules; each takes one census, the first time it fires."""

    def __init__(self, points: dict[str, torch.nn.Module]) -> None:
        self.baseline = storages_alive()
        self.results: dict[str, list[dict[str, object]]] = {}
        self._handles = [module.register_forward_pre_hook(self._hook(name)) for name, module in points.items()]

    def _hook(self, name: str):
        def take(_module, _inputs) -> None:
            if name not in self.results:
                self.results[name] = [g.as_dict() for g in census(self.baseline)]

        return take

    def close(self) -> dict[str, list[dict[str, object]]]:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return self.results
