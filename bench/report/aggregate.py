"""Repeated runs of one cell (same config, any seed) aggregate to median and spread (max - min)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from bench.collect import CONFIG_COLUMNS

CELL_COLUMNS = tuple(c for c in CONFIG_COLUMNS if c != "seed")


@dataclass
class Stat:
    median: float | None
    spread: float | None  # max - min over the cell's runs
    n: int                # runs with a finite value

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
    return Stat(statistics.median(finite), max(finite) - min(finite), len(finite))


def cell_of(row: dict[str, Any]) -> tuple:
    return tuple(row.get(c) for c in CELL_COLUMNS)


def group(rows: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    """Rows by cell, in a stable order: framework, stage, then the rest of the config."""
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        cells.setdefault(cell_of(row), []).append(row)
    return dict(sorted(cells.items(), key=lambda item: tuple(str(v) for v in item[0])))


def status_of(rows: list[dict[str, Any]]) -> str:
    """One status for a cell: 'ok' when all runs are, else the statuses with their counts."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    if len(counts) == 1:
        status = next(iter(counts))
        return status if counts[status] == 1 else f"{status} x{counts[status]}"
    return ", ".join(f"{s} x{n}" for s, n in sorted(counts.items()))
