"""Shared fixtures: real runs of the benchmark on the tiny model, isolated in temporary directories."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from bench.run import jit_builds
from bench.run.benchmark import run_benchmark
from bench.run.config import compose
from bench.run.spec import spec_from_config

# Two ranks already fill both cores of the reference machine; more threads per rank only spin.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The JIT folder the launcher gives its ranks, for every other process a test starts (a script under torchrun, a
# child that loads an op): none rebuilds what set-up or an earlier test built.
jit_builds.use_cache_dir()


@pytest.fixture(scope="session")
def rm_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One cache of prerequisite models for the whole session (PPO runs without init.rm or init.sft)."""
    return str(tmp_path_factory.mktemp("rm-cache"))


@pytest.fixture
def run_bench(tmp_path, rm_cache) -> Callable[..., dict[str, Any]]:
    """Runs `bench` with Hydra overrides for real and returns the record as written on disk."""

    def run(*overrides: str, name: str = "run") -> dict[str, Any]:
        # PPO from random base weights unless a test asks for an actor: a prerequisite SFT model per
        # configuration would cost CI minutes that tests of memory, lifetimes and engines do not need
        if not any(o.startswith("init.sft") for o in overrides):
            overrides = (*overrides, "init.sft_prerequisite=false")
        # a stalled rank fails its test within 5 minutes, with its stacks (no CI test has a phase that long)
        if not any(o.startswith("launcher.stall_s") for o in overrides):
            overrides = (*overrides, "launcher.stall_s=300")
        config = compose(list(overrides))
        spec = spec_from_config(config)
        record = run_benchmark(spec, str(tmp_path / name), config, rm_cache)
        import json

        with open(tmp_path / name / "record.json") as f:
            on_disk = json.load(f)
        assert on_disk["status"] == record.status
        return on_disk

    return run
