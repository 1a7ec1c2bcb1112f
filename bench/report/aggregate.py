"""Repeated runs of one cell aggregate to median, range (min to max) and a 95 % confidence interval of the mean.

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
# Cell keys never added to a row's configuration label as "other" keys: the main keys show them, or they follow
# from one that is.
IMPLIED_KEYS = ("stage_row", "stage.name", "stage.stages", "framework.name", "model.name", "precision", "zero",
                "lora", "batch", "launcher.nproc", "tp", "pp", "plugin", "offload", "grad_ckpt", "reference.quant",
                "reward.quant")


# Student's t, two-sided 95 %, by degrees of freedom (n - 1); past 30 the normal 1.96
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
SPREAD_RULE = ("Spread: a value is the median over the cell's repeats (seeds); [low, high] is their range (min to "
               "max) and CI the half-width of the 95 % confidence interval of their mean (Student's t, n - 1 degrees "
               "of freedom); a value without brackets is a single run. A difference counts only where both sides "
               "have n >= 3 and their ranges do not touch; anything else is a tie or undecided.")


@dataclass
class Stat:
    median: float | None
    spread: float | None  # max - min over the cell's runs
    n: int                # runs with a finite value
    low: float | None = None
    high: float | None = None
    ci: float | None = None  # half-width of the 95 % confidence interval of the mean (n >= 2)

    def fmt(self, scale: float = 1.0, digits: int = 1) -> str:
        if self.median is None:
            return "-"
        text = f"{self.median / scale:,.{digits}f}"
        if self.n > 1:
            low, high, ci = self.low / scale, self.high / scale, self.ci / scale
            text += f" [{low:,.{digits}f}, {high:,.{digits}f}] CI±{ci:,.{digits}f} (n={self.n})"
        return text


def stat(values: list[Any]) -> Stat:
    finite = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)
              and math.isfinite(v)]
    if not finite:
        return Stat(None, None, 0)
    n = len(finite)
    t = T_975[n - 2] if n - 1 <= len(T_975) else 1.96
    ci = t * statistics.stdev(finite) / math.sqrt(n) if n > 1 else None
    return Stat(statistics.median(finite), max(finite) - min(finite), n, min(finite), max(finite), ci)


MIN_REPEATS = 3  # runs (seeds) per side before a difference can be judged against the spread


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
