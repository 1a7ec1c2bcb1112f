"""What a record says about where its code came from and the host it ran on: a clean and a dirty checkout made
here with git, the diff's hash computed a second way, and the host's figures read from /proc and os."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.measure.environment import LIBRARIES, MATRIX_FLAGS, environment, git_commit, git_state, host
from bench.measure.native_half import emulated_half


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def test_a_clean_and_a_dirty_checkout_are_told_apart_by_commit_and_diff_hash(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = _git(repo, "rev-parse", "HEAD").strip()
    assert git_state(repo) == {"commit": head, "dirty": False, "diff_sha256": None}
    (repo / "a.py").write_text("x = 2\n")
    (repo / "untracked.txt").write_text("not code the run imported\n")
    diff = subprocess.run(["git", "-C", str(repo), "diff", "HEAD"], check=True, capture_output=True).stdout
    state = git_state(repo)
    assert state == {"commit": head, "dirty": True, "diff_sha256": hashlib.sha256(diff).hexdigest()}
    assert git_commit(state) == f"{head}-dirty" and git_commit(None) is None
    (repo / "a.py").write_text("x = 3\n")
    assert git_state(repo)["diff_sha256"] != state["diff_sha256"]  # another change, another hash
    assert git_state(tmp_path / "not-a-repo") is None


def test_a_large_diff_is_hashed_without_holding_it_in_memory(tmp_path):
    """A 45 MB diff: its hash equals hashlib's over the bytes `git diff HEAD` prints (read a second way), and
    the process hashing it peaks within 16 MiB of where it started (the kernel's high-water mark, reset first),
    where holding the diff whole, as text and bytes, took three times its size."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    lines = "".join(f"line {i:08d} {'x' * 40}\n" for i in range(800_000))  # 44 MB
    (repo / "big.txt").write_text(lines)
    _git(repo, "add", "big.txt")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    (repo / "big.txt").unlink()  # the whole file, deleted: a 45 MB diff
    diff = subprocess.run(["git", "-C", str(repo), "diff", "HEAD"], check=True, capture_output=True).stdout
    assert len(diff) > 40e6
    probe = ("import json, sys\n"
             "from pathlib import Path\n"
             "from bench.measure.environment import git_state\n"
             "def kib(key):\n"
             "    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(key))\n"
             "open('/proc/self/clear_refs', 'w').write('5')\n"
             "before = kib('VmRSS')\n"
             "state = git_state(Path(sys.argv[1]))\n"
             "print(json.dumps({'state': state, 'growth_kib': kib('VmHWM') - before}))\n")
    done = subprocess.run([sys.executable, "-c", probe, str(repo)], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[1])
    out = json.loads(done.stdout)
    assert out["state"]["diff_sha256"] == hashlib.sha256(diff).hexdigest() and out["state"]["dirty"] is True
    assert out["growth_kib"] < 16 * 1024, out


def test_the_host_and_every_library_a_run_may_import_are_recorded():
    with open("/proc/meminfo") as f:  # MemTotal in kB: the same memory, read another way
        mem_total = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    found = host()
    assert found["cores"] == os.cpu_count()
    assert abs(found["memory_bytes"] - mem_total) < 0.02 * mem_total
    assert found["type"].startswith(found["cpu"]) and f"x {found['cores']}," in found["type"]
    # the native matrix instructions, read a second way (lscpu's Flags line), are in the record and the host type
    listed = next(line for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True)
                  .stdout.splitlines() if line.startswith("Flags:")).split()[1:]
    assert found["matrix_isa"] == [f for f in MATRIX_FLAGS if f in listed]
    assert found["type"].endswith("+".join(found["matrix_isa"]) or "no native 16-bit matrix ISA")
    env = environment("cpu", 1)
    assert {"trl", "datasets", "peft", "bitsandbytes", "torchao", "deepspeed", "colossalai"} <= set(LIBRARIES)
    assert env["libraries"]["trl"] == "0.19.1" and env["libraries"]["deepspeed"] == "0.19.8"
    assert env["host"] == found and env["git"]["commit"] == env["git_commit"].removesuffix("-dirty")


@pytest.mark.parametrize("precision, native_flags, opening", [
    ("fp16", {"avx512_fp16", "amx_fp16"}, "fp16 on a CPU without avx512_fp16 or amx_fp16"),
    ("bf16", {"avx512_bf16", "amx_bf16"}, "bf16 on a CPU without avx512_bf16 or amx_bf16")])
def test_a_half_precision_run_on_a_cpu_without_its_instructions_says_its_times_are_an_emulation(
        precision, native_flags, opening):
    listed = next(line for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True)
                  .stdout.splitlines() if line.startswith("Flags:")).split()[1:]
    note = emulated_half(precision, "cpu")
    assert (note is None) == bool(native_flags & set(listed)), note
    if note is not None:
        assert note.startswith(opening), note
    assert emulated_half("fp32", "cpu") is None and emulated_half(precision, "cuda") is None


def test_a_host_type_says_when_its_matrix_instructions_were_not_recorded():
    from bench.results.provenance import of

    named = {"environment": {"host": {"type": "cpu A x 2, 24 GiB, amx_bf16", "matrix_isa": ["amx_bf16"]}}}
    older = {"environment": {"host": {"type": "cpu A x 2, 24 GiB"}}}
    kernel = {"environment": {"host": {"type": "cpu A x 2, 24 GiB", "kernel": "6.1-a"}}}
    oldest = {"environment": {"cpu": "cpu A", "cpu_count": 2, "host_memory_bytes": 24 * 2**30}}
    assert of(named).host_type == "cpu A x 2, 24 GiB, amx_bf16"
    assert of(older).host_type == "cpu A x 2, 24 GiB, matrix ISA not recorded"
    assert of(kernel).host_type == "cpu A x 2, 24 GiB, matrix ISA not recorded, kernel 6.1-a"
    assert of(oldest).host_type == "cpu A x 2, 24 GiB, matrix ISA not recorded"
    assert of({"environment": {}}).host_type is None


def test_the_allocator_settings_a_rank_ran_under_are_recorded(monkeypatch):
    for name in [n for n in os.environ if n.startswith("MALLOC_") or n in ("GLIBC_TUNABLES", "LD_PRELOAD")]:
        monkeypatch.delenv(name)
    assert environment("cpu", 1)["allocator"] == {}  # glibc's defaults
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4194304")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")  # glibc reads this one without the trailing underscore
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")
    monkeypatch.setenv("MALLOCATOR", "not glibc's")
    assert environment("cpu", 1)["allocator"] == {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0",
                                                  "MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "4194304"}


@pytest.mark.parametrize("flags, native", [
    ("fpu sse2 avx2 avx512f amx_bf16 amx_tile", True), ("avx2 avx512_bf16", True),
    ("fpu sse2 avx2 avx512f avx512_bf16x amx_tile", False),  # a whole flag, not a prefix
    ("fpu sse2 avx2", False)])
def test_the_curated_scripts_host_check_reads_the_runs_own_instruction_list(tmp_path, capsys, flags, native):
    from bench.measure.native_half import main

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert main(["bf16", "--cpuinfo", str(cpuinfo)]) == (0 if native else 1)
    assert ("bf16 on a CPU without avx512_bf16 or amx_bf16" in capsys.readouterr().err) is not native
