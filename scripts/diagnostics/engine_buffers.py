"""What an engine holds besides parameters and optimizer state, at the moment of the optimizer step.

The record's breakdown puts gradients, ZeRO's gradient partitions and its communication buckets in "rest".
This diagnostic names them: it runs a few SFT or RM steps of one adapter and, just before each optimizer step
(gradients reduced; ZeRO-2 has freed its buckets at the backward's end, ZeRO-3 keeps its own), walks the
engines' optimizer objects for tensors that are not model state (bench/measure/held.py) and reports each
one's allocated bytes and, on a CPU, its resident bytes (what the RSS peak counts).

    torchrun --standalone --nproc_per_node 2 scripts/diagnostics/engine_buffers.py framework=dschat \
        model=glm-base zero=3

DS-Chat's engines only (trlx's are the same DeepSpeed optimizers behind accelerate). Overrides are the
harness's own (`stage=sft|rm`, default sft); rank 0 prints one table per engine and step.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import psutil

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from adapters.deepspeed_state import zero3_masters  # noqa: E402
from bench.measure.held import Held, held_tensors, resident_bytes, storages  # noqa: E402
from bench.measure.memory import malloc_live_bytes  # noqa: E402
from bench.run.config import compose  # noqa: E402
from bench.run.spec import spec_from_config  # noqa: E402
from scripts.diagnostics.diagnostic_rank import DiagnosticRank  # noqa: E402

MIB = 2**20


def model_state_storages(engine: Any) -> set[int]:
    """What the record's model state already counts: the module's parameters (and ZeRO-3 partitions), the
    torch optimizer's parameters (fp32 masters where the engine keeps them) and its state tensors."""
    params = list(engine.module.parameters())
    found = storages(params) | storages(getattr(p, "ds_tensor", None) for p in params)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    found |= storages(p for group in inner.param_groups for p in group["params"])
    found |= storages(t for state in inner.state.values() for t in state.values())
    return found | storages(zero3_masters(engine.optimizer))


def _report(role: str, step: int, engine: Any) -> None:
    params = list(engine.module.parameters())
    model = model_state_storages(engine)
    grads = [p.grad for p in params if p.grad is not None]
    items = held_tensors(engine.optimizer, model, name="optimizer")
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
    if spec.framework != "dschat":
        raise SystemExit(f"framework={spec.framework}: this diagnostic reads DS-Chat's DeepSpeed engines; allowed: "
                         "framework=dschat")
    run = DiagnosticRank.start(spec)
    adapter, rank = run.adapter, run.rank
    engines = {role: e for role, e in adapter.engines.items() if getattr(e, "optimizer", None) is not None}
    step = 0
    for role, engine in engines.items():
        original = engine.optimizer.step

        def inspected(*args: Any, _role: str = role, _engine: Any = engine, _original: Any = original,
                      **kwargs: Any) -> Any:
            if rank == 0:
                _report(_role, step, _engine)
            return _original(*args, **kwargs)

        engine.optimizer.step = inspected
    for step in range(spec.steps[run.stage]):
        run.step(step)
    adapter.close()


if __name__ == "__main__":
    main(sys.argv[1:])
