"""Repeated runs of one cell aggregate to median and spread (max - min).

A cell is the whole resolved configuration of a stage row minus the seed and bookkeeping keys
(bench.results.collect.cell_config): runs that differ in learning rate, lengths, steps, device, optimizer or any
framework option are different cells, never repeats of one.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from bench.results.collect import CONFIG_COLUMNS

CELL_COLUMNS = tuple(c for c in CONFIG_COLUMNS if c != "seed")
# Cell keys never shown as "other config": the main columns show them, or they follow from one that is.
IMPLIED_KEYS = ("stage_row", "stage.name", "stage.stages", "framework.name", "model.name", "precision", "zero",
                "lora", "batch", "launcher.nproc", "tp", "pp", "plugin", "offload", "grad_ckpt", "reference.quant",
                "reward.quant")


@dataclass
class Stat:
    median: float | None
    spread: float | None  # max - min over the cell's runs
    n: int                # runs with a finite value
    low: float | None = None
    high: float | None = None

    def fmt(self, scale: float = 1.0, digits: int = 1) -> str:
        if self.median is None:
            return "-"
        text = f"{self.median / scale:,.{digits}f}"
        if self.n > 1:
            text += f" ±{self.spread / scale / 2:,.{digits}f} (n={self.n})"
        return text


def stat(values: list[Any]) -> Stat:
    finite = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)
              and math.isfinite(v)]
    if not finite:
        return Stat(None, None, 0)
    return Stat(statistics.median(finite), max(finite) - min(finite), len(finite), min(finite), max(finite))


def overlap(a: Stat, b: Stat) -> bool:
    """Whether two cells' [min, max] intervals over their repeats touch."""
    return a.low <= b.high and b.low <= a.high


def cell_of(row: dict[str, Any]) -> str:
    return row["cell"]


def group(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Rows by cell, in a stable order: framework, stage, then the rest of the shown config, then the cell id."""
    cells: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        cells.setdefault(cell_of(row), []).append(row)
    return dict(sorted(cells.items(), key=lambda item: (tuple(str(item[1][0].get(c)) for c in CELL_COLUMNS),
                                                         item[0])))


def distinguishing_keys(rows: list[dict[str, Any]], cells: dict[str, dict[str, Any]]) -> list[str]:
    """Cell keys that tell apart two cells the main columns show alike: the tables must show them."""
    shown: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        shown.setdefault(tuple(str(row.get(c)) for c in CELL_COLUMNS), []).append(cells.get(row["cell"], {}))
    keys: set[str] = set()
    for configs in shown.values():
        for key in set().union(*configs) - set(IMPLIED_KEYS):
            if len({json_text(c.get(key)) for c in configs}) > 1:
                keys.add(key)
    return sorted(keys)


def json_text(value: Any) -> str:
    return "-" if value is None else str(value)


def other_config(row: dict[str, Any], cells: dict[str, dict[str, Any]], keys: list[str]) -> str:
    config = cells.get(row["cell"], {})
    return " ".join(f"{k}={json_text(config.get(k))}" for k in keys) or "-"


def per_gpu(row: dict[str, Any]) -> float | None:
    """samples/s at one update pass (PPO) or per step, divided by the ranks (GPUs) the run used."""
    speed = row.get("samples_per_s_one_pass") or row.get("samples_per_s_step")
    return speed / (row.get("nproc") or 1) if speed else None


def status_of(rows: list[dict[str, Any]]) -> str:
    """One status for a cell: 'ok' when all runs are, else the statuses with their counts."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    if len(counts) == 1:
        status = next(iter(counts))
        return status if counts[status] == 1 else f"{status} x{counts[status]}"
    return ", ".join(f"{s} x{n}" for s, n in sorted(counts.items()))
