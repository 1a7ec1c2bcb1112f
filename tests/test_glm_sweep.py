"""scripts/glm_sweep.sh's provenance guarantees, on a clone of this repository: a dirty checkout is refused, and
the runs come from a clean worktree of the named commit whose ignored results/ folders are the checkout's own.
An unknown block stops the script right after that set-up, before any run."""

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


def _sweep(clone: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "scripts/glm_sweep.sh"], cwd=clone, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "BLOCKS": "none", **env})


def test_a_checkout_with_uncommitted_changes_is_refused(clone: Path) -> None:
    with open(clone / "README.md", "a") as f:
        f.write("an uncommitted line\n")
    done = _sweep(clone)
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
    for sub in ("sweeps", "cache", "perf"):
        assert os.path.realpath(tree / "results" / sub) == str((clone / "results" / sub).resolve())
