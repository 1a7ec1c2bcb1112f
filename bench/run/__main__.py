"""`python -m bench.run [overrides]`: validate the config, run the benchmark, print the result table.

Exit status: 0 when a record was written (its `status` says ok, oom, nan, error, timeout, ...);
2 when the configuration is invalid or unsupported, in which case nothing was launched. Under `-m`
(a sweep) every cell ends in a record and the sweep goes on: an invalid or unsupported cell, a crash of
the harness itself, a cell skipped by the OOM back-stop; a cell whose finished record already exists is
not run again unless `force=true`. `--dry-run` prints what would run (every cell of a sweep, each
validated) and launches nothing (bench/run/dry_run.py).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from rich.console import Console

from bench.measure.environment import provenance
from bench.plan.plan_file import PlanError
from bench.plan.preflight import PreflightRefusal, preflight, resolve_device
from bench.results.record import ResultRecord, StageRecord, utc_now
from bench.results.table import print_record
from bench.run import plan_run
from bench.run.benchmark import RECORD_FILE, record_path, run_benchmark
from bench.run.cli_checks import check_command_line
from bench.run.cli_help import help_text
from bench.run.config import CONF_DIR, compose, to_plain
from bench.run.dry_run import DRY_RUN_FLAG, dry_run
from bench.run.nodes import node_of
from bench.run.spec import STAGE_CHOICES, SpecError, UnsupportedError, spec_from_config
from bench.run.sweep import ELSEWHERE, claim_cell, finished, oom_backstop, read_record

log = logging.getLogger("bench.run")


def _write_outcome(run_dir: str, config: dict, status: str, message: str, phase: str) -> None:
    """A record for a cell that did not run (or whose harness crashed): stages it had keep their records (on
    node k > 0 of a run over several nodes, that node's own view: bench.run.benchmark.record_path)."""
    path = record_path(run_dir, node_of(config))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    record = ResultRecord(run_id=os.path.basename(run_dir), config=config, status=status,
                          error={"message": message, "phase": phase}, environment=provenance())
    for stage in STAGE_CHOICES.get(config["stage"]["name"], (config["stage"]["name"],)):
        record.stages[stage] = StageRecord(status=status, error=record.error)
    partial = read_record(path)
    if partial is not None and isinstance(partial.get("stages"), dict):
        for name, stage in partial["stages"].items():
            record.stages[name] = StageRecord(**stage)
    record.finished_utc = utc_now()
    record.write(path)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def main(cfg: DictConfig) -> str:
    run_dir = HydraConfig.get().runtime.output_dir
    config = to_plain(cfg)
    console = Console()
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        return _run(config, run_dir, console, sweeping=False)
    with claim_cell(run_dir, node_of(config)) as mine:
        if not mine:  # another sweep over the same directory is running this cell now
            console.print(f"[dim]running in another process: {run_dir} -- left to it[/dim]", soft_wrap=True)
            return ELSEWHERE
        done = None if config.get("force") else finished(os.path.join(run_dir, RECORD_FILE))
        if done is not None:
            console.print(f"[dim]already done ({done['status']}): {run_dir} -- force=true runs it again[/dim]",
                          soft_wrap=True)
            return f"resumed:{done['status']}"
        return _run(config, run_dir, console, sweeping=True)


def _run(config: dict, run_dir: str, console: Console, sweeping: bool) -> str:
    try:
        spec = spec_from_config(config)
    except SpecError as err:
        console.print(f"[bold red]invalid configuration:[/bold red] {err}")
        if isinstance(err, UnsupportedError) or sweeping:
            # Keep a record so a sweep shows the cell; a sweep goes on to its next run.
            status = "unsupported" if isinstance(err, UnsupportedError) else "error"
            _write_outcome(run_dir, config, status, str(err), "validation")
        if sweeping:
            return status
        sys.exit(2)
    try:
        spec, found = preflight(spec, spec.preflight, resolve_device(spec)) if spec.preflight != "off" else (spec, None)
    except PreflightRefusal as err:
        console.print(f"[bold red]refused before launch:[/bold red] {err}", soft_wrap=True)
        _write_outcome(run_dir, config, "skipped", str(err), "preflight")
        if sweeping:
            return "skipped"
        sys.exit(2)
    if found and spec.batch != config["batch"]:
        accum = f", grad_accum {config.get('grad_accum', 1)} -> {spec.grad_accum}" if spec.global_batch else ""
        console.print(f"[yellow]preflight=shrink: batch {config['batch']} -> {spec.batch}{accum} "
                      f"({found['verdict']['predicted_peak_bytes'] / 2**30:.2f} GiB predicted)[/yellow]")
        config = {**config, "batch": spec.batch, "grad_accum": spec.grad_accum}
    if sweeping:
        batch = oom_backstop(config, os.path.dirname(run_dir), run_dir)
        if batch is not None:
            console.print(f"[yellow]skipped: this configuration ran out of memory at batch {batch}[/yellow]")
            _write_outcome(run_dir, config, "skipped", f"skipped (oom at batch {batch})", "oom-backstop")
            return "skipped"
    cache_dir = os.path.join(config["output_root"], "cache")
    try:
        record = run_benchmark(spec, run_dir, config, cache_dir, Console(stderr=True), preflight=found)
    except Exception as err:  # noqa: BLE001 -- in a sweep, one cell's crash must not end the others
        if not sweeping:
            raise
        console.print(f"[bold red]harness error:[/bold red] {err}")
        _write_outcome(run_dir, config, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=8)}",
                       "harness")
        return "error"
    print_record(record.to_dict(), record_path(run_dir, spec.launcher.node), console,
                 report_root=os.path.dirname(run_dir))
    return record.status


def cli() -> None:
    """Refuse a command line that cannot work before Hydra writes anything, then run."""
    if any(arg in ("--help", "-h") for arg in sys.argv[1:]):
        print(help_text())
        return
    args = sys.argv[1:]
    dry = DRY_RUN_FLAG in args
    args = [arg for arg in args if arg != DRY_RUN_FLAG]
    try:
        args = plan_run.expand(args, compose([])["framework"]["name"])
        check_command_line(args)
    except (SpecError, PlanError) as err:
        Console().print(f"[bold red]invalid configuration:[/bold red] {err}", soft_wrap=True)
        sys.exit(2)
    if dry:
        sys.exit(dry_run(args, Console()))
    sys.argv = [sys.argv[0], *args]  # Hydra reads the command line: the plan's overrides in place of plan=FILE
    main()


if __name__ == "__main__":
    cli()
