"""Launches one stage as an isolated process tree: torchrun with N ranks of `bench.worker`.

The tree runs in its own session so a timeout kills every rank; its output is copied to the terminal
and to the stage's `worker.log`. Whatever happens, the caller gets the ranks' result files back, or a
failure that says why there are none.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.record import write_json
from bench.spec import RunSpec

REPO = Path(__file__).resolve().parent.parent
LOG_TAIL_LINES = 30


@dataclass
class StageOutcome:
    ranks: list[dict[str, Any]]
    wall_time_s: float
    failure: dict[str, Any] | None  # set when the process tree failed or ranks are missing


def _env(spec: RunSpec) -> dict[str, str]:
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
    return env


def _pump(stream, log, echo: bool) -> None:
    for chunk in iter(lambda: stream.read1(4096), b""):
        log.write(chunk)
        log.flush()
        if echo:
            sys.stderr.buffer.write(chunk)
            sys.stderr.flush()


def _log_tail(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-LOG_TAIL_LINES:])
    except OSError:
        return ""


def launch_stage(spec: RunSpec, stage: str, stage_dir: str, init: dict[str, str], echo: bool = True
                 ) -> StageOutcome:
    stage_dir = os.path.abspath(stage_dir)  # workers run from the repository root
    os.makedirs(stage_dir, exist_ok=True)
    for stale in glob.glob(os.path.join(stage_dir, "rank*.json")):
        os.unlink(stale)
    spec_path = os.path.join(stage_dir, "spec.json")
    write_json(spec_path, spec.to_dict())
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
        f"--nproc_per_node={spec.launcher.nproc}", "-m", "bench.worker", spec_path, stage_dir, stage,
    ]
    for key, path in init.items():
        cmd += [f"--init-{key}", os.path.abspath(path)]
    log_path = os.path.join(stage_dir, "worker.log")
    start = time.perf_counter()
    failure = None
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(spec), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
        pump = threading.Thread(target=_pump, args=(proc.stdout, log, echo), daemon=True)
        pump.start()
        try:
            returncode = proc.wait(timeout=spec.launcher.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            returncode = None
            failure = {"status": "timeout", "error": {
                "message": f"stage {stage} still running after launcher.timeout_s={spec.launcher.timeout_s}; killed",
                "phase": None}}
        except BaseException:  # Ctrl-C in the sweep: the run's own session does not get the terminal's signal
            _kill_tree(proc)
            raise
        pump.join(timeout=10)
    wall = time.perf_counter() - start
    ranks = []
    for path in sorted(glob.glob(os.path.join(stage_dir, "rank*.json"))):
        with open(path) as f:
            ranks.append(json.load(f))
    if failure is None and len(ranks) < spec.launcher.nproc:
        failure = {"status": "error", "error": {
            "message": f"{spec.launcher.nproc - len(ranks)} of {spec.launcher.nproc} ranks wrote no result "
                       f"(exit code {returncode}); log tail:\n{_log_tail(log_path)}",
            "phase": None}}
    return StageOutcome(ranks=ranks, wall_time_s=wall, failure=failure)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the launching process dies, even by SIGKILL. The tree runs in
    its own session (so a timeout can kill all of it), which also shields it from the terminal's signals;
    without this a killed sweep would leave its current run training on. torchrun passes SIGTERM on to
    its ranks. Linux only; elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _kill_tree(proc: subprocess.Popen) -> None:
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
