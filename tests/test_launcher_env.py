"""The environment the launcher gives each rank."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from bench.run import jit_builds, launcher
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
    assert jit_builds.cache_dir() is None


@pytest.mark.parametrize("given, readable", [
    ("9.0a", "9.0"),                       # an H200 image's own list
    ("8.0;9.0;9.0a", "8.0;9.0"),           # the duplicate it makes goes
    ("8.0 9.0a+PTX 10.0a", "8.0;9.0+PTX;10.0"),
])
def test_an_arch_specific_cuda_list_is_made_readable_to_deepspeed_s_builder(
        monkeypatch: pytest.MonkeyPatch, given: str, readable: str) -> None:
    # the oracle is DeepSpeed's own CUDA op builder, which sorts the entries as dotted integers
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    builder = FusedAdamBuilder()
    builder.jit_mode = True
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", given)
    with pytest.raises(ValueError, match="invalid literal for int"):
        builder.compute_capability_args()
    env = _rank_env()
    assert (env["TORCH_CUDA_ARCH_LIST"], env["RLHF_BENCH_ARCH_LIST_GIVEN"]) == (readable, given)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", env["TORCH_CUDA_ARCH_LIST"])
    builder.compute_capability_args()  # builds its flags without a complaint


def test_a_readable_cuda_list_is_left_as_the_user_set_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0 9.0+PTX")
    env = _rank_env()
    assert env["TORCH_CUDA_ARCH_LIST"] == "8.0 9.0+PTX" and "RLHF_BENCH_ARCH_LIST_GIVEN" not in env


def test_a_fixed_mmap_threshold_reaches_the_ranks_and_glibc_s_own_leaves_the_environment_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert "MALLOC_MMAP_THRESHOLD_" not in _rank_env()
    fixed = launcher.rank_env(spec_from_config(compose(["memory_mmap_threshold=4194304"])))
    assert fixed["MALLOC_MMAP_THRESHOLD_"] == "4194304"


# A child asks glibc for a 12 MiB block twice, freeing the first: glibc's answer is in the chunk header before
# each block (the size word's IS_MMAPPED bit, 0x2). Glibc's own threshold starts at 128 KiB, so the first block
# is mapped; freeing it raises the threshold to the block's size, so the second comes from the heap. With the
# threshold fixed at 4 MiB both are mapped: what the launcher's variable does to the ranks' allocator.
GLIBC_PROBE = """
import ctypes
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
mapped = []
for _ in range(2):
    block = libc.malloc(12 << 20)
    mapped.append(ctypes.c_size_t.from_address(block - ctypes.sizeof(ctypes.c_size_t)).value & 2 == 2)
    libc.free(block)
print(mapped)
"""


@pytest.mark.engine  # a subprocess of the CLI or of a real process: the engine tier
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the mmap threshold is glibc's (this host's libc: "
                    f"{platform.libc_ver()[0] or 'unknown'})")
@pytest.mark.parametrize(("overrides", "expected"), [([], "[True, False]"),
                                                      (["memory_mmap_threshold=4194304"], "[True, True]")])
def test_the_ranks_allocator_keeps_or_maps_a_freed_block_as_the_setting_says(
        monkeypatch: pytest.MonkeyPatch, overrides: list[str], expected: str) -> None:
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    env = launcher.rank_env(spec_from_config(compose(overrides)))
    out = subprocess.run([sys.executable, "-S", "-c", GLIBC_PROBE], env=env, capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.strip() == expected
