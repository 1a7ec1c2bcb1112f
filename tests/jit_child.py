"""A process that loads a tiny JIT op through torch's own loader, as DeepSpeed's and ColossalAI's op builders
do, for tests/test_jit_builds.py. Its source includes no torch header, so a build takes a second or two, and the
test's compiler wrapper decides how long it lasts.

    python tests/jit_child.py SOURCE [--unguarded] [--stall-s S --stall-file PATH]

Guarded (the default): bench.run.jit_builds is installed as the worker installs it, with the worker's listener
(a wait re-arms the watchdog with the lock named). Prints `answer=N` from the loaded library."""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from torch.utils import cpp_extension  # noqa: E402

from bench.run import jit_builds  # noqa: E402
from bench.run.watchdog import RankWatchdog  # noqa: E402
from bench.run.worker import lock_listener  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("source")
    parser.add_argument("--unguarded", action="store_true")
    parser.add_argument("--stall-s", type=float, default=600.0)
    parser.add_argument("--stall-file")
    args = parser.parse_args()
    if not args.unguarded:
        watchdog = RankWatchdog(args.stall_file, 0, args.stall_s) if args.stall_file else None
        jit_builds.install(on_wait=lock_listener(None, watchdog))
        if watchdog is not None:
            watchdog.beat("the load began")
    library = cpp_extension.load(name="tiny_op", sources=[args.source], is_python_module=False)
    print(f"answer={ctypes.CDLL(library).answer()}", flush=True)


if __name__ == "__main__":
    main()
