"""What the terminal shows of a stage while it runs: one live line per stage, drawn by the launching process.

The ranks' own output (engine logs, library warnings) goes to the stage's `worker.log` only, unless
`verbose=true`. Rank 0 feeds its progress (notes, phase starts, steps) as JSON lines into the stage's
`progress.jsonl` (ProgressFeed); the launcher turns the feed into a bar (StageDisplay). The bar lives in
the process that owns the terminal because a rank's stderr is a pipe, where rich can only print a bar's
final state.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

FEED_FILE = "progress.jsonl"
POLL_S = 0.25


def step_status(record: dict[str, Any]) -> str:
    """The figures a step shows beside the bar: its losses and its reward or RM accuracy."""
    shown = {k: v for k, v in record.items() if k.startswith("loss/") or k in ("reward", "accuracy")}
    return "  ".join(f"{k}={v:.4g}" for k, v in shown.items() if isinstance(v, float))


class ProgressFeed:
    """Rank 0's side: a StepObserver that also takes phase starts and free notes. One line per event, flushed
    as it is written, so the launcher sees each step when it ends."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 -- open for the rank's life, closed by exit
        self._stopped = False

    def _put(self, **event: Any) -> None:
        self._file.write(json.dumps(event) + "\n")

    def note(self, text: str) -> None:
        self._put(event="note", text=text)

    def jit_op(self, name: str) -> None:
        self.note(f"loading JIT op {name} (its first build takes 1-2 min)")

    def phase(self, name: str) -> None:
        self._put(event="phase", name=name)

    def start(self, stage: str, total: int) -> None:
        self._put(event="start", stage=stage, total=total)

    def advance(self, record: dict[str, Any]) -> None:
        self._put(event="step", status=step_status(record))

    def stop(self) -> None:
        if not self._stopped:  # the loop stops its observers, and the worker again after a failure
            self._stopped = True
            self._put(event="stop")


class StageDisplay:
    """The launcher's side: follows a stage's feed and draws it as one line (spinner, label, bar, steps done,
    elapsed time, then the latest figures or what the stage is doing, which a narrow terminal cuts first).
    Outside a terminal rich prints the line once, in its final state."""

    def __init__(self, console: Console, label: str, feed_path: str) -> None:
        self._feed_path = feed_path
        self._progress = Progress(
            SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("{task.fields[status]}"), console=console, transient=False,
        )
        self._task = self._progress.add_task(label, total=None, status="starting")
        self._offset = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def __enter__(self) -> StageDisplay:
        self._progress.start()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=5)
        self._read()  # the events written between the last poll and the stage's end
        self._progress.stop()

    def _follow(self) -> None:
        while not self._done.wait(POLL_S):
            self._read()

    def _read(self) -> None:
        try:
            with open(self._feed_path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:  # rank 0 has not made it yet
            return
        complete = data[:data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self._offset += len(complete)
        for line in complete.decode().splitlines():
            self.apply(json.loads(line))

    def apply(self, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "note":
            self._progress.update(self._task, status=event["text"])
        elif kind == "phase":
            self._progress.update(self._task, status=event["name"])
        elif kind == "start":
            self._progress.update(self._task, total=event["total"], completed=0, status="")
        elif kind == "step":
            self._progress.update(self._task, advance=1, status=event["status"])


def feed_path(stage_dir: str) -> str:
    return os.path.join(stage_dir, FEED_FILE)
