"""Process trees that tests start: run to an end whatever happens, and found again by what they were given."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

import psutil


def run_tree(cmd: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess:
    """subprocess.run for a command that starts a tree of processes (torchrun and its ranks, which torchrun puts
    in sessions of their own): on a timeout the whole tree is killed, not only its first process, and
    subprocess.TimeoutExpired is raised with what it printed."""
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGKILL)
        for child in tree:
            child.kill()
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    done.check_returncode()
    return done


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
