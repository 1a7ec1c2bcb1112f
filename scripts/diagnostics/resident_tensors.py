"""Which of the engines' tensors are resident at the end of each phase of a step, and how much RSS is left over.

The memory model names what each engine keeps (weights, master copies, moments, gradient partitions, reduce
buckets); the host's RSS counts a tensor's pages only once they are written. This diagnostic runs a warm-up step
of an adapter's PPO, RM or SFT stage, then the next step's phases one after the other, and at the end of the set-up
and of each phase asks the kernel (mincore) how many pages of each tensor it finds on the engines are resident:
every parameter (its ZeRO-3 partition, and the whole tensor where one is gathered), its gradient, the optimizer's
states and DeepSpeed's flat buffers (fp32 partitions, ZeRO-3's gradient partition, the reduce buckets), summed
per role and kind. "rest" is the process's anonymous RSS less those: the imported libraries, the heap, and
tensors held by no engine. Snapshots fall at phase ends, not at their peaks (scripts/diagnostics/peak_moment.py
follows the peaks).

    MALLOC_MMAP_THRESHOLD_=131072 torchrun --standalone --nproc_per_node 2 scripts/diagnostics/resident_tensors.py \
        framework=dschat stage=ppo model=llama-base model.layers=2 precision=fp32 zero=3 batch=2 launcher.nproc=2

Rank 0 prints its table. Under `torchrun` directly the harness's `memory_mmap_threshold` is not applied: set
glibc's variable as above.
"""

from __future__ import annotations

import collections
import ctypes
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench.run.config import compose  # noqa: E402
from bench.run.spec import spec_from_config  # noqa: E402
from scripts.diagnostics.diagnostic_rank import DiagnosticRank  # noqa: E402

MIB = 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")
LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
# DeepSpeed optimizers' own buffers, by attribute (ZeRO-1/2: stage_1_and_2.py; ZeRO-3: stage3.py)
FLAT_BUFFERS = ("grad_partitions_flat_buffer", "lp_param_buffer", "fp32_partitioned_groups_flat",
                "single_partition_of_fp32_groups", "bit16_groups_flat")


def resident_bytes(address: int, nbytes: int) -> int:
    """Bytes of the whole pages inside [address, address + nbytes) that are resident (mincore)."""
    start, end = -(-address // PAGE) * PAGE, (address + nbytes) // PAGE * PAGE
    if end <= start:
        return 0
    pages = (end - start) // PAGE
    vector = (ctypes.c_ubyte * pages)()
    if LIBC.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vector) * PAGE


def anonymous_rss() -> int:
    """The process's anonymous resident bytes (smaps_rollup)."""
    with open("/proc/self/smaps_rollup") as f:
        fields = dict(line.split(":", 1) for line in f.read().splitlines()[1:])  # after the range line
    return int(fields["Anonymous"].split()[0]) * 1024


def engine_tensors(adapter: Any) -> dict[int, tuple[int, str]]:
    """Every storage the adapter's engines hold, by address: (bytes, "role: kind"); a storage found twice keeps
    its first name (a view of a flat buffer is that buffer)."""
    found: dict[int, tuple[int, str]] = {}

    def add(tensor: Any, name: str) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and tensor.numel():
            storage = tensor.untyped_storage()
            found.setdefault(storage.data_ptr(), (storage.nbytes(), name))

    for role, engine in getattr(adapter, "engines", {}).items():
        module = getattr(engine, "module", engine)
        for param in module.parameters():
            if hasattr(param, "ds_tensor"):
                add(param.ds_tensor, f"{role}: ZeRO-3 partition")
                add(param.data, f"{role}: gathered whole")
            else:
                add(param.data, f"{role}: weights")
            add(param.grad, f"{role}: gradients")
        optimizer = getattr(engine, "optimizer", None)
        if optimizer is None:
            continue
        for attr in FLAT_BUFFERS:
            value = getattr(optimizer, attr, None)
            for tensor in value if isinstance(value, list) else [value]:
                add(tensor, f"{role}: {attr}")
        for bucket in getattr(optimizer, "ipg_buckets", {}).values():
            add(getattr(bucket, "buffer", None), f"{role}: reduce bucket")
        for state in getattr(getattr(optimizer, "optimizer", optimizer), "state", {}).values():
            for key, value in state.items():
                add(value, f"{role}: optimizer {key}")
    return found


def snapshot(adapter: Any, when: str, rank: int) -> None:
    rows: collections.Counter[str] = collections.Counter()
    for address, (nbytes, name) in engine_tensors(adapter).items():
        rows[name] += resident_bytes(address, nbytes)
    total = anonymous_rss()
    if rank == 0:
        print(f"{when}: anonymous RSS {total / MIB:,.1f} MiB, of which (MiB resident)", flush=True)
        for name, value in sorted(rows.items()):
            if value:
                print(f"  {value / MIB:9.1f}  {name}")
        print(f"  {(total - sum(rows.values())) / MIB:9.1f}  rest", flush=True)


def main(argv: list[str]) -> None:
    run = DiagnosticRank.start(spec_from_config(compose(argv)))
    snapshot(run.adapter, "after set-up", run.rank)
    run.step(0)
    snapshot(run.adapter, "after the warm-up step", run.rank)
    if run.stage == "ppo":
        rollout = run.adapter.generate(run.data.prompts(1))
        snapshot(run.adapter, "after generation", run.rank)
        experience = run.adapter.make_experience(rollout)
        snapshot(run.adapter, "after experience making", run.rank)
        run.adapter.ppo_train([experience])
        snapshot(run.adapter, "after the update", run.rank)
    else:
        run.step(1)
        snapshot(run.adapter, "after a training step", run.rank)
    run.adapter.close()


if __name__ == "__main__":
    main(sys.argv[1:])
