"""What an object graph holds in tensors, and how much of each a CPU process has actually touched.

Used to name what sits in a breakdown's "rest" (gradient partitions, communication buckets): an engine's
optimizer is walked breadth first for tensors, one entry per storage. On a CPU an allocation only costs
resident memory once its pages are written, so each entry carries its resident bytes (mincore(2)) next to
its allocated bytes; on an accelerator the two are the same.
"""

from __future__ import annotations

import ctypes
import mmap
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

PAGE = mmap.PAGESIZE


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's storage the process has touched, in whole pages (so the edges round up)."""
    storage = tensor.untyped_storage()
    if tensor.device.type != "cpu":
        return storage.nbytes()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    if end <= start:
        return 0
    first, last = start - start % PAGE, end + (-end) % PAGE
    pages = (last - first) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(last - first), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) * PAGE


@dataclass
class Held:
    path: str  # the shortest attribute path from the root
    dtype: str
    allocated: int
    resident: int


def _children(obj: Any) -> list[tuple[str, Any]]:
    if isinstance(obj, dict):  # tensor keys (torch optimizers' state) are named by position
        return [(f"[{k!r}]" if isinstance(k, (str, int, torch.dtype)) else f"[#{i}]", v)
                for i, (k, v) in enumerate(obj.items())]
    if isinstance(obj, (list, tuple, deque)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    if hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        return [(f".{k}", v) for k, v in vars(obj).items()]
    return []


def held_tensors(root: Any, exclude: set[int], name: str = "root", max_depth: int = 5) -> list[Held]:
    """Tensors reachable from `root` (breadth first, so each gets its shortest path) and parameters' `.grad`,
    one per storage, minus the storages (data pointers) in `exclude`. Modules are not entered."""
    seen_objects, seen_storages = {id(root)}, set(exclude)
    found: list[Held] = []
    queue: deque[tuple[str, Any, int]] = deque([(name, root, 0)])
    while queue:
        path, obj, depth = queue.popleft()
        if isinstance(obj, torch.Tensor):
            grad = obj.grad if isinstance(obj, torch.nn.Parameter) else None
            for t, suffix in [(obj, "")] + ([(grad, ".grad")] if grad is not None else []):
                ptr = t.untyped_storage().data_ptr()
                if ptr and ptr not in seen_storages:
                    seen_storages.add(ptr)
                    found.append(Held(path + suffix, str(t.dtype).removeprefix("torch."),
                                      t.untyped_storage().nbytes(), resident_bytes(t)))
            continue
        if depth >= max_depth:
            continue
        for child_name, child in _children(obj):
            if id(child) not in seen_objects:
                seen_objects.add(id(child))
                queue.append((path + child_name, child, depth + 1))
    return found


def storages(tensors: Any) -> set[int]:
    """The storage data pointers of the tensors among `tensors` (other items are skipped)."""
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}
