"""Model-state bytes, worked by hand: parameters, optimizer state, master copies kept outside the groups."""

from __future__ import annotations

import torch

from adapters.deepspeed_state import zero3_masters
from adapters.state_bytes import model_state


def _stepped_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    return optimizer


def test_adam_moments_count_and_the_module_parameters_are_not_counted_twice():
    model = torch.nn.Linear(4, 4)  # 16 + 4 fp32 parameters = 80 bytes
    state = model_state(model.parameters(), _stepped_adamw(model))
    # exp_avg + exp_avg_sq: 2 x 80 bytes; the 0-dim `step` counters are not state memory worth a line
    assert (state.param_bytes, state.optimizer_state_bytes, state.trainable_param_bytes) == (80, 160, 80)


def test_masters_kept_outside_the_groups_count_once():
    model = torch.nn.Linear(4, 4)
    optimizer = _stepped_adamw(model)
    master = torch.zeros(10)  # 40 bytes, as ZeRO-3's fp32 partition between steps
    aliased = model.weight.data  # a "master" that is the module's own tensor is not a second copy
    state = model_state(model.parameters(), optimizer, masters=[master, aliased, master])
    assert state.optimizer_state_bytes == 160 + 40


class _Stage3Wrapper:  # the attribute DeepSpeed's ZeRO-3 optimizer keeps its fp32 partitions in
    def __init__(self) -> None:
        self.fp32_partitioned_groups_flat = [torch.zeros(3), torch.zeros(5)]


def test_zero3_masters_are_read_from_the_wrapper_and_absent_elsewhere():
    assert [t.numel() for t in zero3_masters(_Stage3Wrapper())] == [3, 5]
    assert zero3_masters(object()) == [] and zero3_masters(None) == []
