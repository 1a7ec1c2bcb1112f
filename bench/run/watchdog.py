"""What keeps a rank from hanging silently, or from outliving the processes that started it.

- Stall watchdog: `beat(what)` at each sign of progress (a phase starting, a JIT op loading, the save, the close)
  re-arms faulthandler's timer for `launcher.stall_s`. The timer runs in a C thread of its own, so it fires even
  when the stalled code holds the GIL (a collective whose peer is gone, a lock that never comes free). It writes
  every thread's stack to the rank's stall file, under a header naming the last progress, and ends the process
  with exit code 1; torchrun then stops the other ranks, and the launcher names the stall and copies the stacks
  into the stage's worker.log (bench.run.launcher).
- Lifeline: torchrun starts each rank in a session of its own, so a torchrun that is killed (SIGKILL from a
  test's timeout, the OOM killer) would leave its ranks running. A rank asks the kernel for SIGTERM when its
  parent dies (PR_SET_PDEATHSIG), which the worker turns into a record of what it measured; a thread that sees
  the parent gone gives the rank ORPHAN_GRACE_S more, whatever it is blocked in.
- Outside the launcher (a diagnostic script under torchrun, bench.run.watchdog's callers in scripts/) a rank
  writes its stall file into $RLHF_BENCH_STALL_DIR, else the system's temporary folder: tests that start such a
  process set the variable and report what they find there (tests/processes.py).
- SIGUSR1 writes every thread's stack to stderr (the stage's worker.log) without stopping the rank: the launcher
  sends it before it kills a run that passed launcher.timeout_s.
"""

from __future__ import annotations

import faulthandler
import glob
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

STALL_FILE = "stall-rank{rank}.txt"
STALL_DIR_VARIABLE = "RLHF_BENCH_STALL_DIR"
# faulthandler's first line when its timer fires (dump_traceback_later); a SIGUSR1 dump has no such line
TIMER_FIRED = "Timeout ("
ORPHAN_GRACE_S = 30.0  # a rank whose torchrun is gone writes its record in well under this
PARENT_POLL_S = 1.0


def stall_path(stage_dir: str, rank: int) -> str:
    return os.path.join(stage_dir, STALL_FILE.format(rank=rank))


def outside_stall_path(script: str, rank: int) -> str:
    """The stall file of a rank started outside the launcher (module docstring), named by its script and pid."""
    folder = os.environ.get(STALL_DIR_VARIABLE) or tempfile.gettempdir()
    return os.path.join(folder, f"stall-{script}-pid{os.getpid()}-rank{rank}.txt")


class RankWatchdog:
    """One per rank process, for its whole life (see the module's docstring)."""

    def __init__(self, path: str, rank: int, stall_s: float) -> None:
        self._file = open(path, "w")  # noqa: SIM115 -- faulthandler writes to its descriptor until the process ends
        self._rank = rank
        self._stall_s = stall_s
        self._final = False
        self._lock = threading.Lock()
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
        self.beat("the rank started")

    def beat(self, what: str) -> None:
        """Progress: the rank has another stall_s to show the next sign of it."""
        self._arm(self._stall_s, f"no progress for launcher.stall_s={self._stall_s:g} s since {what}", final=False)

    def final(self, grace_s: float, why: str) -> None:
        """The rank must end within grace_s (its parent is gone, or it was told to stop): beats no longer
        extend the deadline."""
        self._arm(grace_s, f"still running {grace_s:g} s after {why}", final=True)

    def _arm(self, seconds: float, reason: str, final: bool) -> None:
        # SIGTERM's handler calls final(): held back while this thread is inside, or it would wait forever
        # for the lock this thread holds (or have its deadline overwritten by the beat it interrupted)
        in_main = threading.current_thread() is threading.main_thread()
        if in_main:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            with self._lock:
                if self._final:
                    return
                self._final = final
                at = time.strftime("%H:%M:%S %Z", time.localtime(time.time() + seconds))
                self._file.seek(0)
                self._file.truncate()
                self._file.write(f"rank {self._rank} (pid {os.getpid()}): {reason}; deadline {at}\n")
                self._file.flush()
                # the dump goes to the descriptor, after the header just flushed
                faulthandler.dump_traceback_later(seconds, exit=True, file=self._file)
        finally:
            if in_main:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})

    def watch_parent(self) -> None:
        """The lifeline (module docstring). Linux only: elsewhere the rank relies on torchrun stopping it."""
        parent = os.getppid()
        if not sys.platform.startswith("linux"):
            return
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() != parent:  # it died before the request took effect
            os.kill(os.getpid(), signal.SIGTERM)

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(PARENT_POLL_S)
            self.final(ORPHAN_GRACE_S, f"its parent (pid {parent}) ended")

        threading.Thread(target=watch, name="rank-lifeline", daemon=True).start()


@dataclass
class Stall:
    rank: int
    text: str  # the header line, then every thread's stack

    @property
    def reason(self) -> str:
        return self.text.splitlines()[0] if self.text else f"rank {self.rank} stalled"


def stalls(stage_dir: str) -> list[Stall]:
    """Ranks whose watchdog fired: their stall files hold a stack dump, not just the armed header."""
    found = []
    for path in sorted(glob.glob(os.path.join(glob.escape(stage_dir), STALL_FILE.format(rank="*")))):
        try:
            with open(path, errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        if TIMER_FIRED in text:
            rank = int(os.path.basename(path)[len("stall-rank"):-len(".txt")])
            found.append(Stall(rank, text))
    return sorted(found, key=lambda s: s.rank)
