"""Environment fingerprint stored in every record: library versions, code version, hardware, threads."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# every library a run may import, so a record says which version of each it ran with (None: not installed)
LIBRARIES = ("torch", "deepspeed", "transformers", "peft", "accelerate", "colossalai", "hydra-core", "numpy", "trl",
             "datasets", "tokenizers", "torchao", "bitsandbytes", "galore-torch", "einops")
REPO = Path(__file__).resolve().parents[2]
# glibc's malloc reads its fixed mmap threshold from this variable (the run's memory_mmap_threshold sets it)
MMAP_THRESHOLD_VARIABLE = "MALLOC_MMAP_THRESHOLD_"
# what else sets how the host allocator keeps freed memory, and so the host peaks: glibc's other MALLOC_*
# variables, its tunables, and an allocator preloaded in its place (jemalloc, tcmalloc)
ALLOCATOR_VARIABLES = ("GLIBC_TUNABLES", "LD_PRELOAD")


def allocator_settings(env: Mapping[str, str]) -> dict[str, str]:
    """The allocator settings a rank ran under, by variable ({} for glibc's defaults)."""
    return {name: value for name, value in sorted(env.items())
            if name in ALLOCATOR_VARIABLES or name.startswith("MALLOC_")}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10,
                          check=True).stdout


DIFF_CHUNK = 1 << 20


def _diff_sha256(repo: Path, timeout_s: float = 10.0) -> str | None:
    """SHA-256 of `git diff HEAD`'s bytes, None for no difference. Read in 1 MiB chunks: rank 0 collects this
    before it measures anything, and a tree whose diff is tens of MB (records deleted, say) once left that
    much fragmented heap in rank 0 and over-stated its every later phase (+168 MiB at glm-base SFT init)."""
    digest, seen = hashlib.sha256(), False
    with subprocess.Popen(["git", "-C", str(repo), "diff", "HEAD", "--no-color", "--no-ext-diff"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as proc:
        assert proc.stdout is not None
        while chunk := proc.stdout.read(DIFF_CHUNK):
            digest.update(chunk)
            seen = True
        if proc.wait(timeout=timeout_s):
            raise subprocess.CalledProcessError(proc.returncode, "git diff HEAD")
    return digest.hexdigest() if seen else None


def git_state(repo: Path = REPO) -> dict[str, Any] | None:
    """The commit the code ran at, whether tracked files differed from it, and a hash of that difference (the
    bytes of `git diff HEAD`), so that two dirty runs can be told apart; None outside a git checkout."""
    try:
        commit = _git(repo, "rev-parse", "HEAD").strip()
        diff_sha256 = _diff_sha256(repo)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": diff_sha256 is not None, "diff_sha256": diff_sha256}


def git_commit(state: dict[str, Any] | None) -> str | None:
    """The short form older records carry: the commit, with "-dirty" where the tree differed from it."""
    return None if state is None else state["commit"] + ("-dirty" if state["dirty"] else "")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


CPUINFO = "/proc/cpuinfo"


def cpu_flags(cpuinfo: str = CPUINFO) -> set[str]:
    """The first CPU's flags in `cpuinfo` (empty where it cannot be read)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# Native 16-bit and int8 matrix instructions: without them torch's half-precision matrix products on the CPU
# take a slow path (fp16: 75x fp32's time at glm-base's shapes on an AVX512 Xeon without avx512_fp16 or amx_fp16;
# bf16: 15-19x fp32's step time on an AVX2-only EPYC; bench.measure.native_half), so two hosts of one model
# name but different flags do not time fp16 (or bf16, int8) alike
MATRIX_FLAGS = ("avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "amx_int8")


def matrix_isa() -> list[str]:
    """The native low-precision matrix instructions this CPU reports, of MATRIX_FLAGS."""
    flags = cpu_flags()
    return [flag for flag in MATRIX_FLAGS if flag in flags]


def host() -> dict[str, Any]:
    """What tells one host type from another: CPU model, cores, memory, virtualisation, kernel, native matrix
    instructions; `type` joins CPU, cores, memory and those instructions, the key a report groups hosts by."""
    cpu, cores = _cpu_model(), os.cpu_count()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    isa = matrix_isa()
    return {"cpu": cpu, "cores": cores, "memory_bytes": memory, "virtual_machine": "hypervisor" in cpu_flags(),
            "kernel": platform.release(), "matrix_isa": isa,
            "type": f"{cpu} x {cores}, {memory / 2**30:.0f} GiB, {'+'.join(isa) or 'no native 16-bit matrix ISA'}"}


def provenance() -> dict[str, Any]:
    """What every record carries, a run or a cell refused before launch alike: the code (commit, dirty state),
    the libraries, the host (its type and native matrix instructions). Imports no torch."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "libraries": {name: _version(name) for name in LIBRARIES},
        "git_commit": git_commit(git := git_state()),
        "git": git,
        "host": host(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "host_memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
    }


def environment(device_type: str, world_size: int) -> dict[str, Any]:
    """Collected by rank 0 of each run (it knows the device and the rank count): the provenance, the device."""
    import torch

    gpu = None
    if device_type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {"name": props.name, "memory_bytes": props.total_memory, "count": torch.cuda.device_count(),
               "cuda": torch.version.cuda, "arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST"),
               # what the user had set where the launcher made it readable to DeepSpeed (launcher.deepspeed_arch_list)
               "arch_list_given": os.environ.get("RLHF_BENCH_ARCH_LIST_GIVEN")}
    return {
        **provenance(),
        "gpu": gpu,
        "device": device_type,
        "world_size": world_size,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "allocator": allocator_settings(os.environ),
        "torch_threads": torch.get_num_threads(),
    }
