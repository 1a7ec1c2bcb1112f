"""Builds the JIT ops that runs load, once, at set-up (scripts/setup.sh): DeepSpeed's FusedAdam and CPUAdam (and on
the CPU its shared-memory collectives, which every DeepSpeed init loads) into the project's JIT folder
(bench.run.jit_builds), and ColossalAI's CPU Adam kernel into ColossalAI's own. A run or a test then loads them in
about a second instead of building them for 1-2 minutes inside its timeout, beside whatever else the machine runs.

Each op builds in a process of its own, as many at once as the machine has cores (up to one per op), through the
engines' own builders and the stale-lock guard. An op that cannot build here (a GPU machine without nvcc, say) is
reported and left to build at first use, where its error belongs to that run: set-up does not fail for it.

    .venv/bin/python scripts/build_ops.py            # all of them
    .venv/bin/python scripts/build_ops.py fused_adam # one (the names below)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.run import jit_builds  # noqa: E402

OPS = ("deepspeed_shm_comm", "fused_adam", "cpu_adam", "colossalai_cpu_adam")
DEEPSPEED_BUILDERS = {"deepspeed_shm_comm": "ShareMemCommBuilder", "fused_adam": "FusedAdamBuilder",
                      "cpu_adam": "CPUAdamBuilder"}
BUILD_TIMEOUT_S = 1200  # a first build takes 1-2 minutes on 2 cores; a stuck compiler must not hang set-up


def build(op: str) -> str:
    """Builds (or loads, when already built) one op in this process; what happened, in a few words."""
    jit_builds.install()
    if op == "colossalai_cpu_adam":
        import torch

        if not torch.cuda.is_available():
            from adapters.colossalai import cpu_compat

            cpu_compat.apply()
        from colossalai.kernel.kernel_loader import CPUAdamLoader

        CPUAdamLoader().load()
        return "ready"
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(DEEPSPEED_BUILDERS[op])
    if builder is None or (op == "deepspeed_shm_comm" and get_accelerator().device_name() != "cpu"):
        return "not used on this accelerator"
    builder.load()
    return "ready"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:  # a worker process of the call below
        print(build(argv[1]), flush=True)
        return 0
    unknown = [op for op in argv if op not in OPS]
    if unknown:
        print(f"build_ops: unknown op(s) {', '.join(unknown)}; the ops are {', '.join(OPS)}", file=sys.stderr)
        return 2
    jit_builds.use_cache_dir()
    log_dir = os.path.join(sys.prefix, "build-ops-logs")
    os.makedirs(log_dir, exist_ok=True)

    def one(op: str) -> str:
        started = time.monotonic()
        log = os.path.join(log_dir, f"{op}.log")
        try:
            with open(log, "w") as out:
                done = subprocess.run([sys.executable, __file__, "--one", op], stdout=subprocess.PIPE, stderr=out,
                                      text=True, timeout=BUILD_TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
        except subprocess.TimeoutExpired:
            return f"{op}: still building after {BUILD_TIMEOUT_S} s, stopped; it builds at first use (log: {log})"
        took = f"{time.monotonic() - started:.0f} s"
        if done.returncode != 0:
            return f"{op}: could not build here ({took}); it builds at first use (log: {log})"
        return f"{op}: {done.stdout.strip().splitlines()[-1]} ({took})"

    ops = argv or list(OPS)
    workers = max(1, min(len(ops), os.cpu_count() or 1))
    print(f"setup: JIT ops into {os.environ.get(jit_builds.CACHE_VARIABLE, 'torch default folder')} "
          f"(a first build takes 1-2 min; {workers} at a time)", flush=True)
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for line in pool.map(one, ops):
            print(f"setup: JIT op {line}", flush=True)
    print(f"setup: JIT ops done in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
