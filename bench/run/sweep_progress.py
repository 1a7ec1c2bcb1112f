"""A progress line over a Hydra sweep: cells ok / failed / skipped / kept, and an ETA from the cells that ran.

A Hydra callback (conf/config.yaml registers it). Each cell's own lines (a progress line per stage, its
table; with verbose=true the ranks' output) scroll in between, so the sweep's progress is printed as one
bar line before and after each cell rather than as a live display that the cells' output would tear. Under
a remote launcher (submitit) the job hooks run inside each job: the sweep total is then printed once, locally.
"""

from __future__ import annotations

import math
import time
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from rich.console import Console

BAR_WIDTH = 24
NOT_RUN = ("skipped", "unsupported", "running-elsewhere")


def sweep_size(task_overrides: list[str]) -> int:
    """How many cells a sweep's command-line overrides expand to (product over the swept keys)."""
    size = 1
    for override in OverridesParser.create().parse_overrides(list(task_overrides)):
        if override.is_sweep_override():
            size *= len(list(override.sweep_string_iterator()))
    return size


class SweepProgress(Callback):
    def __init__(self) -> None:
        self.total = 0
        self.counts = {"ok": 0, "failed": 0, "skipped": 0}
        self.resumed = 0
        self.ran_s: list[float] = []
        self._started = 0.0

    @property
    def console(self) -> Console:
        # made on use, never stored: remote launchers (submitit) pickle the callbacks, and a Console holds a lock
        return Console(stderr=True)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.total = sweep_size(config.hydra.overrides.task)
        self.console.rule(f"[bold]sweep: {self.total} cells[/bold] -> {config.hydra.sweep.dir}")

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._started = time.perf_counter()
        if config.hydra.mode.name == "MULTIRUN":
            self._line(f"cell {config.hydra.job.num + 1}: {config.hydra.job.override_dirname or 'defaults'}")

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if config.hydra.mode.name != "MULTIRUN":
            return
        outcome = str(job_return.return_value) if job_return.status.name == "COMPLETED" else "error"
        status = outcome.split(":")[-1]  # "resumed:<status>" for a cell whose finished record was kept
        self.counts["ok" if status == "ok" else "skipped" if status in NOT_RUN else "failed"] += 1
        if outcome.startswith("resumed:") or outcome == "running-elsewhere":  # this sweep did not run it
            self.resumed += 1
        else:
            self.ran_s.append(time.perf_counter() - self._started)
        self._line(f"last: {outcome}")

    def _line(self, tail: str) -> None:
        finished = sum(self.counts.values())
        total = max(self.total, finished, 1)
        filled = math.floor(BAR_WIDTH * finished / total)
        eta = ""
        if self.ran_s and finished < total:
            eta = f" · ETA {_duration(sum(self.ran_s) / len(self.ran_s) * (total - finished))}"
        c = self.counts
        self.console.print(
            f"[bold]sweep[/bold] [green]{'━' * filled}[/green][dim]{'━' * (BAR_WIDTH - filled)}[/dim] "
            f"{finished}/{total} · ok {c['ok']} · failed {c['failed']} · skipped {c['skipped']} · "
            f"kept {self.resumed}{eta} · {tail}", soft_wrap=True)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
