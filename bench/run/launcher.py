"""Launches one stage as an isolated process tree: torchrun with N ranks of `bench.run.worker`.

torchrun runs in its own session and each rank in another (torchrun's own choice), so a timeout kills
torchrun's group and every rank's; its output (engine logs, library warnings) goes to the stage's `worker.log`,
and to the terminal as well only with `verbose=true`: the terminal shows the stage's progress line instead
(bench.run.progress). A rank that stalls ends itself with every thread's stack (bench.run.watchdog), which
this copies into worker.log; a run past launcher.timeout_s has its ranks' stacks dumped there before it is
killed. Whatever happens, the caller gets the ranks' result files back, or a failure that says why there are
none.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console

from bench.results.record import write_json
from bench.run.progress import StageDisplay, feed_path
from bench.run.spec import RunSpec
from bench.run.watchdog import STALL_FILE, Stall, stalls

REPO = Path(__file__).resolve().parents[2]
LOG_TAIL_LINES = 30
STACK_DUMP_WAIT_S = 2.0  # for the ranks' SIGUSR1 stack dumps to reach the log before the kill
TORCHRUN_CLOSE_S = 40.0  # torchrun gives its ranks 30 s after SIGTERM, then SIGKILLs them
RANK_EXIT_S = 10.0  # a rank whose torchrun is gone, before it is killed
FOLLOW_POLL_S = 0.2
# torchrun's failure summary names each failed rank with its exit code; -9 is SIGKILL.
_KILLED_RANK = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*-9\b")


@dataclass
class StageOutcome:
    ranks: list[dict[str, Any]]
    wall_time_s: float
    failure: dict[str, Any] | None  # set when the process tree failed or ranks are missing


def rank_env(spec: RunSpec) -> dict[str, str]:
    """The environment every rank runs in: this process's, with thread counts, offline Hugging Face, unbuffered
    output and the repository on the path."""
    env = dict(os.environ)
    threads = str(spec.launcher.threads_per_rank)
    env.update(
        OMP_NUM_THREADS=threads,
        MKL_NUM_THREADS=threads,
        PYTHONUNBUFFERED="1",
        PYTHONFAULTHANDLER="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
    )
    jit_cache = jit_cache_dir()
    if jit_cache is not None:
        env.setdefault("TORCH_EXTENSIONS_DIR", jit_cache)
    given = env.get("TORCH_CUDA_ARCH_LIST")
    readable = deepspeed_arch_list(given) if given is not None else None
    if readable is not None:
        env.update(TORCH_CUDA_ARCH_LIST=readable, RLHF_BENCH_ARCH_LIST_GIVEN=given)
    return env


ARCH_SUFFIX = re.compile(r"(\d+\.\d+)[a-z](\+PTX)?")


def deepspeed_arch_list(value: str) -> str | None:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed 0.19.8's JIT builder can read it, or None where it already can. The
    builder sorts the entries as dotted integers (op_builder/builder.py, compute_capability_args), so an
    architecture-specific entry such as "9.0a" (sm_90a, set by some CUDA images) raises ValueError before
    FusedAdam builds and every DeepSpeed run fails at its engine's init (found on an H200). The letter suffix is
    dropped ("9.0a" -> "9.0": sm_90 code, which runs on the same GPU) and a duplicate it makes is left out; "+PTX"
    stays. The record keeps both lists (environment.gpu)."""
    entries = [e for e in re.split(r"[;\s]+", value) if e]
    if not any(ARCH_SUFFIX.fullmatch(e) for e in entries):
        return None
    readable: list[str] = []
    for entry in entries:
        match = ARCH_SUFFIX.fullmatch(entry)
        entry = match.group(1) + (match.group(2) or "") if match else entry
        if entry not in readable:
            readable.append(entry)
    return ";".join(readable)


def jit_cache_dir() -> str | None:
    """Where the ranks' JIT-compiled ops (DeepSpeed's shm_comm, cpu_adam, fused_adam) are cached: inside this
    virtual environment. torch's default, one folder per user, is shared by every checkout, and an op built
    against one environment's headers is rebuilt (about 100 s) for the next: two checkouts used in turn
    rebuilt each other's ops on every first run. None outside a writable virtual environment (the default
    applies); a TORCH_EXTENSIONS_DIR the user set is kept."""
    if sys.prefix == sys.base_prefix or not os.access(sys.prefix, os.W_OK):
        return None
    return os.path.join(sys.prefix, "torch_extensions")


def sigkilled_ranks(log: str) -> list[int]:
    """Ranks that torchrun reports as ended by SIGKILL (the kernel's OOM killer sends it)."""
    return sorted({int(m.group(1)) for m in _KILLED_RANK.finditer(log)})


def missing_ranks_failure(expected: int, present: list[int], returncode: int | None, log: str) -> dict[str, Any]:
    """Why ranks wrote no result: a rank killed by SIGKILL without a word is, on a training node, almost
    always the kernel's OOM killer, so the stage is `oom` (and a sweep's OOM back-stop fires); else `error`."""
    missing = sorted(set(range(expected)) - set(present))
    killed = [r for r in sigkilled_ranks(log) if r in missing]
    if killed:
        return {"status": "oom", "error": {
            "message": f"rank(s) {killed} ended by SIGKILL and wrote no result: the kernel's OOM killer "
                       f"(host memory exhausted) sends SIGKILL; {len(missing)} of {expected} ranks missing",
            "phase": None, "killed_ranks": killed}}
    tail = "".join(log.splitlines(keepends=True)[-LOG_TAIL_LINES:])
    return {"status": "error", "error": {
        "message": f"{len(missing)} of {expected} ranks wrote no result (exit code {returncode}); log tail:\n{tail}",
        "phase": None}}


def remove_torn_writes(directory: str) -> None:
    """A write killed midway (SIGKILL, power) leaves a `.tmp-*` file behind write_json's atomic rename."""
    for stale in glob.glob(os.path.join(glob.escape(directory), ".tmp-*")):
        with contextlib.suppress(OSError):
            os.unlink(stale)


def _follow(path: str, offset: int, done: threading.Event) -> None:
    """verbose=true: the log as it grows, from `offset` on, to the terminal, until `done` (then what is left)."""
    # text through sys.stderr (not its buffer): a live progress line redirects it to print above itself
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with open(path, "rb") as log:
        log.seek(offset)
        while True:
            finished = done.is_set()
            chunk = log.read()
            if chunk:
                sys.stderr.write(decoder.decode(chunk))
                sys.stderr.flush()
            if finished:
                return
            done.wait(FOLLOW_POLL_S)


def _read_log(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def launch_stage(spec: RunSpec, stage: str, stage_dir: str, init: dict[str, str], console: Console | None = None,
                 label: str | None = None) -> StageOutcome:
    """`console`: where the stage's progress line (titled `label`, default the stage) is drawn, and with
    spec.verbose the ranks' own output too; None shows nothing (the log has it all)."""
    stage_dir = os.path.abspath(stage_dir)  # workers run from the repository root
    os.makedirs(stage_dir, exist_ok=True)
    stale_files = [*glob.glob(os.path.join(glob.escape(stage_dir), "rank*.json")), feed_path(stage_dir),
                   *glob.glob(os.path.join(glob.escape(stage_dir), STALL_FILE.format(rank="*")))]
    for stale in stale_files:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stale)
    remove_torn_writes(stage_dir)
    spec_path = os.path.join(stage_dir, "spec.json")
    write_json(spec_path, spec.to_dict())
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
        f"--nproc_per_node={spec.launcher.nproc}", "-m", "bench.run.worker", spec_path, stage_dir, stage,
    ]
    for key, path in init.items():
        cmd += [f"--init-{key}", os.path.abspath(path)]
    log_path = os.path.join(stage_dir, "worker.log")
    start = time.perf_counter()
    failure = None
    display = StageDisplay(console, label or stage, feed_path(stage_dir)) if console is not None else None
    # A resumed stage keeps the killed run's log. The tree writes into the file itself, not into a pipe: ranks
    # whose launcher died (and a pipe's reader with it) still log, and write what they measured. Appending: the
    # launcher's own notes (stacks, stalls) land after what the tree wrote.
    if not spec.resume:
        open(log_path, "wb").close()
    with open(log_path, "ab") as log, display or contextlib.nullcontext():
        proc = subprocess.Popen(cmd, cwd=REPO, env=rank_env(spec), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
        done = threading.Event()
        echo = None
        if console is not None and spec.verbose:
            echo = threading.Thread(target=_follow, args=(log_path, log.tell(), done), daemon=True)
            echo.start()
        try:
            returncode = proc.wait(timeout=spec.launcher.timeout_s)
        except subprocess.TimeoutExpired:
            _dump_stacks(proc, log)
            _kill_tree(proc)
            returncode = None
            failure = {"status": "timeout", "error": {
                "message": f"stage {stage} still running after launcher.timeout_s={spec.launcher.timeout_s}; killed "
                           f"(every rank's stacks are in {log_path})",
                "phase": None}}
        except BaseException:  # Ctrl-C in the sweep: the run's own session does not get the terminal's signal
            _kill_tree(proc)
            raise
        stalled = stalls(stage_dir)
        for stall in stalled:
            log.write(f"\n==== rank {stall.rank} stalled; its watchdog's report ====\n{stall.text}\n".encode())
        log.flush()
        done.set()
        if echo is not None:
            echo.join(timeout=10)
    wall = time.perf_counter() - start
    ranks = []
    for path in sorted(glob.glob(os.path.join(glob.escape(stage_dir), "rank*.json"))):
        with open(path) as f:
            ranks.append(json.load(f))
    if stalled:  # the cause: the other ranks' failures follow from it
        failure = stall_failure(stalled, log_path)
    elif failure is None and len(ranks) < spec.launcher.nproc:
        failure = missing_ranks_failure(spec.launcher.nproc, [r["rank"] for r in ranks], returncode,
                                        _read_log(log_path))
    return StageOutcome(ranks=ranks, wall_time_s=wall, failure=failure)


def stall_failure(stalled: list[Stall], log_path: str) -> dict[str, Any]:
    """A stalled rank's run is a `timeout` (it ran out of time, in one phase rather than in all), named."""
    reasons = "; ".join(s.reason for s in stalled)
    return {"status": "timeout", "error": {
        "message": f"rank(s) {[s.rank for s in stalled]} stalled: {reasons}. Every thread's stack is in {log_path}",
        "phase": None, "stalled_ranks": [s.rank for s in stalled]}}


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the launching process dies, even by SIGKILL. The tree runs in
    its own session (so a timeout can kill all of it), which also shields it from the terminal's signals;
    without this a killed sweep would leave its current run training on. torchrun passes SIGTERM on to
    its ranks. Linux only; elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _ranks(proc: subprocess.Popen, recursive: bool = False) -> list[psutil.Process]:
    """torchrun's children: its ranks, each in a session of its own, out of reach of torchrun's group
    (`recursive`: with whatever processes the ranks started)."""
    try:
        return psutil.Process(proc.pid).children(recursive=recursive)
    except psutil.NoSuchProcess:
        return []


def _dump_stacks(proc: subprocess.Popen, log) -> None:
    """Each rank writes every thread's stack to the log (SIGUSR1: bench.run.watchdog), one after another."""
    for rank in _ranks(proc):
        log.write(f"\n==== launcher.timeout_s reached: the stacks of pid {rank.pid} ====\n".encode())
        log.flush()
        with contextlib.suppress(psutil.NoSuchProcess):
            rank.send_signal(signal.SIGUSR1)
        time.sleep(STACK_DUMP_WAIT_S)


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGTERM to torchrun, which passes it to its ranks (they write what they measured) and waits up to 30 s
    for them; then SIGKILL to whatever of the tree is left. A rank gets SIGTERM once: a second one could cut
    its record short."""
    ranks = _ranks(proc, recursive=True)  # before torchrun ends: its orphans are no longer its children
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=TORCHRUN_CLOSE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    _, alive = psutil.wait_procs(ranks, timeout=RANK_EXIT_S)
    for rank in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            rank.kill()
    psutil.wait_procs(alive, timeout=RANK_EXIT_S)
