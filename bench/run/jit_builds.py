"""JIT-built ops (DeepSpeed's shm_comm, fused_adam and cpu_adam; ColossalAI's CPU Adam): the one folder every
process of the project builds and finds them in, and the build locks a killed build leaves behind.

The folder: inside the virtual environment (`.venv/torch_extensions`). torch's default, one folder per user, is
shared by every checkout, and an op built against one environment's headers is rebuilt (about 100 s) for the
next; a process that misses the folder (a script under torchrun, a test's subprocess) rebuilds what set-up or
another run built. The launcher gives it to the ranks; `use_cache_dir` gives it to every other process.

The lock: torch builds an op under a lock file in its build folder (torch.utils.file_baton.FileBaton: created
with O_CREAT | O_EXCL, removed when the build ends) and makes every other process that wants the op sleep
until the file is gone. A builder killed midway (Ctrl-C, a timeout, preemption, the OOM killer) never removes
it, and torch has no staleness check: every later load of that op, by any process, sleeps forever. `install`
guards against that: a builder writes who it is into its lock (pid, host, process start time), and a process
that meets a lock judges its builder before it waits:
- the builder named in the lock still runs (same pid and start time on this host), or a process on this host
  holds the lock open (a builder that wrote no record: torch outside this project): wait for it, and say so
  (`on_wait`: the worker's watchdog is re-armed with the lock named, so a wait that never ends is reported);
- the builder is gone (its pid ended on this host, or nothing holds an unrecorded lock on a local filesystem):
  the lock is stale; it is removed, the removal printed with the builder named, and the op is loaded again;
- the lock cannot be judged from here (an unrecorded lock on a network filesystem, or one whose owner's
  processes this user cannot inspect): the load stops at once with the file, the reason and the command that
  removes it. A lock recorded by a builder on another host is waited on, its host and pid named.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

CACHE_VARIABLE = "TORCH_EXTENSIONS_DIR"
POLL_S = 0.5  # torch polls every 0.1 s; a lock is judged at each poll, so less often
# a builder writes its record right after creating the lock: an empty lock younger than this is a builder
# between the two, not a stale lock
RECORD_GRACE_S = 5.0
RELOAD_TRIES = 3  # loads after a stale lock was removed (another process may take the build and die too)
# filesystems that another machine may share: a lock there with no record cannot be judged from this host
NETWORK_FILESYSTEMS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph",
                                 "glusterfs", "fuse.glusterfs", "fuse.sshfs", "fuse.s3fs", "9p", "afs", "wekafs"})


def cache_dir() -> str | None:
    """The project's JIT folder: inside this virtual environment; None outside a writable one (torch's default
    applies)."""
    if sys.prefix == sys.base_prefix or not os.access(sys.prefix, os.W_OK):
        return None
    return os.path.join(sys.prefix, "torch_extensions")


def use_cache_dir(env: dict[str, str] | os._Environ = os.environ) -> None:
    """Points `env` (this process's environment by default, and so its children's) at the project's JIT folder,
    unless a TORCH_EXTENSIONS_DIR is already set (the user's choice is kept)."""
    folder = cache_dir()
    if folder is not None:
        env.setdefault(CACHE_VARIABLE, folder)


@dataclass(frozen=True)
class Verdict:
    state: str  # held | stale | unknown | released
    why: str  # names the builder, or why it cannot be judged


class StaleLockRemoved(Exception):
    """Raised out of torch's wait: the lock was stale and is gone, so the op must be loaded (built) again."""


class UnjudgedLock(RuntimeError):
    """A lock this process cannot judge: the load stops rather than wait on it, maybe forever."""


def owner_record() -> str:
    me = psutil.Process()
    return f"pid={me.pid} host={socket.gethostname()} started={me.create_time():.3f}\n"


def read_record(path: str) -> dict[str, str]:
    """The builder's record in a lock: {} where it wrote none (or the lock is gone)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return {}
    return dict(part.split("=", 1) for part in text.split() if "=" in part)


def filesystem_type(path: str) -> str:
    """The type of the filesystem that holds `path` (the longest mount point above it)."""
    path = os.path.realpath(path)
    best, kind = "", ""
    for part in psutil.disk_partitions(all=True):
        point = part.mountpoint.rstrip("/") + "/"
        if (path + "/").startswith(point) and len(point) > len(best):
            best, kind = point, part.fstype
    return kind


def holders(path: str, uid: int) -> list[int]:
    """Processes of user `uid` on this host that hold `path` open. One that cannot be inspected is passed over:
    the caller is that user or root, and a builder (a Python process running torch) can be inspected by both; the
    ones that cannot are not builders (a container's init, set-uid programs)."""
    target = os.path.realpath(path)
    found = []
    for proc in psutil.process_iter(["uids"]):
        try:
            uids = proc.info["uids"]
            if uids is not None and uid in (uids.real, uids.effective) and \
                    any(f.path == target for f in proc.open_files()):
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def judge(path: str) -> Verdict:
    """Whether the builder of the lock at `path` is alive (module docstring)."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return Verdict("released", "the lock is gone")
    record = read_record(path)
    if "pid" in record:
        pid, host = int(record["pid"]), record.get("host", "?")
        who = f"its builder, pid {pid} on {host}"
        if host != socket.gethostname():
            return Verdict("held", f"{who}, another host: not checked from here")
        try:
            alive = abs(psutil.Process(pid).create_time() - float(record.get("started", "nan"))) < 0.01
        except psutil.NoSuchProcess:
            alive = False
        return Verdict("held", f"{who}, is building") if alive else Verdict("stale", f"{who}, is gone")
    if time.time() - stat.st_mtime < RECORD_GRACE_S:
        return Verdict("held", "its builder has just created it")
    if os.geteuid() not in (0, stat.st_uid):
        return Verdict("unknown", f"it names no builder, and the processes of its owner (uid {stat.st_uid}) "
                                  "cannot be inspected by this user")
    found = holders(path, stat.st_uid)
    if found:
        return Verdict("held", f"pid {found[0]} on this host holds it open (a build outside rlhf-bench)")
    fs = filesystem_type(path)
    if fs in NETWORK_FILESYSTEMS:
        return Verdict("unknown", f"it names no builder and no process on this host holds it, but it is on a {fs} "
                                  "filesystem that another machine may be building on")
    return Verdict("stale", "it names no builder and no process holds it: its build was killed")


def remove_if_stale(path: str) -> Verdict:
    """Judges the lock again under a guard file, so that two processes that both found it stale cannot remove
    the fresh lock that the first of them made when it loaded again; removes it if it is still stale."""
    guard = path + ".judged"
    with open(guard, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        verdict = judge(path)
        if verdict.state == "stale":
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    return verdict


def waiting_note(path: str, why: str) -> str:
    return f"waiting for the JIT build lock {path} ({why})"


def removal_note(path: str, why: str) -> str:
    return (f"rlhf-bench: removed the stale JIT build lock {path}: {why}. A build killed midway leaves its lock "
            "behind, and torch would wait on it forever; the op is built again now.")


def refusal(path: str, why: str) -> str:
    return (f"JIT build lock {path} cannot be judged: {why}. If no build of this op is running anywhere, remove it "
            f"and run again: rm {shlex.quote(path)}")


def install(on_wait: Callable[[str, str], None] | None = None) -> None:
    """Guards every later JIT build in this process (idempotent): torch's lock records its builder, a stale lock
    is removed and the op loaded again, and an unjudged one stops the load. `on_wait(lock, why)` is told when
    the process starts waiting for another builder."""
    import torch.utils.cpp_extension as cpp_extension

    if getattr(cpp_extension.load, "_bench_guarded", False):
        return
    baton_class = cpp_extension.FileBaton

    class RecordedBaton(baton_class):  # type: ignore[misc,valid-type]
        def try_acquire(self) -> bool:
            if not super().try_acquire():
                return False
            with open(self.lock_file_path, "w") as f:
                f.write(owner_record())
            return True

        def wait(self) -> None:
            told = ""
            while os.path.exists(self.lock_file_path):
                verdict = judge(self.lock_file_path)
                if verdict.state == "stale":
                    verdict = remove_if_stale(self.lock_file_path)
                    if verdict.state == "stale":
                        print(removal_note(self.lock_file_path, verdict.why), file=sys.stderr, flush=True)
                        raise StaleLockRemoved(self.lock_file_path)
                if verdict.state == "unknown":
                    raise UnjudgedLock(refusal(self.lock_file_path, verdict.why))
                if on_wait is not None and verdict.state == "held" and verdict.why != told:
                    on_wait(self.lock_file_path, verdict.why)
                    told = verdict.why
                time.sleep(POLL_S)

    load = cpp_extension.load

    @functools.wraps(load)  # keeps the timer's mark (bench.measure.jit_ops), whichever is installed first
    def guarded(*args: Any, **kwargs: Any) -> Any:
        name = str(kwargs.get("name", args[0] if args else ""))
        for _ in range(RELOAD_TRIES - 1):
            try:
                return load(*args, **kwargs)
            except StaleLockRemoved:
                # torch builds an op only at its first load in a process (its versioner then holds the op's
                # entry); this load found a stale lock instead of building, so the entry goes with it
                cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(name, None)
        return load(*args, **kwargs)

    guarded._bench_guarded = True  # type: ignore[attr-defined]
    cpp_extension.FileBaton = RecordedBaton
    cpp_extension.load = guarded
