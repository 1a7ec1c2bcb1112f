"""The provenance guarantees of the scripts whose runs become curated evidence (scripts/glm_sweep.sh and
scripts/cpu_rung.sh, through scripts/curated_tree.sh), on a clone of this repository: a dirty checkout is
refused, the runs come from a clean worktree of the named commit whose ignored results/ folders are the
checkout's own, and a sweep resumed on another host type is refused. An unknown glm_sweep.sh block stops the
script right after that set-up, before any run; cpu_rung.sh is checked through its refusals, which come
before its first run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    if not (REPO / ".git").exists():
        pytest.skip("needs the repository's git history (a git checkout)")
    target = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(target)], check=True)
    return target


def _cpuinfo(clone: Path, flags: str) -> str:
    """A made-up /proc/cpuinfo with these flags, for the scripts' bf16 check (CPUINFO)."""
    path = clone.parent / f"cpuinfo-{abs(hash(flags))}"
    path.write_text(f"processor\t: 0\nmodel name\t: Imaginary CPU\nflags\t\t: {flags}\n")
    return str(path)


def _sweep(clone: Path, script: str = "glm_sweep", *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The script run in the clone; its bf16 check reads a CPU with AMX-BF16 unless CPUINFO names another."""
    # a clone has no virtual environment: the scripts' Python (their bf16 check's) is this one
    env = {"CPUINFO": _cpuinfo(clone, "fpu sse2 avx2 avx512f amx_bf16 amx_tile"), "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", f"scripts/{script}.sh", *args], cwd=clone, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "BLOCKS": "none", **env})


@pytest.mark.parametrize("script, args", [("glm_sweep", ()), ("cpu_rung", ("llama-base",)),
                                          ("cpu_rung", ("glm-base",))])
def test_a_checkout_with_uncommitted_changes_is_refused(clone: Path, script: str, args: tuple[str, ...]) -> None:
    with open(clone / "README.md", "a") as f:
        f.write("an uncommitted line\n")
    done = _sweep(clone, script, *args)
    assert done.returncode == 2 and "uncommitted changes" in done.stderr, done.stderr
    assert not (clone / "results" / "worktrees").exists()


def test_the_runs_come_from_a_clean_worktree_of_the_named_commit(clone: Path) -> None:
    commit = _git(clone, "rev-parse", "HEAD")  # named: the checkout may then differ from it
    with open(clone / "README.md", "a") as f:
        f.write("an uncommitted line: the checkout may change while a named commit's sweep runs\n")
    done = _sweep(clone, COMMIT=commit)
    assert done.returncode == 2 and "unknown block none" in done.stderr, done.stderr  # stopped after the set-up
    tree = clone / "results" / "worktrees" / commit[:12]
    assert _git(tree, "rev-parse", "HEAD") == commit
    assert _git(tree, "status", "--porcelain") == ""  # what every record's environment.git will read: clean
    for sub in ("sweeps", "perf"):
        assert os.path.realpath(tree / "results" / sub) == str((clone / "results" / sub).resolve())
    # prerequisite models trained at another commit are never reused: the cache is the commit's own
    assert os.path.realpath(tree / "results" / "cache") == str((clone / "results" / "cache" / commit[:12]).resolve())


def _host_lines(clone: Path, commit: str, sweep: str = "") -> list[str]:
    return (clone / "results" / "pending" / f"host-{sweep}{commit[:12]}.log").read_text().splitlines()


def test_a_sweep_resumed_on_another_host_is_refused_unless_told(clone: Path) -> None:
    """The log's first line names the host the sweep began on; this host's fingerprint is read off /proc/cpuinfo
    (here by a second reader, Python), so a made-up first host must be refused and NEW_HOST=ok must be logged."""
    commit = _git(clone, "rev-parse", "HEAD")
    log = clone / "results" / "pending" / f"host-{commit[:12]}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("2026-01-01T00:00Z\tblocks: A2 (12 runs added)\thost: Imaginary CPU x 64, amx_fp16\tkernel: 1\n")
    refused = _sweep(clone, COMMIT=commit)
    assert refused.returncode == 2 and "is not the one the sweep" in refused.stderr, refused.stderr
    assert "Imaginary CPU x 64" in refused.stderr and len(_host_lines(clone, commit)) == 1  # nothing logged
    told = _sweep(clone, COMMIT=commit, NEW_HOST="ok")
    assert "unknown block none" in told.stderr, told.stderr  # past the check, stopped after the set-up
    second = _host_lines(clone, commit)[1].split("\t")
    with open("/proc/cpuinfo") as f:
        info = f.read()
    model_name = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
    assert second[1] == "blocks: none (0 runs added)"
    assert second[2].startswith(f"host: {model_name} (family ") and f"x {os.cpu_count()}, " in second[2]
    flags = next(line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags"))
    isa = [f for f in ("avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "amx_int8") if f in flags]
    assert second[2].endswith("+".join(isa) or "no native 16-bit matrix ISA")


def test_a_sweep_on_the_host_it_began_on_goes_on(clone: Path) -> None:
    commit = _git(clone, "rev-parse", "HEAD")
    assert "unknown block none" in _sweep(clone, COMMIT=commit).stderr  # the first session: its host is logged
    again = _sweep(clone, COMMIT=commit)
    assert "unknown block none" in again.stderr and "is not the one" not in again.stderr
    first, second = (line.split("\t")[2] for line in _host_lines(clone, commit))
    assert first == second


@pytest.mark.parametrize("model, rung, precision", [("llama-base", "llama-base", ()),
                                                    ("glm-base", "glm-base-rung", ()),
                                                    ("llama-base", "llama-base-fp32", ("fp32",))])
def test_a_rung_runs_from_a_clean_worktree_and_refuses_another_host(clone: Path, model: str, rung: str,
                                                                     precision: tuple[str, ...]) -> None:
    """Its own log (host-<rung>-<commit>.log; glm-base's rung keeps apart from the glm-base sweep's
    host-<commit>.log, an fp32 rung from the bf16 one), checked in the worktree of the named commit: a made-up
    first host is refused there, before the rung's first run, and nothing is logged."""
    commit = _git(clone, "rev-parse", "HEAD")
    log = clone / "results" / "pending" / f"host-{rung}-{commit[:12]}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"2026-01-01T00:00Z\trung: {model} (3 runs added)\thost: Imaginary CPU x 64, amx_fp16\t"
                   "kernel: 1\n")
    with open(clone / "README.md", "a") as f:
        f.write("an uncommitted line: the checkout may change while a named commit's rung runs\n")
    refused = _sweep(clone, "cpu_rung", model, *precision, COMMIT=commit)
    assert refused.returncode == 2 and "is not the one the sweep" in refused.stderr, refused.stderr
    assert "Imaginary CPU x 64" in refused.stderr and len(_host_lines(clone, commit, f"{rung}-")) == 1
    tree = clone / "results" / "worktrees" / commit[:12]
    assert _git(tree, "rev-parse", "HEAD") == commit and _git(tree, "status", "--porcelain") == ""
    assert not (clone / "results" / "sweeps" / f"{rung}-{commit[:12]}").exists()  # no run began


@pytest.mark.parametrize("args, message", [
    ((), "cpu_rung.sh: name the rung's model: llama-base or glm-base"),
    (("glm-large",), "cpu_rung.sh: unknown argument glm-large; allowed: llama-base or glm-base (the rung's model), "
                     "bf16 (the default) or fp32"),
    (("glm-base", "fp16"), "cpu_rung.sh: unknown argument fp16; allowed: llama-base or glm-base"),
    (("glm-base", "llama-base"), "cpu_rung.sh: one model, not glm-base and llama-base"),
    (("llama-base", "bf16", "fp32"), "cpu_rung.sh: one precision, not bf16 and fp32")])
def test_a_rung_takes_one_of_the_two_rung_models(clone: Path, args: tuple[str, ...], message: str) -> None:
    done = _sweep(clone, "cpu_rung", *args)
    assert done.returncode == 2 and done.stderr.startswith(message), done.stderr
    assert not (clone / "results" / "worktrees").exists()


@pytest.mark.parametrize("script, args, log", [("glm_sweep", (), "host-"),
                                               ("cpu_rung", ("glm-base",), "host-glm-base-rung-")])
def test_a_cpu_without_native_bf16_is_refused_unless_told(clone: Path, script: str, args: tuple[str, ...],
                                                          log: str) -> None:
    """The bf16 check comes before the host check: with a made-up first host in the log, a CPU the check lets
    through stops at the host check, so nothing runs. avx512_bf16 is a whole flag (avx512_bf16x is not it)."""
    commit = _git(clone, "rev-parse", "HEAD")
    host_log = clone / "results" / "pending" / f"{log}{commit[:12]}.log"
    host_log.parent.mkdir(parents=True, exist_ok=True)
    host_log.write_text("2026-01-01T00:00Z\tblocks: A2 (1 runs added)\thost: Imaginary CPU x 64, amx_bf16\t"
                        "kernel: 1\n")
    slow = _cpuinfo(clone, "fpu sse2 avx2 avx512f avx512_bf16x amx_tile")
    refused = _sweep(clone, script, *args, COMMIT=commit, CPUINFO=slow)
    assert refused.returncode == 2 and "bf16 on a CPU without avx512_bf16 or amx_bf16" in refused.stderr, \
        refused.stderr
    assert "SLOW_BF16=ok" in refused.stderr and "is not the one the sweep" not in refused.stderr
    for cpuinfo, extra in ((slow, {"SLOW_BF16": "ok"}), (_cpuinfo(clone, "avx2 avx512_bf16"), {})):
        passed = _sweep(clone, script, *args, COMMIT=commit, CPUINFO=cpuinfo, **extra)
        assert passed.returncode == 2 and "is not the one the sweep" in passed.stderr, passed.stderr
        assert "without avx512_bf16" not in passed.stderr
    assert len(host_log.read_text().splitlines()) == 1  # no session ran


def test_an_fp32_rung_runs_on_a_cpu_without_native_bf16(clone: Path) -> None:
    """fp32 is native on every CPU: on a made-up AVX2-only CPU the fp32 rung passes the bf16 check (and stops at
    the host check, a made-up first host in its log) where the bf16 rung of the same model is refused by it."""
    commit = _git(clone, "rev-parse", "HEAD")
    for rung in ("llama-base", "llama-base-fp32"):
        log = clone / "results" / "pending" / f"host-{rung}-{commit[:12]}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("2026-01-01T00:00Z\trung: llama-base (1 runs added)\thost: Imaginary CPU x 64, amx_bf16\t"
                       "kernel: 1\n")
    avx2 = _cpuinfo(clone, "fpu sse2 avx2 fma")
    bf16 = _sweep(clone, "cpu_rung", "llama-base", COMMIT=commit, CPUINFO=avx2)
    assert bf16.returncode == 2 and "bf16 on a CPU without avx512_bf16 or amx_bf16" in bf16.stderr, bf16.stderr
    fp32 = _sweep(clone, "cpu_rung", "llama-base", "fp32", COMMIT=commit, CPUINFO=avx2)
    assert fp32.returncode == 2 and "is not the one the sweep" in fp32.stderr, fp32.stderr
    assert "without avx512_bf16" not in fp32.stderr
