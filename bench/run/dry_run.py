"""`python -m bench.run --dry-run [-m] OVERRIDES`: what the command would run, checked, with nothing launched
and nothing written.

A single run is validated as a real one is before launch (every key, group choice and value); a sweep is
expanded into its cells as Hydra's basic sweeper expands it (the product of every comma list) and each cell is
validated the same way. Exit status as the real command would give before launching: 2 for an invalid
configuration (in a sweep: any invalid cell) or an unsupported single run, else 0. A sweep's unsupported
cells are listed: the real sweep keeps an `unsupported` record for each and goes on.
"""

from __future__ import annotations

import itertools
import shlex
import sys
from dataclasses import dataclass

from rich.console import Console

from bench.run.cli_checks import MULTIRUN_FLAGS, check_command_line
from bench.run.config import compose
from bench.run.spec import RunSpec, SpecError, UnsupportedError, spec_from_config

DRY_RUN_FLAG = "--dry-run"


@dataclass
class Cell:
    """One run of the command: its overrides and what the real command would do with it."""
    overrides: list[str]
    outcome: str  # run | unsupported | invalid
    detail: str


def expand(overrides: list[str]) -> list[list[str]]:
    """The cells of a sweep: every combination of its comma lists, in Hydra's basic sweeper order."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    options = []
    for override in parsed:
        key = override.get_key_element()
        values = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.value()]
        options.append([f"{key}={value}" for value in values])
    return [list(combo) for combo in itertools.product(*options)]


def describe(spec: RunSpec) -> str:
    """The run in one line, as its result table heads it."""
    lora = f"LoRA {spec.lora}" if spec.lora else "LoRA off"
    steps = ", ".join(f"{stage} {spec.steps[stage]}" for stage in spec.stages)
    nodes = f" x {spec.launcher.nnodes} nodes" if spec.launcher.nnodes > 1 else ""
    return (f"{spec.framework} {spec.stage} · {spec.model.name} · {spec.precision} · ZeRO-{spec.zero} · {lora} · "
            f"batch {spec.batch} x {spec.launcher.nproc} rank(s){nodes} · {spec.prompt_len} + {spec.answer_len} "
            f"tokens · steps: {steps}")


def slurm_job_env(overrides: list[str]) -> dict[str, str] | None:
    """For a cell submitted through hydra/launcher=submitit_slurm: the SLURM_* its first task will see (job id 0,
    task count hydra.launcher.nodes x tasks_per_node), so that a dry run checks the node place the job will read.
    None for any other launcher (the place is this process's)."""
    if "hydra/launcher=submitit_slurm" not in overrides:
        return None
    given = dict(o.split("=", 1) for o in overrides if o.startswith("hydra.launcher.") and "=" in o)
    try:
        tasks = int(given.get("hydra.launcher.nodes", 1)) * int(given.get("hydra.launcher.tasks_per_node", 1))
    except ValueError as err:
        raise SpecError(f"hydra.launcher.nodes and tasks_per_node must be integers ({err})") from None
    return {"SLURM_JOB_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": str(tasks), "SLURM_JOB_NODELIST": "node0"}


def check_cell(overrides: list[str]) -> Cell:
    try:
        spec = spec_from_config(compose([o for o in overrides if not o.startswith("hydra")]), slurm_job_env(overrides))
    except UnsupportedError as err:
        return Cell(overrides, "unsupported", str(err))
    except SpecError as err:
        return Cell(overrides, "invalid", str(err))
    return Cell(overrides, "run", describe(spec))


def dry_run(args: list[str], console: Console) -> int:
    """Print what `python -m bench.run ARGS` would run; the exit status the real command gives before launch."""
    sweeping = any(arg in MULTIRUN_FLAGS for arg in args)
    overrides = [arg for arg in args if not arg.startswith("-")]
    cells = [check_cell(cell) for cell in (expand(overrides) if sweeping else [overrides])]
    for i, cell in enumerate(cells, 1):
        head = f"[{i}/{len(cells)}] {' '.join(cell.overrides)}" if sweeping else "run"
        colour = {"run": "green", "unsupported": "yellow", "invalid": "red"}[cell.outcome]
        console.print(f"{head}\n    [{colour}]{cell.outcome}[/{colour}]: {cell.detail}", soft_wrap=True,
                      highlight=False)
    counts = {outcome: sum(c.outcome == outcome for c in cells) for outcome in ("run", "unsupported", "invalid")}
    console.print(f"dry run: {len(cells)} cell(s), {counts['run']} would run, {counts['unsupported']} unsupported "
                  f"(a record says so), {counts['invalid']} invalid; nothing launched",
                  highlight=False, soft_wrap=True)
    if counts["invalid"] or (not sweeping and counts["unsupported"]):
        return 2
    return 0


def main(lines: list[str], console: Console) -> int:
    """Dry runs of many command lines in one process (scripts/glm_sweep.sh --dry-run): each line holds one
    `bench.run` argument list, shell-quoted. The exit status is the worst of theirs."""
    worst = 0
    for line in lines:
        args = shlex.split(line)
        if not args:
            continue
        console.print(f"$ python -m bench.run --dry-run {line.strip()}", highlight=False, soft_wrap=True)
        try:
            check_command_line(args)
        except SpecError as err:
            console.print(f"[bold red]invalid configuration:[/bold red] {err}", soft_wrap=True)
            worst = 2
            continue
        worst = max(worst, dry_run(args, console))
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.stdin.read().splitlines(), Console()))
