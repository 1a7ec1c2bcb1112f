"""What an engine holds besides parameters and optimizer state, at the moment of the optimizer step.

The record's breakdown puts gradients, ZeRO's gradient partitions and its communication buckets in "rest".
This diagnostic names them: it runs a few SFT or RM steps of one adapter and, just before each optimizer step
(gradients reduced, buckets still alive), walks the engines' optimizer objects for tensors, deduplicated by
storage, and reports each one's allocated bytes and, on a CPU, its resident bytes (mincore(2): pages the
process has touched, which is what the RSS peak counts; on CUDA allocated = resident).

    torchrun --standalone --nproc_per_node 2 scripts/engine_buffers.py framework=dschat model=glm-base zero=3

Overrides are the harness's own (`stage=sft|rm`, default sft); rank 0 prints one table per engine and step.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any

import psutil
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from adapters import registry  # noqa: E402
from adapters.base import RankContext  # noqa: E402
from adapters.deepspeed_state import zero3_masters  # noqa: E402
from bench.config import compose  # noqa: E402
from bench.data import SyntheticData  # noqa: E402
from bench.spec import spec_from_config  # noqa: E402
from bench.trackers.memory import malloc_live_bytes  # noqa: E402
from bench.worker import resolve_device  # noqa: E402

MIB = 2**20
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's storage the process has touched (whole pages, so edges may round up)."""
    storage = tensor.untyped_storage()
    if tensor.device.type != "cpu":
        return storage.nbytes()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    if end <= start:
        return 0
    first, last = start - start % PAGE, end + (-end) % PAGE
    pages = (last - first) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(last - first), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) * PAGE


@dataclass
class Held:
    path: str
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


def held_tensors(root: Any, exclude: set[int], max_depth: int = 5) -> list[Held]:
    """Tensors reachable from `root` (breadth first, so each gets its shortest path), one per storage, minus the
    storages in `exclude`. Modules are not entered: their parameters are the model, counted elsewhere."""
    seen_objects, seen_storages = {id(root)}, set(exclude)
    found: list[Held] = []
    queue: deque[tuple[str, Any, int]] = deque([("optimizer", root, 0)])
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
        for name, child in _children(obj):
            if id(child) not in seen_objects:
                seen_objects.add(id(child))
                queue.append((path + name, child, depth + 1))
    return found


def _storages(tensors: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


def model_state_storages(engine: Any) -> set[int]:
    """What the record's model state already counts: the module's parameters (and ZeRO-3 partitions), the
    torch optimizer's parameters (fp32 masters where the engine keeps them) and its state tensors."""
    params = list(engine.module.parameters())
    found = _storages(params) | _storages(getattr(p, "ds_tensor", None) for p in params)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    found |= _storages(p for group in inner.param_groups for p in group["params"])
    found |= _storages(t for state in inner.state.values() for t in state.values())
    return found | _storages(zero3_masters(engine.optimizer))


def _report(role: str, step: int, engine: Any) -> None:
    params = list(engine.module.parameters())
    model = model_state_storages(engine)
    grads = [p.grad for p in params if p.grad is not None]
    items = held_tensors(engine.optimizer, model)
    items += [Held("module parameters' .grad", str(g.dtype).removeprefix("torch."), g.untyped_storage().nbytes(),
                   resident_bytes(g)) for g in grads if g.untyped_storage().data_ptr() not in model]
    big = sorted((h for h in items if h.allocated >= MIB), key=lambda h: -h.allocated)
    rss, live = psutil.Process().memory_info().rss, malloc_live_bytes()
    print(f"\n{role}, step {step}, before the optimizer step: RSS {rss / MIB:,.0f} MiB, malloc live "
          f"{(live or 0) / MIB:,.0f} MiB; tensors >= 1 MiB the optimizer reaches besides the model state:")
    print(f"  {'allocated MiB':>13} {'resident MiB':>12}  dtype     path")
    for h in big:
        print(f"  {h.allocated / MIB:13,.1f} {h.resident / MIB:12,.1f}  {h.dtype:8}  {h.path}")
    print(f"  {sum(h.allocated for h in big) / MIB:13,.1f} {sum(h.resident for h in big) / MIB:12,.1f}  total")


def main(overrides: list[str]) -> None:
    spec = spec_from_config(compose(overrides))
    stage = spec.stage if spec.stage in ("sft", "rm") else "sft"
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.set_num_threads(spec.launcher.threads_per_rank)
    device = resolve_device(spec.launcher.device, local_rank)
    adapter = registry.adapter_class(spec.framework)(spec, RankContext(rank, world, local_rank, device))
    adapter.setup(stage, {})
    data = SyntheticData(spec.model.vocab, spec.prompt_len, spec.answer_len, spec.batch, spec.seed,
                         adapter.data_parallel_rank)
    engines = {role: e for role, e in getattr(adapter, "engines", {}).items() if getattr(e, "optimizer", None)}
    if not engines:
        raise SystemExit(f"framework={spec.framework}: no engine with an optimizer to inspect (DeepSpeed engines)")
    step = 0
    for role, engine in engines.items():
        original = engine.optimizer.step

        def inspected(*args: Any, _role: str = role, _engine: Any = engine, _original: Any = original,
                      **kwargs: Any) -> Any:
            if rank == 0:
                _report(_role, step, _engine)
            return _original(*args, **kwargs)

        engine.optimizer.step = inspected
    for step in range(spec.steps[stage]):
        if stage == "sft":
            adapter.sft_step(data.sft(step))
        else:
            adapter.rm_step(data.preferences(step))
    adapter.close()


if __name__ == "__main__":
    main(sys.argv[1:])
