"""The timers that split a run's fixed cost: model builders and torch's JIT extension loader."""

from __future__ import annotations

import torch.utils.cpp_extension

from bench.measure import jit_ops
from bench.run.config import compose
from bench.run.models import build_backbone, model_build_seconds
from bench.run.spec import spec_from_config


def test_building_a_model_adds_its_time_to_the_process_s_build_seconds():
    before = model_build_seconds()
    build_backbone(spec_from_config(compose([])).model)  # the tiny default model
    assert model_build_seconds() > before


def test_the_jit_timer_passes_every_argument_through_and_counts_the_load(monkeypatch):
    calls = []

    def fake_load(name, sources, **kwargs):  # stands in for a compiler run: the timer is what is tested
        calls.append((name, sources, kwargs))
        return "module"

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fake_load)
    jit_ops.install()
    jit_ops.install()  # a second install must not wrap twice
    before = jit_ops.seconds()
    assert torch.utils.cpp_extension.load("op", ["a.cpp"], verbose=False) == "module"
    assert calls == [("op", ["a.cpp"], {"verbose": False})]
    assert torch.utils.cpp_extension.load.__wrapped__ is fake_load
    assert jit_ops.seconds() > before
