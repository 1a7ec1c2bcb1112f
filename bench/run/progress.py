"""A step progress bar for rank 0 (rich), showing the latest loss or reward as it trains."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class StepProgress:
    def __init__(self) -> None:
        self._progress: Progress | None = None
        self._task = None

    def start(self, stage: str, total: int) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
            console=Console(stderr=True), transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task(stage, total=total, status="")

    def advance(self, record: dict[str, Any]) -> None:
        shown = {k: v for k, v in record.items() if k.startswith("loss/") or k in ("reward", "accuracy")}
        status = "  ".join(f"{k}={v:.4g}" for k, v in shown.items() if isinstance(v, float))
        self._progress.update(self._task, advance=1, status=status)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
