"""The environment the launcher gives each rank."""

from __future__ import annotations

import os
import sys

import pytest

from bench.run import launcher
from bench.run.config import compose
from bench.run.spec import spec_from_config


def _rank_env() -> dict[str, str]:
    return launcher.rank_env(spec_from_config(compose(["launcher.threads_per_rank=1"])))


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs a virtual environment (the project's .venv)")
def test_jit_ops_are_cached_inside_this_virtual_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert _rank_env()["TORCH_EXTENSIONS_DIR"] == os.path.join(sys.prefix, "torch_extensions")
    assert _rank_env()["OMP_NUM_THREADS"] == "1"


def test_a_jit_cache_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert _rank_env()["TORCH_EXTENSIONS_DIR"] == str(tmp_path)


def test_outside_a_virtual_environment_torch_s_default_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "prefix", sys.base_prefix)
    assert launcher.jit_cache_dir() is None
