"""`python -m bench.perf`: one configuration through every framework and the plain-PyTorch reference,
interleaved and repeated, then each framework's cost as ratios to the reference.

    python -m bench.perf                                   # glm-base, 2 ranks, PPO bf16 ZeRO-2, 3 rounds
    python -m bench.perf --rounds 2 stage=sft model=tiny   # any run override after the options
    python -m bench.perf --dry-run                         # the order it would run, nothing else

Round r runs each framework once with seed=r, in the same order (A B C R A B C R ...), so a framework and
the reference of one round ran minutes apart and share the machine's drift; the ratios pair them by seed.
Every run is `python -m bench.run` (its own process tree) into results/perf/<name>/runs/r<r>-<framework>;
a failed run is recorded and the rest go on. The ratio table (bench/report/yardstick.py) is printed and
written to perf.md; `python -m bench.report results/perf/<name>` builds the whole report from the same runs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from adapters import registry
from bench.report.yardstick import yardstick_tables
from bench.results.collect import YARDSTICK, collect

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULTS = {"model": "glm-base", "launcher.nproc": "2", "stage": "ppo", "precision": "bf16", "zero": "2",
            "lora": "0", "prompt_len": "128", "answer_len": "128", "batch": "2", "steps": "4",
            "warmup_steps": "1", "stage_steps.rm": "5"}
OWN_KEYS = ("framework", "seed", "output_root", "run_name")  # set per run by bench.perf itself


def plan(frameworks: list[str], rounds: int) -> list[tuple[int, str]]:
    """(seed, framework) in the order they run: every framework once per round."""
    return [(r, f) for r in range(1, rounds + 1) for f in frameworks]


def overrides(extra: list[str]) -> dict[str, str]:
    """The defaults with the user's `key=value` overrides on top (one value per key, as Hydra wants)."""
    merged = dict(DEFAULTS)
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"override {item!r} is not key=value")
        if key.lstrip("+~") in OWN_KEYS:
            raise SystemExit(f"override {item!r}: bench.perf sets {', '.join(OWN_KEYS)} itself (--frameworks, "
                             "--rounds, --name)")
        merged[key] = value
    return merged


def _markdown(table) -> str:
    lines = [f"## {table.title}", "", table.caption, "", "| " + " | ".join(table.header) + " |",
             "|" + "---|" * len(table.header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table.rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.perf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="repeats of every framework (seeds 1..N)")
    parser.add_argument("--frameworks", default=",".join(registry.names()),
                        help=f"comma-separated, must include the reference {YARDSTICK!r} (default: all)")
    parser.add_argument("--name", default=time.strftime("%Y%m%d-%H%M%S"), help="folder under results/perf")
    parser.add_argument("--dry-run", action="store_true", help="print the runs in order and exit")
    parser.add_argument("overrides", nargs="*", help="run overrides, key=value (as for python -m bench.run)")
    args = parser.parse_args(argv)
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    unknown = [f for f in frameworks if f not in registry.names()]
    if unknown:
        parser.error(f"--frameworks: unknown {', '.join(unknown)}; allowed: {', '.join(registry.names())}")
    if YARDSTICK not in frameworks or len(frameworks) < 2:
        parser.error(f"--frameworks={args.frameworks}: ratios need the reference {YARDSTICK!r} and at least one "
                     "framework")
    if args.rounds < 1:
        parser.error(f"--rounds={args.rounds} must be >= 1")
    settings = overrides(args.overrides)
    out = os.path.abspath(os.path.join("results", "perf", args.name))
    runs = plan(frameworks, args.rounds)
    for i, (seed, framework) in enumerate(runs, 1):
        command = [sys.executable, "-m", "bench.run", *(f"{k}={v}" for k, v in settings.items()),
                   f"framework={framework}", f"seed={seed}", f"output_root={out}", f"run_name=r{seed}-{framework}"]
        print(f"[{i}/{len(runs)}] round {seed}: {framework}", flush=True)
        if args.dry_run:
            print("    " + " ".join(command[1:]))
            continue
        done = subprocess.run(command, check=False, cwd=REPO)
        if done.returncode:
            print(f"    {framework} round {seed} exited {done.returncode}: its record says why", flush=True)
    if args.dry_run:
        return 0
    collection = collect(out)
    tables = yardstick_tables(collection.rows, collection.cells)
    text = "".join(_markdown(t) for t in tables) or "No cell holds both the reference and a framework that finished.\n"
    with open(os.path.join(out, "perf.md"), "w") as f:
        f.write(f"# bench.perf {args.name}\n\n{' '.join(f'{k}={v}' for k, v in settings.items())}, "
                f"{args.rounds} round(s)\n\n{text}")
    print(text)
    return 0 if tables else 1


if __name__ == "__main__":
    sys.exit(main())
