"""Checkpoint stalls in the report: what a save costs training, synchronous against overlapped."""

from __future__ import annotations

from typing import Any

from bench.report.aggregate import group, stat
from bench.report.tables import Cells, ConfigColumns, Table

MIB = 1024.0 * 1024.0


def checkpoint_table(rows: list[dict[str, Any]], cells: Cells) -> list[Table]:
    """One line per cell that saved checkpoints; no table when none did."""
    saving = [r for r in rows if r.get("checkpoint_saves") and r["status"] == "ok"]
    if not saving:
        return []
    config = ConfigColumns(saving, cells)
    header = config.header + ["mode", "stall s per save", "stall / step %", "background write s per save",
                              "MiB per checkpoint", "saves", "runs"] + config.tail
    body = []
    for runs in group(saving).values():
        share = stat([r["checkpoint_stall_s"] / r["step_time_s"] for r in runs
                      if r.get("checkpoint_stall_s") is not None and r.get("step_time_s")])
        write = stat([r.get("checkpoint_write_s") for r in runs])
        body.append(config.values(runs) + [runs[0]["checkpoint_mode"],
                                           stat([r["checkpoint_stall_s"] for r in runs]).fmt(digits=3),
                                           share.fmt(0.01, 1), write.fmt(digits=3) if write.n else "-",
                                           stat([r.get("checkpoint_bytes") for r in runs]).fmt(MIB, 1),
                                           str(sum(r["checkpoint_saves"] for r in runs)), str(len(runs))]
                    + config.tail_values(runs))
    return [Table("checkpoints", "Checkpoint stalls (checkpoint.every)",
                  config.shared()
                  + "Per cell that saved during training: stall = the measured `checkpoint` phase after a save's "
                  "step, max over ranks, median over the run's saves (sync: the framework's save with its "
                  "writes; async: the same save with host copies instead of writes, plus any wait for the "
                  "previous save's writes); stall / step: that over the run's mean step time; background write: "
                  "the writer thread's time per save (async only), which overlaps the following steps; MiB: the "
                  "complete checkpoint directory, every rank's files. Median over the cell's runs [range] CI (n).",
                  header, body)]
