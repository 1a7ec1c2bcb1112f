"""Per-step metrics to Weights & Biases (rank 0), when the run asks for it with `wandb=online|offline`.

The record keeps every step in the run's own directory either way; wandb is a viewer, never the source
of the report. Offline mode writes wandb's run files under the stage directory and needs no network.
"""

from __future__ import annotations

import os
from typing import Any

from bench.run.spec import RunSpec


class WandbSteps:
    """Same start / advance / stop interface as the progress bar, so the loop treats both alike."""

    def __init__(self, spec: RunSpec, stage_dir: str, run_name: str) -> None:
        self.spec = spec
        self.stage_dir = stage_dir
        self.run_name = run_name
        self._run: Any = None
        self._step = 0

    def start(self, stage: str, total: int) -> None:
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "rlhf-bench"), mode=self.spec.wandb, dir=self.stage_dir,
            name=f"{self.run_name}-{stage}", group=self.run_name, job_type=stage, config=self.spec.to_dict(),
            reinit="finish_previous",
        )
        self._run.config.update({"steps_planned": total})

    def advance(self, record: dict[str, Any]) -> None:
        metrics = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self._run.log(metrics, step=self._step)
        self._step += 1

    def stop(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
