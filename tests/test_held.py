"""What an object graph holds: tensors found once per storage, named by path, resident pages counted."""

from __future__ import annotations

import torch

from bench.measure.held import PAGE, held_tensors, resident_bytes, storages
from bench.measure.memory import trim_heap

MIB = 2**20


# the edges: malloc's header page, and with transparent huge pages a fault maps 2 MiB at a time
EDGES = 4 * MIB + 2 * PAGE


def test_an_untouched_allocation_is_not_resident_until_written():
    trim_heap()  # else malloc may serve it from heap an earlier test freed, pages still resident
    big = torch.empty(64 * MIB, dtype=torch.uint8)  # malloc maps it; no page is touched yet
    assert resident_bytes(big) <= EDGES
    big[: 16 * MIB].fill_(1)
    assert 16 * MIB <= resident_bytes(big) <= 16 * MIB + EDGES
    big.fill_(1)
    assert resident_bytes(big) >= 64 * MIB


class _Bucket:
    def __init__(self, flat: torch.Tensor) -> None:
        self.buffer = [flat]


class _Wrapper:  # the shape of a ZeRO optimizer: buckets keyed by dtype, views of one flat buffer
    def __init__(self) -> None:
        self.flat = torch.zeros(1024)  # 4 KiB
        self.views = {7: self.flat.narrow(0, 0, 10), "w": self.flat.narrow(0, 10, 20)}
        self.ipg_buckets = {torch.bfloat16: _Bucket(torch.zeros(256, dtype=torch.bfloat16))}
        self.state = {torch.zeros(2): {"exp_avg": torch.zeros(8)}}  # a tensor key, as torch optimizers have
        self.master = torch.ones(16)


def test_each_storage_is_found_once_under_its_shortest_path_and_excluded_ones_are_skipped():
    wrapper = _Wrapper()
    found = held_tensors(wrapper, exclude=storages([wrapper.master]), name="optimizer")
    by_path = {h.path: (h.dtype, h.allocated) for h in found}
    assert by_path == {
        "optimizer.flat": ("float32", 4096),  # the views share its storage: not listed again
        "optimizer.ipg_buckets[torch.bfloat16].buffer[0]": ("bfloat16", 512),
        "optimizer.state[#0]['exp_avg']": ("float32", 32),
    }


def test_a_parameter_brings_its_gradient_and_modules_are_not_entered():
    linear = torch.nn.Linear(2, 2, bias=False)
    linear(torch.ones(1, 2)).sum().backward()
    holder = {"param": linear.weight, "module": torch.nn.Linear(100, 100)}
    paths = {h.path for h in held_tensors(holder, exclude=set())}
    assert paths == {"root['param']", "root['param'].grad"}
