"""`python -m bench.perf`: one configuration through every framework and the plain-PyTorch reference,
interleaved and repeated, then each framework's cost as ratios to the reference.

    python -m bench.perf                                   # glm-base, 2 ranks, PPO bf16 ZeRO-2, 3 rounds
    python -m bench.perf --rounds 2 stage=sft model=tiny   # any run override after the options
    python -m bench.perf --dry-run                         # the runs in order, each checked; nothing runs

Round r runs each framework once with seed=r, in the same order (A B C R A B C R ...), so a framework and
the reference of one round ran minutes apart and share the machine's drift; the ratios pair them by seed.
Every run is `python -m bench.run` (its own process tree) into <output_root>/perf/<name>/runs/r<r>-<framework>
(output_root as bench.run takes it, default results). Lengths, batch and steps are bench.run's own for the
chosen model, except glm-base, which runs the CPU benchmark's shape (scripts/glm_sweep.sh: 128 + 128 tokens,
batch 2, 1 warm-up + 3 timed steps); a user's overrides win over both. Every run's command line is checked
before the first starts; a run that fails is named with its record's reason and the rest go on. The ratio
table (bench/report/yardstick.py) is printed and written to perf.md (on Ctrl-C too, of the runs finished by
then); the exit status is 1 when a run failed or no ratio could be formed, 2 when a command line is invalid,
130 when interrupted. `python -m bench.report <output_root>/perf/<name>`
builds the whole report from the same runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from adapters import registry
from bench.report.yardstick import yardstick_tables
from bench.results.collect import YARDSTICK, collect
from bench.run.cli_checks import check_command_line
from bench.run.spec import SpecError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULTS = {"model": "glm-base", "launcher.nproc": "2", "stage": "ppo", "precision": "bf16", "zero": "2",
            "lora": "0"}
# The CPU benchmark's shape (scripts/glm_sweep.sh), for its model only: the other presets keep bench.run's
# lengths and steps (the tiny model's 128 positions cannot hold 128 + 128 tokens).
BENCHMARK_SHAPE = {"glm-base": {"prompt_len": "128", "answer_len": "128", "batch": "2", "steps": "4",
                                "warmup_steps": "1", "stage_steps.rm": "5"}}
OWN_KEYS = ("framework", "seed", "run_name")  # set per run by bench.perf itself
DEFAULT_OUTPUT_ROOT = "results"


@dataclass
class Outcome:
    """How one run of the plan ended."""
    seed: int
    framework: str
    exit_code: int
    status: str  # the record's status, or "no record"
    why: str


def plan(frameworks: list[str], rounds: int) -> list[tuple[int, str]]:
    """(seed, framework) in the order they run: every framework once per round."""
    return [(r, f) for r in range(1, rounds + 1) for f in frameworks]


def overrides(extra: list[str]) -> dict[str, str]:
    """The run settings: the defaults, the chosen model's benchmark shape where it has one, then the user's
    `key=value` overrides on top (one value per key, as Hydra wants). output_root is bench.perf's own."""
    given: dict[str, str] = {}
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"override {item!r} is not key=value")
        if key.lstrip("+~") in OWN_KEYS:
            raise SystemExit(f"override {item!r}: bench.perf sets {', '.join(OWN_KEYS)} itself (--frameworks, "
                             "--rounds, --name)")
        given[key] = value
    model = given.get("model", DEFAULTS["model"])
    return {**DEFAULTS, **BENCHMARK_SHAPE.get(model, {}), **given}


def run_command(settings: dict[str, str], out: str, seed: int, framework: str) -> list[str]:
    """The `bench.run` arguments of one run of the plan."""
    return [*(f"{k}={v}" for k, v in settings.items() if k != "output_root"), f"framework={framework}",
            f"seed={seed}", f"output_root={out}", f"run_name=r{seed}-{framework}"]


def invalid_runs(settings: dict[str, str], out: str, frameworks: list[str]) -> list[str]:
    """bench.run's reasons to refuse a run of the plan, each with the frameworks it refuses."""
    refused: dict[str, list[str]] = {}
    for framework in frameworks:
        try:
            check_command_line(run_command(settings, out, 1, framework))
        except SpecError as err:
            refused.setdefault(str(err), []).append(framework)
    return [f"framework={','.join(names)}: {why}" for why, names in refused.items()]


def outcome(out: str, seed: int, framework: str, exit_code: int) -> Outcome:
    """What the run's record says about how it ended."""
    path = os.path.join(out, "runs", f"r{seed}-{framework}", "record.json")
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return Outcome(seed, framework, exit_code, "no record", f"exited {exit_code} and left no readable {path}")
    error = record.get("error") or {}
    why = str(error.get("message", "")).strip().splitlines()[0] if error.get("message") else ""
    return Outcome(seed, framework, exit_code, str(record.get("status")), why or f"exited {exit_code}")


def _markdown(table) -> str:
    lines = [f"## {table.title}", "", table.caption, "", "| " + " | ".join(table.header) + " |",
             "|" + "---|" * len(table.header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table.rows]
    return "\n".join(lines) + "\n"


def _failures(outcomes: list[Outcome]) -> str:
    failed = [o for o in outcomes if o.status != "ok"]
    if not failed:
        return ""
    lines = [f"## Runs that did not finish: {len(failed)} of {len(outcomes)}", "",
             "| round | framework | status | exit | why |", "|---|---|---|---|---|"]
    lines += [f"| {o.seed} | {o.framework} | {o.status} | {o.exit_code} | {o.why.replace('|', '/')} |"
              for o in failed]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.perf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="repeats of every framework (seeds 1..N)")
    parser.add_argument("--frameworks", default=",".join(registry.names()),
                        help=f"comma-separated, must include the reference {YARDSTICK!r} (default: all)")
    parser.add_argument("--name", default=time.strftime("%Y%m%d-%H%M%S"), help="folder under <output_root>/perf")
    parser.add_argument("--dry-run", action="store_true", help="print the runs in order, check them, and exit")
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
    out = os.path.abspath(os.path.join(settings.get("output_root", DEFAULT_OUTPUT_ROOT), "perf", args.name))
    problems = invalid_runs(settings, out, frameworks)
    if problems:
        print("bench.perf: nothing was run; bench.run refuses these command lines:\n  " + "\n  ".join(problems),
              file=sys.stderr)
        return 2
    runs = plan(frameworks, args.rounds)
    heading = (f"# bench.perf {args.name}\n\n{' '.join(f'{k}={v}' for k, v in settings.items())}, "
               f"{args.rounds} round(s), frameworks {', '.join(frameworks)}\n\n")
    if not args.dry_run:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "perf.md"), "w") as f:  # the folder and what it is for, before any run
            f.write(heading + f"Running: {len(runs)} runs, started {time.strftime('%Y-%m-%d %H:%M:%S')}.\n")
    outcomes, interrupted = [], False
    for i, (seed, framework) in enumerate(runs, 1):
        command = [sys.executable, "-m", "bench.run", *run_command(settings, out, seed, framework)]
        print(f"[{i}/{len(runs)}] round {seed}: {framework}", flush=True)
        if args.dry_run:
            print("    python " + " ".join(command[1:]))
            continue
        try:
            done = subprocess.run(command, check=False, cwd=REPO)
        except KeyboardInterrupt:  # the runs before this one keep their table
            interrupted = True
            print(f"\ninterrupted in run {i} of {len(runs)}: the table below is of the runs before it", flush=True)
            break
        outcomes.append(outcome(out, seed, framework, done.returncode))
        if outcomes[-1].status != "ok":
            print(f"    {framework} round {seed}: {outcomes[-1].status} ({outcomes[-1].why})", flush=True)
    if args.dry_run:
        print(f"dry run: {len(runs)} runs into {out}, every command line checked; nothing run")
        return 0
    collection = collect(out)
    tables = yardstick_tables(collection.rows, collection.cells)
    text = "".join(_markdown(t) for t in tables) or "No cell holds both the reference and a framework that finished.\n"
    failures = _failures(outcomes)
    stopped = f"Interrupted after {len(outcomes)} of {len(runs)} runs.\n\n" if interrupted else ""
    with open(os.path.join(out, "perf.md"), "w") as f:
        f.write(heading + stopped + text + ("\n" + failures if failures else ""))
    print(text + ("\n" + failures if failures else ""))
    print(f"written: {os.path.join(out, 'perf.md')}")
    if interrupted:
        return 130
    return 0 if tables and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
