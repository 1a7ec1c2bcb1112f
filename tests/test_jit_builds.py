"""JIT builds (bench.run.jit_builds): the one folder every process uses, and a build killed midway, whose lock
torch would wait on forever. The builds are real: torch's own loader compiling a tiny C++ op (tests/jit_child.py)
with the system's compiler, behind a wrapper that makes the compile step last as long as a test needs."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bench.run import jit_builds, launcher
from bench.run.config import compose
from bench.run.spec import spec_from_config
from bench.run.watchdog import TIMER_FIRED
from tests.processes import run_tree

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "tests" / "jit_child.py"
SOURCE = 'extern "C" int answer() { return 42; }\n'
OLD_S = 60.0  # an age past RECORD_GRACE_S: a lock this old with no record is not a builder that has just made it


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "tiny.cpp").write_text(SOURCE)
    return tmp_path


def _env(folder: Path, compile_s: float = 0.0) -> dict[str, str]:
    """The child's environment: its own JIT folder, and a compiler whose compile step first sleeps compile_s."""
    wrapper = folder / "slow-g++"  # torch accepts a compiler whose path names g++
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" -c "*) sleep {compile_s:g};; esac\nexec g++ "$@"\n')
    wrapper.chmod(0o755)
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(folder / "ext"), "CXX": str(wrapper)}


def _start(folder: Path, *args: str, compile_s: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(CHILD), str(folder / "tiny.cpp"), *args], env=_env(folder, compile_s),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _lock(folder: Path) -> Path:
    return folder / "ext" / "tiny_op" / "lock"


def _wait_for_the_build(folder: Path, proc: subprocess.Popen) -> None:
    """Until the child holds the lock and ninja has started the compile (its build file is written)."""
    deadline = time.monotonic() + 120
    while not (_lock(folder).exists() and (folder / "ext" / "tiny_op" / "build.ninja").exists()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the child never started its build"
        time.sleep(0.1)
    time.sleep(0.5)


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL to the child's group (it and ninja): a build killed midway. ninja starts each compile in a process
    group of its own, so the compiler outlives a killed build, as it does after a Ctrl-C; the test ends it too."""
    compilers = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)
    for child in compilers:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    proc.communicate()


def _old(path: Path) -> None:
    os.utime(path, (time.time() - OLD_S, time.time() - OLD_S))


@pytest.mark.engine  # a subprocess of the CLI or of a real process: the engine tier
@pytest.mark.parametrize("killed", ["guarded", "unguarded"])
def test_a_run_after_a_build_killed_midway_removes_its_lock_names_it_and_builds(folder, killed):
    # guarded: the killed builder recorded itself in the lock; unguarded: torch outside this project left an
    # empty lock (the CI failure: a diagnostic script's FusedAdam build killed by a test's timeout)
    first = _start(folder, *(["--unguarded"] if killed == "unguarded" else []), compile_s=600)
    _wait_for_the_build(folder, first)
    _kill(first)
    assert _lock(folder).exists()  # what torch left: without the guard every later load sleeps on it
    done = run_tree([sys.executable, str(CHILD), str(folder / "tiny.cpp")], timeout=120, env=_env(folder),
                    text=True)
    assert "answer=42" in done.stdout
    assert f"removed the stale JIT build lock {_lock(folder)}" in done.stderr
    assert ("its builder, pid" if killed == "guarded" else "names no builder and no process holds it") in done.stderr
    assert not _lock(folder).exists()


@pytest.mark.engine  # a subprocess of the CLI or of a real process: the engine tier
def test_a_run_waits_for_a_live_build_and_says_for_whom(folder):
    first = _start(folder, compile_s=15)  # past the second child's imports (about 5 s)
    _wait_for_the_build(folder, first)
    second = run_tree([sys.executable, str(CHILD), str(folder / "tiny.cpp"), "--stall-s", "60", "--stall-file",
                       str(folder / "stall.txt")], timeout=120, env=_env(folder), text=True)
    out, _ = first.communicate(timeout=120)
    assert "answer=42" in out and "answer=42" in second.stdout
    assert "removed" not in second.stderr  # the live build was waited on, not taken over
    waited = (folder / "stall.txt").read_text().splitlines()[0]
    assert f"waiting for the JIT build lock {_lock(folder)} (its builder, pid {first.pid} on" in waited


@pytest.mark.engine  # a subprocess of the CLI or of a real process: the engine tier
def test_a_wait_that_never_ends_fires_the_watchdog_with_the_lock_named(folder):
    first = _start(folder, compile_s=600)
    _wait_for_the_build(folder, first)
    try:
        second = subprocess.run([sys.executable, str(CHILD), str(folder / "tiny.cpp"), "--stall-s", "5",
                                 "--stall-file", str(folder / "stall.txt")], env=_env(folder), capture_output=True,
                                text=True, timeout=120)
    finally:
        _kill(first)
    assert second.returncode == 1  # faulthandler's exit when the watchdog fires
    report = (folder / "stall.txt").read_text()
    assert TIMER_FIRED in report
    assert f"no progress for launcher.stall_s=5 s since waiting for the JIT build lock {_lock(folder)}" in report
    assert "in wait" in report  # the stack shows where: the guarded wait of torch's lock


@pytest.mark.engine  # a subprocess of the CLI or of a real process: the engine tier
def test_a_lock_is_judged_by_its_builder_s_record(tmp_path):
    lock = tmp_path / "lock"
    me = psutil.Process()
    host = socket.gethostname()
    lock.write_text(f"pid={me.pid} host={host} started={me.create_time():.3f}\n")
    assert jit_builds.judge(str(lock)).state == "held"
    # the same pid with another start time: the pid was reused, the builder is gone
    lock.write_text(f"pid={me.pid} host={host} started={me.create_time() - 100:.3f}\n")
    assert jit_builds.judge(str(lock)) == jit_builds.Verdict("stale", f"its builder, pid {me.pid} on {host}, is gone")
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    lock.write_text(f"pid={ended.pid} host={host} started=0\n")
    assert jit_builds.judge(str(lock)).state == "stale"
    lock.write_text(f"pid={ended.pid} host=elsewhere-{host} started=0\n")
    assert jit_builds.judge(str(lock)) == jit_builds.Verdict(
        "held", f"its builder, pid {ended.pid} on elsewhere-{host}, another host: not checked from here")
    lock.unlink()
    assert jit_builds.judge(str(lock)).state == "released"


@pytest.mark.engine  # a subprocess of the CLI or of a real process: the engine tier
def test_a_lock_without_a_record_is_judged_by_who_holds_it_open(tmp_path, monkeypatch):
    lock = tmp_path / "lock"
    lock.write_text("")
    assert jit_builds.judge(str(lock)).state == "held"  # a builder between creating it and writing its record
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({str(lock)!r}); print('open', flush=True); "
                                                     "import time; time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "open\n"
        _old(lock)
        assert jit_builds.judge(str(lock)) == jit_builds.Verdict(
            "held", f"pid {holder.pid} on this host holds it open (a build outside rlhf-bench)")
    finally:
        holder.kill()
        holder.wait()
    assert jit_builds.judge(str(lock)).state == "stale"
    # on a filesystem that other machines share, nobody here holding it proves nothing: the load stops at once
    monkeypatch.setattr(jit_builds, "filesystem_type", lambda path: "nfs4")
    verdict = jit_builds.judge(str(lock))
    assert verdict.state == "unknown" and "nfs4" in verdict.why
    refusal = jit_builds.refusal(str(lock), verdict.why)
    assert refusal.endswith(f"rm {lock}")


def test_the_filesystem_of_a_path_is_read_from_the_mount_table():
    # the oracle: the kernel's mount table read directly, the longest mount point above the path
    with open("/proc/self/mounts") as f:
        mounts = [line.split()[1:3] for line in f]
    here = os.path.realpath(__file__)
    point, kind = max(((p, k) for p, k in mounts if (here + "/").startswith(p.rstrip("/") + "/")),
                      key=lambda m: len(m[0]))
    assert jit_builds.filesystem_type(__file__) == kind


def test_every_process_a_test_starts_uses_the_folder_the_launcher_gives_its_ranks():
    # tests/conftest.py points pytest's own process at it, and so every subprocess a test starts
    ranks = launcher.rank_env(spec_from_config(compose([])))
    assert os.environ.get("TORCH_EXTENSIONS_DIR") == ranks.get("TORCH_EXTENSIONS_DIR")
    env: dict[str, str] = {"TORCH_EXTENSIONS_DIR": "/chosen"}
    jit_builds.use_cache_dir(env)  # a folder the user chose is kept
    assert env == {"TORCH_EXTENSIONS_DIR": "/chosen"}


@pytest.mark.engine  # a subprocess of the CLI or of a real process: the engine tier
def test_set_up_s_op_builder_refuses_an_op_it_does_not_know_and_names_those_it_does():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "build_ops.py"), "fused_adamw"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == ("build_ops: unknown op(s) fused_adamw; the ops are deepspeed_shm_comm, fused_adam, "
                                   "cpu_adam, colossalai_cpu_adam")
