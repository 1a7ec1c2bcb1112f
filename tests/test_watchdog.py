"""No run hangs silently and none outlives what started it (bench.run.watchdog, bench.run.launcher).

Unit tier: the watchdog in a process of its own (its timer ends the process). Engine tier: real two-rank runs
whose rank is frozen, or whose launcher or torchrun is killed, checked for their end, their logs and what they
leave behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from bench.run.launcher import RANK_EXIT_S, TORCHRUN_CLOSE_S, stall_failure
from bench.run.watchdog import Stall, stalls
from tests.processes import TreeFailed, processes_mentioning, run_tree

REPO = Path(__file__).resolve().parents[1]


def _script(tmp_path: Path, body: str, timeout: float = 60) -> subprocess.CompletedProcess:
    code = textwrap.dedent("""
        import os, signal, sys, threading, time
        from bench.run import watchdog
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, STALL_DIR=str(tmp_path)))


def test_a_rank_that_shows_no_progress_ends_with_every_threads_stack(tmp_path):
    started = time.monotonic()
    done = _script(tmp_path, """
        dog = watchdog.RankWatchdog(watchdog.stall_path(os.environ["STALL_DIR"], 3), 3, 1.0)
        dog.beat("phase 'training' of step 7 began")
        def helper_thread_waits():
            threading.Event().wait()
        threading.Thread(target=helper_thread_waits, daemon=True).start()
        def main_thread_stuck_here():
            threading.Event().wait()
        main_thread_stuck_here()
    """)
    assert done.returncode == 1  # faulthandler's exit
    assert time.monotonic() - started < 20
    (stall,) = stalls(str(tmp_path))
    assert stall.rank == 3
    assert stall.reason.startswith("rank 3 (pid ")
    assert "no progress for launcher.stall_s=1 s since phase 'training' of step 7 began" in stall.reason
    assert "Timeout (0:00:01)!" in stall.text
    # both threads, each where it waits
    assert "main_thread_stuck_here" in stall.text and "helper_thread_waits" in stall.text


def test_beats_keep_a_rank_alive_and_a_file_with_only_its_header_is_no_stall(tmp_path):
    done = _script(tmp_path, """
        dog = watchdog.RankWatchdog(watchdog.stall_path(os.environ["STALL_DIR"], 0), 0, 1.0)
        for step in range(8):  # 2.4 s in all, 0.3 s between beats
            time.sleep(0.3)
            dog.beat(f"step {step}")
        print("alive")
    """)
    assert done.returncode == 0 and done.stdout.strip() == "alive", done.stderr
    assert stalls(str(tmp_path)) == []
    assert "since step 7" in (tmp_path / "stall-rank0.txt").read_text()


@pytest.mark.engine  # a subprocess of the CLI or of a real process: the engine tier
def test_an_orphaned_rank_that_ignores_sigterm_still_ends_within_its_grace(tmp_path):
    """The rank's parent dies: the kernel sends SIGTERM (PR_SET_PDEATHSIG), which this rank ignores as a rank
    blocked in a C call would; the lifeline ends it ORPHAN_GRACE_S later (2 s here) with its stacks."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
        print(child.pid, flush=True)
        time.sleep(600)
    """), textwrap.dedent("""
        import os, signal, threading
        from bench.run import watchdog
        watchdog.ORPHAN_GRACE_S = 2.0
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        dog = watchdog.RankWatchdog(watchdog.stall_path(os.environ["STALL_DIR"], 1), 1, 600.0)
        dog.watch_parent()
        def orphan_waits_here():
            threading.Event().wait()
        orphan_waits_here()
    """)], cwd=REPO, stdout=subprocess.PIPE, text=True, env=dict(os.environ, STALL_DIR=str(tmp_path)))
    child = psutil.Process(int(parent.stdout.readline()))
    time.sleep(3)  # the child is up, its watchdog armed for 600 s
    parent.kill()
    parent.wait()
    killed = time.monotonic()
    child.wait(timeout=30)
    assert time.monotonic() - killed < 10
    (stall,) = stalls(str(tmp_path))
    assert f"still running 2 s after its parent (pid {parent.pid}) ended" in stall.reason
    assert "orphan_waits_here" in stall.text


@pytest.mark.engine  # a subprocess of the CLI or of a real process: the engine tier
def test_a_process_a_test_starts_that_stalls_is_reported_with_its_last_progress_and_stacks():
    # a diagnostic script's rank started outside the launcher (scripts/diagnostics/diagnostic_rank.py): its stall
    # file goes to the folder run_tree gives it, and run_tree's failure carries the report
    code = textwrap.dedent("""
        import time
        from bench.run import watchdog
        dog = watchdog.RankWatchdog(watchdog.outside_stall_path("probe", 0), 0, 1.0)
        dog.beat("phase 'training' began")
        def stuck_in_training():
            time.sleep(60)
        stuck_in_training()
    """)
    with pytest.raises(TreeFailed) as failed:
        run_tree([sys.executable, "-c", code], timeout=60, cwd=REPO)
    assert not failed.value.timed_out and failed.value.returncode == 1
    assert "no progress for launcher.stall_s=1 s since phase 'training' began" in str(failed.value)
    assert "in stuck_in_training" in str(failed.value)


@pytest.mark.engine  # a subprocess of the CLI or of a real process: the engine tier
def test_a_process_a_test_starts_that_outlives_its_timeout_dumps_its_stacks_before_the_kill():
    code = textwrap.dedent("""
        import faulthandler, signal, sys, time
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
        print("ready", file=sys.stderr, flush=True)
        def waiting_forever():
            time.sleep(600)
        waiting_forever()
    """)
    started = time.monotonic()
    with pytest.raises(TreeFailed) as failed:
        run_tree([sys.executable, "-c", code], timeout=5, cwd=REPO)
    assert failed.value.timed_out and time.monotonic() - started < 30
    assert "still running after 5 s: killed" in str(failed.value)
    assert "in waiting_forever" in str(failed.value)


def test_a_stall_is_a_timeout_naming_the_ranks_and_the_log():
    failure = stall_failure([Stall(0, "rank 0 (pid 12): no progress for launcher.stall_s=15 s since phase "
                                      "'training' of step 3 began; deadline 10:00:15\nTimeout (0:00:15)!\n")],
                            "/runs/x/sft/worker.log")
    assert failure["status"] == "timeout" and failure["error"]["stalled_ranks"] == [0]
    assert failure["error"]["message"] == (
        "rank(s) [0] stalled: rank 0 (pid 12): no progress for launcher.stall_s=15 s since phase 'training' of "
        "step 3 began; deadline 10:00:15. Every thread's stack is in /runs/x/sft/worker.log")


def _start_run(root: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "bench.run", "framework=torch", "stage=sft", "steps=100000", "launcher.nproc=2",
           f"output_root={root}", "run_name=run", *overrides]
    with open(root / "bench.log", "w") as log:
        return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _ranks_after_a_step(root: Path, proc: subprocess.Popen) -> dict[int, psutil.Process]:
    """Waits for the run's first step; then its ranks by RANK."""
    feed = root / "runs" / "run" / "sft" / "progress.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if feed.exists() and '"event": "step"' in feed.read_text():
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"no step before the deadline: {(root / 'bench.log').read_text()[-2000:]}")
    ranks = {}
    for found in processes_mentioning(str(root)):
        with_env = found.environ()
        if "bench.run.worker" in found.cmdline() and "RANK" in with_env:
            ranks[int(with_env["RANK"])] = found
    assert sorted(ranks) == [0, 1]
    return ranks


def _torchrun(root: Path) -> psutil.Process:
    (found,) = [p for p in processes_mentioning(str(root)) if "torch.distributed.run" in p.cmdline()]
    return found


def _running(process: psutil.Process) -> bool:
    """Alive and not a zombie (an exited process its new parent has not reaped yet)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone(root: Path, within: float) -> list[psutil.Process]:
    deadline = time.monotonic() + within
    while (left := processes_mentioning(str(root))) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


# CI time: 52-56 s, 30 of them torchrun's grace before it SIGKILLs the frozen rank. CI checks the watchdog's
# firing and stack report in a real process above (a stuck main thread, 1 s) and the record a stall makes by hand
# (test_a_stall_is_a_timeout_naming_the_ranks_and_the_log); the frozen rank of a real run is the slow tier's
@pytest.mark.engine
@pytest.mark.slow
def test_a_frozen_rank_stalls_its_peer_whose_watchdog_ends_the_run_with_its_stacks_and_no_process_left(tmp_path):
    stall_s = 15
    proc = _start_run(tmp_path, f"launcher.stall_s={stall_s}")
    ranks = _ranks_after_a_step(tmp_path, proc)
    ranks[1].suspend()  # SIGSTOP: rank 1 freezes mid-step, as a rank on a hung device would; rank 0 waits on it
    frozen = time.monotonic()
    # rank 0's watchdog fires after stall_s; torchrun then stops the ranks (SIGKILL for the frozen one after its
    # 30 s); the launcher writes the record
    proc.wait(timeout=stall_s + TORCHRUN_CLOSE_S + 60)
    assert time.monotonic() - frozen < stall_s + TORCHRUN_CLOSE_S + 20
    assert proc.returncode == 0, (tmp_path / "bench.log").read_text()[-3000:]
    assert _gone(tmp_path, RANK_EXIT_S) == []
    record = json.loads((tmp_path / "runs" / "run" / "record.json").read_text())
    sft = record["stages"]["sft"]
    assert record["status"] == sft["status"] == "timeout"
    assert sft["error"]["stalled_ranks"] == [0]
    assert f"no progress for launcher.stall_s={stall_s} s since phase" in sft["error"]["message"]
    log = (tmp_path / "runs" / "run" / "sft" / "worker.log").read_text()
    report = log[log.index("==== rank 0 stalled; its watchdog's report ===="):]
    assert f"Timeout (0:00:{stall_s})!" in report
    # every thread: the main one, waiting in the step for its frozen peer (DDP's all-reduce inside backward, or
    # the loop's collectives), and the rank's lifeline
    assert report.count("Thread 0x") >= 2
    assert "in run_rank" in report and "bench/run/loop.py" in report and "in watch\n" in report


@pytest.mark.engine
@pytest.mark.parametrize("victim", ["launcher", "torchrun"])
def test_a_killed_launcher_or_torchrun_leaves_no_rank_behind(tmp_path, victim):
    proc = _start_run(tmp_path)
    ranks = _ranks_after_a_step(tmp_path, proc)
    (_torchrun(tmp_path) if victim == "torchrun" else psutil.Process(proc.pid)).send_signal(signal.SIGKILL)
    killed = time.monotonic()
    # torchrun, told by the kernel that the launcher died, stops its ranks; ranks whose torchrun died are told
    # by the kernel themselves
    assert _gone(tmp_path, TORCHRUN_CLOSE_S) == []
    # a rank in the middle of its exit has released its memory, so its command line reads empty and it no longer
    # "mentions" the run: wait for the ranks themselves within the same deadline
    while [r for r in ranks.values() if _running(r)] and time.monotonic() - killed < TORCHRUN_CLOSE_S:
        time.sleep(0.2)
    assert time.monotonic() - killed < TORCHRUN_CLOSE_S
    for rank in ranks.values():
        assert not _running(rank)
    # the ranks, cut short, kept what they measured (their log is a file, not a pipe the dead launcher read)
    for rank in range(2):
        result = json.loads((tmp_path / "runs" / "run" / "sft" / f"rank{rank}.json").read_text())
        assert result["cut_short"]["signal"] == "SIGTERM" and result["cut_short"]["steps_done"] >= 1
    proc.wait(timeout=60)
