"""Process trees that tests start: run to an end whatever happens, found again by what they were given, and
reported as the harness reports its own runs (bench.run.launcher): a tree that fails or runs out of time says
where it was."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import tempfile
import time
from typing import Any

import psutil

from bench.run.watchdog import STALL_DIR_VARIABLE, TIMER_FIRED

STACK_DUMP_WAIT_S = 2.0  # for the SIGUSR1 stack dumps to reach their files before the kill
TAIL_CHARS = 6000


class TreeFailed(subprocess.CalledProcessError):
    """A tree that ended with an error, or was killed at its timeout (returncode None); `report` says where it
    was: the watchdogs' stall reports, the stacks dumped before the kill and the end of its output."""

    def __init__(self, cmd: list[str], returncode: int | None, out: Any, err: Any, report: str) -> None:
        super().__init__(returncode if returncode is not None else -signal.SIGKILL, cmd, out, err)
        self.timed_out = returncode is None
        self.report = report

    def __str__(self) -> str:
        return self.report


def _text(data: Any) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def catches_sigusr1(proc: psutil.Process) -> bool:
    """Whether the process handles SIGUSR1 (bench.run.watchdog registers a stack dump for it); the default
    action would end it, so a process without a handler is left alone."""
    try:
        with open(f"/proc/{proc.pid}/status") as f:
            caught = next(line for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught.split()[1], 16) >> (signal.SIGUSR1 - 1) & 1)


def dump_stacks(tree: list[psutil.Process]) -> list[str]:
    """Every process of the tree that can dump its threads' stacks does (SIGUSR1); the files its stderr goes
    to (a stage's worker.log), for the report to read once the dumps are written."""
    files, signalled = [], False
    for proc in tree:
        if not catches_sigusr1(proc):
            continue
        signalled = True
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{proc.pid}/fd/2")
            if os.path.isfile(target) and target not in files:
                files.append(target)
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGUSR1)
    if signalled:
        time.sleep(STACK_DUMP_WAIT_S)
    return files


def stall_reports(folder: str) -> list[str]:
    """The reports of watchdogs that fired (their files hold a stack dump, not only the armed header)."""
    found = []
    for path in sorted(glob.glob(os.path.join(glob.escape(folder), "*.txt"))):
        with open(path, errors="replace") as f:
            text = f.read()
        if TIMER_FIRED in text:
            found.append(f"---- {os.path.basename(path)} ----\n{text}")
    return found


def report(cmd: list[str], why: str, err: Any, stalls: list[str], log_files: list[str]) -> str:
    parts = [f"{' '.join(cmd)}: {why}"]
    parts += [f"a watchdog fired:\n{text[-TAIL_CHARS:]}" for text in stalls]
    for path in log_files:
        with contextlib.suppress(OSError), open(path, errors="replace") as f:
            parts.append(f"the end of {path}, where a rank's stacks went:\n{f.read()[-TAIL_CHARS:]}")
    parts.append(f"the end of its stderr:\n{_text(err)[-TAIL_CHARS:]}")
    return "\n".join(parts)


def run_tree(cmd: list[str], timeout: float, check: bool = True, **kwargs: Any) -> subprocess.CompletedProcess:
    """subprocess.run for a command that starts a tree of processes (torchrun and its ranks, which torchrun puts
    in sessions of their own). Its ranks' watchdogs write into a folder of the call's own, read back here. On a
    timeout every process that can dumps its stacks first, then the whole tree is killed, not only its first
    process; a timeout, or with `check` an exit code other than 0, raises TreeFailed with the report."""
    with tempfile.TemporaryDirectory(prefix="stalls-") as stall_dir:
        env = dict(kwargs.pop("env", None) or os.environ)
        env[STALL_DIR_VARIABLE] = stall_dir
        proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            tree = psutil.Process(proc.pid).children(recursive=True)
            log_files = dump_stacks([psutil.Process(proc.pid), *tree])
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            for child in tree:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            out, err = proc.communicate()
            raise TreeFailed(cmd, None, out, err, report(cmd, f"still running after {timeout:g} s: killed", err,
                                                         stall_reports(stall_dir), log_files)) from None
        if check and proc.returncode != 0:
            raise TreeFailed(cmd, proc.returncode, out, err, report(cmd, f"exit code {proc.returncode}", err,
                                                                    stall_reports(stall_dir), []))
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def processes_mentioning(text: str) -> list[psutil.Process]:
    """Live processes whose command line contains `text` (a test's temporary directory: its runs' processes)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and text in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.NoSuchProcess:
            continue
    return found
