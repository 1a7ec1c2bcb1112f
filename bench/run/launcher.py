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

from bench.measure.environment import MMAP_THRESHOLD_VARIABLE
from bench.results.record import write_json
from bench.run import jit_builds
from bench.run.progress import StageDisplay, feed_path
from bench.run.spec import RunSpec
from bench.run.watchdog import STALL_FILE, Stall, stalls

REPO = Path(__file__).resolve().parents[2]
LOG_TAIL_LINES = 30
STACK_DUMP_WAIT_S = 2.0  # for the ranks' SIGUSR1 stack dumps to reach the log before the kill
TORCHRUN_CLOSE_S = 40.0  # torchrun gives its ranks 30 s after SIGTERM, then SIGKILLs them
RANK_EXIT_S = 10.0  # a rank whose torchrun is gone, before it is killed
FOLLOW_POLL_S = 0.2
AGENT_EXIT_S = 10.0  # node 0's agent still running this long after its ranks ended waits for dead nodes
# torchrun's failure summary names each failed rank with its exit code; -9 is SIGKILL.
_KILLED_RANK = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*-9\b")


@dataclass
class StageOutcome:
    ranks: list[dict[str, Any]]
    wall_time_s: float
    failure: dict[str, Any] | None  # set when the process tree failed or ranks are missing


def rank_env(spec: RunSpec) -> dict[str, str]:
    """The environment every rank runs in: this process's, with thread counts, offline Hugging Face, unbuffered
    output, the repository on the path and, where the run fixes it, glibc's mmap threshold (setting it also stops
    glibc from raising it as large blocks are freed: the host peaks follow the live tensors, not the threshold's
    history)."""
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
    if spec.memory_mmap_threshold is not None:
        env[MMAP_THRESHOLD_VARIABLE] = str(spec.memory_mmap_threshold)
    jit_builds.use_cache_dir(env)
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


def torchrun_command(spec: RunSpec, spec_path: str, stage_dir: str, stage: str, init: dict[str, str]) -> list[str]:
    """One torchrun agent on this node: --standalone on one node; on several, the c10d rendezvous at the
    endpoint every node names (the run's id keeps runs that share it apart, and the stage's keeps the stages
    of one run apart), no restarts (a benchmark reports a failure, it does not retry it), and join_timeout
    launcher.rdzv_timeout_s."""
    launcher = spec.launcher
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if launcher.nnodes == 1:
        cmd += ["--standalone", "--nnodes=1"]
    else:
        cmd += [f"--nnodes={launcher.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={launcher.rdzv_endpoint}",
                f"--rdzv-id={launcher.rdzv_id}-{stage}", "--max-restarts=0",
                f"--rdzv-conf=join_timeout={launcher.rdzv_timeout_s:g}"]
    cmd += [f"--nproc-per-node={launcher.nproc}", "-m", "bench.run.worker", spec_path, stage_dir, stage]
    for key, path in init.items():
        cmd += [f"--init-{key}", os.path.abspath(path)]
    return cmd


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
    cmd = torchrun_command(spec, spec_path, stage_dir, stage, init)
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
            returncode = _wait_tree(proc, spec.launcher.timeout_s, spec.launcher.nnodes, spec.launcher.node, log)
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
    elif failure is None and len(ranks) < _expected_ranks(spec):
        log_text = _read_log(log_path)
        failure = rendezvous_failure(spec, log_text) if not ranks else None
        if failure is None and spec.launcher.node == 0:
            failure = missing_ranks_failure(_expected_ranks(spec), [r["rank"] for r in ranks], returncode, log_text)
        elif failure is None:  # another node: its ranks' global numbers are the rendezvous's choice
            ended = (f"its torchrun agent was killed by {signal.Signals(-returncode).name}"
                     if returncode is not None and returncode < 0 else f"torchrun's exit code {returncode}")
            failure = {"status": "error", "error": {
                "message": f"{spec.launcher.nproc - len(ranks)} of this node's {spec.launcher.nproc} rank(s) wrote no "
                           f"result here ({ended}); node 0's record has what reached it", "phase": None}}
    return StageOutcome(ranks=ranks, wall_time_s=wall, failure=failure)


def _wait_tree(proc: subprocess.Popen, timeout_s: float, nnodes: int, node: int, log) -> int | None:
    """torchrun's exit code, or None where this node's agent had to be stopped after its ranks ended. On
    several nodes an agent whose ranks ended waits in torchrun's exit barrier (up to 300 s) for the other
    nodes' agents, dead ones too. On node 0 every result is in by then (the collecting rank ended after the
    other nodes' ranks posted theirs, or gave up on them: bench.run.gather), so AGENT_EXIT_S after its last
    rank ended the agent is stopped. Elsewhere the barrier is left to run: this agent may host the store that
    a third node's ranks still post to."""
    if nnodes == 1 or node != 0:
        return proc.wait(timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    ranks_seen, ended_at = False, None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise subprocess.TimeoutExpired(proc.args, timeout_s)
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.wait(timeout=min(FOLLOW_POLL_S * 5, remaining))
        if _ranks(proc):
            ranks_seen, ended_at = True, None
        elif ranks_seen:
            ended_at = ended_at or time.monotonic()
            if time.monotonic() - ended_at > AGENT_EXIT_S:
                log.write(f"\n==== this node's ranks ended {AGENT_EXIT_S:g} s ago and its torchrun agent still waits "
                          "for the other nodes' agents: stopped ====\n".encode())
                log.flush()
                _kill_tree(proc)
                return None


def _expected_ranks(spec: RunSpec) -> int:
    """Rank files a stage directory should end with: every rank's on node 0 (the others' are gathered there),
    this node's own elsewhere."""
    return spec.launcher.world_size if spec.launcher.node == 0 else spec.launcher.nproc


_RENDEZVOUS_ERRORS = ("RendezvousTimeoutError", "RendezvousConnectionError", "RendezvousClosedError",
                      "RendezvousError")


def rendezvous_failure(spec: RunSpec, log: str) -> dict[str, Any] | None:
    """torchrun's rendezvous failed (no rank started): the error names the endpoint, the id and what to check."""
    found = next((name for name in _RENDEZVOUS_ERRORS if name in log), None)
    if found is None or spec.launcher.nnodes == 1:
        return None
    launcher = spec.launcher
    return {"status": "error", "error": {
        "message": f"the rendezvous of {launcher.nnodes} nodes at {launcher.rdzv_endpoint} (id {launcher.rdzv_id}) "
                   f"failed ({found}) within launcher.rdzv_timeout_s={launcher.rdzv_timeout_s:g}: every node must "
                   f"run this command with launcher.nnodes={launcher.nnodes}, its own launcher.node_rank and the same "
                   "endpoint and id, and reach the endpoint's host and port", "phase": "rendezvous"}}


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
