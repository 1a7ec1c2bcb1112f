"""DeepSpeed on a CPU without oneDNN fp16 kernels: its fp16 refusal is a speed probe, not a need.

DeepSpeed 0.19.8's CPU accelerator reports fp16 as supported only where oneDNN has fp16 kernels
(`torch.ops.mkldnn._is_mkldnn_fp16_supported()`: AVX512-FP16 or AMX-FP16), and the engine then refuses
fp16 ("Type fp16 is not supported on your device"). torch's own fp16 CPU operators run on any x86 CPU,
only slower, so on such a CPU the harness lets DeepSpeed go on and says so in the record. Not applied on
GPUs, nor on CPUs that have the kernels.
"""

from __future__ import annotations

import torch

NOTE = ("CPU without oneDNN fp16 kernels (no AVX512-FP16/AMX-FP16): DeepSpeed's fp16 capability probe answered "
        "no and was overridden; fp16 runs on torch's generic CPU kernels (slower, same arithmetic)")


def allow_fp16(device: torch.device, precision: str) -> str | None:
    """Lets DeepSpeed's CPU accelerator take fp16 where its probe says no; returns the record's note, or None."""
    if device.type != "cpu" or precision != "fp16":
        return None
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.is_fp16_supported():
        return None
    type(accelerator).is_fp16_supported = lambda self: True
    return NOTE
