"""What ColossalAI 0.5.0 lacks on a CPU-only machine, supplied once per process when the device is the CPU.

ColossalAI targets CUDA; its CpuAccelerator raises "not supported" for RNG, stream and device-count calls
and a few code paths assume CUDA or Ascend. Each fix below answers one upstream failure (ids as in
reference/cpu-runtime-notes.md section 4.3; P8 surfaced here) and touches only that symbol. They depend on 0.5.0's
internals -- which is why colossalai is pinned -- and `apply` fails loudly if a patched symbol is gone.
Nothing here runs on a GPU: there the same code paths are ColossalAI's own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import torch

SUPPORTED_VERSION = "0.5.0"

_applied: list[str] = []


def _require(owner: object, name: str) -> None:
    if not hasattr(owner, name):
        raise RuntimeError(
            f"colossalai CPU compatibility: {getattr(owner, '__name__', owner)}.{name} is missing; these fixes are "
            f"written for colossalai=={SUPPORTED_VERSION}"
        )


def _p1_rng(cpu_accelerator: type) -> None:
    """Tensor parallelism (shardformer) seeds and saves RNG through the accelerator; the CPU one passes a
    device to torch.get_rng_state() (which takes none) and refuses manual_seed."""
    for name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all", "initial_seed", "synchronize"):
        _require(cpu_accelerator, name)
    cpu_accelerator.get_rng_state = lambda self, device=None: torch.get_rng_state()
    cpu_accelerator.set_rng_state = lambda self, new_state, device=None: torch.set_rng_state(new_state)
    cpu_accelerator.manual_seed = lambda self, seed: torch.manual_seed(seed)
    cpu_accelerator.manual_seed_all = lambda self, seed: torch.manual_seed(seed)
    cpu_accelerator.initial_seed = lambda self: torch.initial_seed()
    cpu_accelerator.synchronize = lambda self, device=None: None


def _p2_hccl() -> None:
    """Pipeline p2p asks torch.distributed.is_hccl_available() and Backend.HCCL, which exist only with
    Ascend's torch_npu."""
    import torch.distributed as dist

    if not hasattr(dist, "is_hccl_available"):
        dist.is_hccl_available = lambda: False
    if not hasattr(dist.Backend, "HCCL"):
        dist.Backend.HCCL = "hccl"


def _p3_zero_sanity() -> None:
    """LowLevelZeroOptimizer._sanity_checks asserts the accelerator is cuda/npu before its real check
    (every ZeRO-managed parameter has the optimizer's dtype); keep the real check."""
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    _require(LowLevelZeroOptimizer, "_sanity_checks")

    def sanity_checks(self) -> None:
        for group in self.optim.param_groups:
            for param in group["params"]:
                if not getattr(param, "skip_zero_check", False) and param.dtype != self._dtype:
                    raise AssertionError(
                        f"Parameters are expected to have the same dtype `{self._dtype}`, but got `{param.dtype}`"
                    )

    LowLevelZeroOptimizer._sanity_checks = sanity_checks


def _p4_streams(cpu_accelerator: type) -> None:
    """ZeRO's bucket store opens streams and events; torch's CPU stream API is a working no-op."""
    for name in ("Stream", "Event", "current_stream", "default_stream", "set_stream", "stream"):
        _require(cpu_accelerator, name)
    cpu_accelerator.Stream = lambda self, device=None, priority=0, **kwargs: torch.cpu.Stream()
    cpu_accelerator.Event = lambda self, enable_timing=False, blocking=False, interprocess=False: torch.cpu.Event()
    cpu_accelerator.current_stream = lambda self, device=None: torch.cpu.current_stream()
    cpu_accelerator.default_stream = lambda self, device=None: torch.cpu.current_stream()
    cpu_accelerator.set_stream = lambda self, stream_: None
    cpu_accelerator.stream = lambda self, stream_: contextlib.nullcontext()


def _p5_device_count(cpu_accelerator: type) -> None:
    """fp16's DynamicGradScaler asks the accelerator for its device count."""
    _require(cpu_accelerator, "device_count")
    cpu_accelerator.device_count = lambda self: 1


def _p6_cuda_set_device() -> None:
    """Shardformer's GPT-2/OPT/GPT-J/T5 forwards call torch.cuda.set_device(hidden_states.device)."""
    original: Callable = torch.cuda.set_device

    def set_device(device) -> None:
        if isinstance(device, torch.device) and device.type == "cpu":
            return
        original(device)

    torch.cuda.set_device = set_device


def _p7_cpu_adam_kernel() -> None:
    """HybridAdam/CPUAdam load a CPU Adam kernel; the x86 one is a CUDA extension and the ARM one is
    offered only on aarch64. The ARM source is portable C++ with a scalar path: build it here (g++, once,
    cached under ~/.cache/colossalai)."""
    from colossalai.kernel import kernel_loader
    from colossalai.kernel.extensions.pybind.cpu_adam.cpu_adam_arm import CpuAdamArmExtension

    _require(kernel_loader.CPUAdamLoader, "REGISTRY")

    class PortableCpuAdamExtension(CpuAdamArmExtension):
        def is_available(self) -> bool:
            return True

        def assert_compatible(self) -> None:
            return None

    kernel_loader.CPUAdamLoader.REGISTRY = [PortableCpuAdamExtension]


def _p8_fused_qkv_gather() -> None:
    """Gathering a TP-sharded GPT-2 fused qkv weight (checkpoint save) moves it with .cuda() before the
    all-gather. Gather on the tensor's own device; the [Q1 K1 V1][Q2 K2 V2] -> [Q1 Q2 K1 K2 V1 V2]
    reordering is unchanged."""
    import torch.distributed as dist
    from colossalai.shardformer.layer import qkv_fused_linear

    _require(qkv_fused_linear, "gather_fused_qkv_in_gpt2_style")

    def gather(qkv: torch.Tensor, split_sizes: list[int], process_group, is_transposed: bool = False) -> torch.Tensor:
        world = dist.get_world_size(group=process_group)
        parts = [torch.empty_like(qkv) for _ in range(world)]
        dist.all_gather(parts, qkv.contiguous(), group=process_group)
        dim = -1 if is_transposed else 0
        chunks = torch.split(torch.cat(parts, dim=dim), [size // world for size in split_sizes] * world, dim=dim)
        return torch.cat([c for i in range(len(split_sizes)) for c in chunks[i :: len(split_sizes)]], dim=dim)

    qkv_fused_linear.gather_fused_qkv_in_gpt2_style = gather


def apply() -> list[str]:
    """Apply every CPU fix once per process; returns their one-line descriptions (for the record)."""
    if _applied:
        return list(_applied)
    import colossalai
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator

    if colossalai.__version__ != SUPPORTED_VERSION:
        raise RuntimeError(
            f"colossalai {colossalai.__version__} is installed; the CPU compatibility layer is written for "
            f"{SUPPORTED_VERSION} (scripts/setup.sh installs it)"
        )
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "")  # the kernel builder must not probe for CUDA archs
    _p1_rng(CpuAccelerator)
    _p2_hccl()
    _p3_zero_sanity()
    _p4_streams(CpuAccelerator)
    _p5_device_count(CpuAccelerator)
    _p6_cuda_set_device()
    _p7_cpu_adam_kernel()
    _p8_fused_qkv_gather()
    _applied.extend([
        "P1 CpuAccelerator RNG calls mapped to torch's CPU generator (tensor parallelism)",
        "P2 torch.distributed.is_hccl_available/Backend.HCCL defined (pipeline p2p)",
        "P3 LowLevelZeroOptimizer dtype check without its cuda/npu assert (ZeRO 1/2)",
        "P4 CpuAccelerator streams/events backed by torch.cpu no-op streams (ZeRO buckets)",
        "P5 CpuAccelerator.device_count() = 1 (fp16 dynamic loss scaler)",
        "P6 torch.cuda.set_device is a no-op for CPU devices (shardformer GPT-2 forward)",
        "P7 CPU Adam kernel JIT-built from ColossalAI's portable ARM source (HybridAdam)",
        "P8 GPT-2 fused-qkv TP gather on the tensor's own device, not .cuda() (TP checkpoint save)",
    ])
    return list(_applied)
