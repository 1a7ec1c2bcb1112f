"""The provenance guarantees of the scripts whose runs become curated evidence (scripts/glm_sweep.sh and
scripts/llama_rung.sh, through scripts/curated_tree.sh), on a clone of this repository: a dirty checkout is
refused, the runs come from a clean worktree of the named commit whose ignored results/ folders are the
checkout's own, and a sweep resumed on another host type is refused. An unknown glm_sweep.sh block stops the
script right after that set-up, before any run; llama_rung.sh is checked through its refusals, which come
before its first run."""

from __future__ import annotations

import os
import subprocess
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


def _sweep(clone: Path, script: str = "glm_sweep", **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", f"scripts/{script}.sh"], cwd=clone, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "BLOCKS": "none", **env})


@pytest.mark.parametrize("script", ["glm_sweep", "llama_rung"])
def test_a_checkout_with_uncommitted_changes_is_refused(clone: Path, script: str) -> None:
    with open(clone / "README.md", "a") as f:
        f.write("an uncommitted line\n")
    done = _sweep(clone, script)
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


def test_the_llama_rung_runs_from_a_clean_worktree_and_refuses_another_host(clone: Path) -> None:
    """Its own log (host-llama-base-<commit>.log), checked in the worktree of the named commit: a made-up first
    host is refused there, before the rung's first run, and nothing is logged."""
    commit = _git(clone, "rev-parse", "HEAD")
    log = clone / "results" / "pending" / f"host-llama-base-{commit[:12]}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("2026-01-01T00:00Z\trung: llama-base (3 runs added)\thost: Imaginary CPU x 64, amx_fp16\t"
                   "kernel: 1\n")
    with open(clone / "README.md", "a") as f:
        f.write("an uncommitted line: the checkout may change while a named commit's rung runs\n")
    refused = _sweep(clone, "llama_rung", COMMIT=commit)
    assert refused.returncode == 2 and "is not the one the sweep" in refused.stderr, refused.stderr
    assert "Imaginary CPU x 64" in refused.stderr and len(_host_lines(clone, commit, "llama-base-")) == 1
    tree = clone / "results" / "worktrees" / commit[:12]
    assert _git(tree, "rev-parse", "HEAD") == commit and _git(tree, "status", "--porcelain") == ""
    assert not (clone / "results" / "sweeps" / f"llama-base-{commit[:12]}").exists()  # no run began
