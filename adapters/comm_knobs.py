"""The `ds.*` communication knobs (bench.run.spec.CommSpec) as the adapters hand them to their engines, and
read them back."""

from __future__ import annotations

from typing import Any

import torch

from bench.run.spec import RunSpec, UnsupportedError


def deepspeed_comm(spec: RunSpec, device: torch.device) -> dict[str, Any]:
    """The ds.* knobs the config sets, as DeepSpeed zero_optimization keys. DeepSpeed's and ColossalAI's
    overlapped reductions record CUDA streams on their buffers, which host tensors reject: overlap_comm=true
    is refused on a device without streams."""
    if spec.ds.overlap_comm and device.type != "cuda":
        raise UnsupportedError(f"ds.overlap_comm=true needs a device with streams (CUDA); this run's device is "
                               f"{device.type}: leave it null or set it false")
    return {key.removeprefix("ds."): value for key, value in spec.ds.set_knobs().items()}


def deepspeed_comm_knobs(engines: dict[str, Any]) -> dict[str, dict[str, int | bool]]:
    """The ds.* knobs as DeepSpeed engines apply them (their ZeRO config), per knob and trained role."""
    return {"allgather_bucket_size": {role: int(e.zero_allgather_bucket_size()) for role, e in engines.items()},
            "reduce_bucket_size": {role: int(e.zero_reduce_bucket_size()) for role, e in engines.items()},
            "overlap_comm": {role: bool(e.zero_overlap_comm()) for role, e in engines.items()}}
