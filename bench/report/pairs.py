"""Matched sets: cells that differ in exactly one knob, the only comparison a claim may rest on.

Rows are grouped by their cell's configuration minus the knob's keys (a framework comparison frees every
`framework.*` key: each framework's options are part of what is compared). Only finished runs that were not
forced to fail take part. A set holds every value of the knob measured at that one configuration.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.report.aggregate import MIN_REPEATS, Stat, overlap, stat
from bench.results.collect import is_forced_failure

Row = dict[str, Any]
Cells = dict[str, dict[str, Any]]
DESCRIBED = ("stage", "model", "precision", "zero", "lora", "batch", "nproc", "framework")

KNOBS: dict[str, Callable[[str], bool]] = {
    "framework": lambda key: key == "framework.name" or key.startswith("framework."),
    "zero": lambda key: key == "zero",
    "lora": lambda key: key == "lora",
    "grad_ckpt": lambda key: key == "grad_ckpt",
    "precision": lambda key: key == "precision",
    "quant": lambda key: key in ("reference.quant", "reward.quant", "quant_library"),
    "normalize": lambda key: key == "reward.normalize",
    "allgather_bucket": lambda key: key == "ds.allgather_bucket_size",
    "lora_targets": lambda key: key == "lora_targets",
    "lora_alpha": lambda key: key == "lora_alpha",
    "grad_accum": lambda key: key == "grad_accum",
}


@dataclass
class MatchedSet:
    knob: str
    fixed: str                         # the shared configuration, in words
    by_value: dict[Any, list[Row]]     # knob value -> the cell's runs

    def stats(self, column: str) -> dict[Any, Stat]:
        return {value: stat([r.get(column) for r in runs]) for value, runs in self.by_value.items()}


def evidence_rows(rows: list[Row]) -> list[Row]:
    """Rows a claim may use: finished (ok), not tagged forced-failure, not of a cell whose runs differ in
    provenance (commit, dirty tree, host type, versions, measurement settings) unless the report allows it."""
    return [r for r in rows if r["status"] == "ok" and not is_forced_failure(r) and not r.get("refused")]


def matched_sets(rows: list[Row], cells: Cells, knob: str, stage: str | None = None) -> list[MatchedSet]:
    """Sets of cells, each differing from the others only in `knob` (at least two values per set)."""
    free = KNOBS[knob]
    groups: dict[str, dict[Any, list[Row]]] = {}
    for row in evidence_rows(rows):
        if stage is not None and row["stage"] != stage:
            continue
        config = cells[row["cell"]]
        key = json.dumps({k: v for k, v in config.items() if not free(k)}, sort_keys=True, default=str)
        groups.setdefault(key, {}).setdefault(row[knob], []).append(row)
    sets = []
    for by_value in groups.values():
        if len(by_value) > 1:
            first = next(iter(by_value.values()))[0]
            fixed = " ".join(f"{c}={first.get(c)}" for c in DESCRIBED if c != knob)
            sets.append(MatchedSet(knob, fixed, dict(sorted(by_value.items(), key=lambda kv: str(kv[0])))))
    return sorted(sets, key=lambda s: s.fixed)


def tied(a: Stat, b: Stat) -> bool:
    """Within noise: the runs' [min, max] intervals touch (a single run is its own point)."""
    return a.median is None or b.median is None or overlap(a, b)


FEW, TIE_, HIGHER, LOWER = "few", "tie", "higher", "lower"


def compare(a: Stat, b: Stat) -> str:
    """How `a` stands against `b`: "few" where either side has fewer than MIN_REPEATS runs (no spread to judge
    by), "tie" where their ranges touch, else "higher" or "lower" (beyond the spread)."""
    if a.median is None or b.median is None or min(a.n, b.n) < MIN_REPEATS:
        return FEW
    if overlap(a, b):
        return TIE_
    return HIGHER if a.median > b.median else LOWER


def describe(matched: MatchedSet, column: str, scale: float = 1.0, unit: str = "", digits: int = 1) -> str:
    """The set's shared configuration and each value's figure with its range, CI and n (n=1 said too)."""
    stats = matched.stats(column)
    parts = ", ".join(f"{matched.knob}={v}: {s.fmt(scale, digits)}{unit}" + (" (n=1)" if s.n == 1 else "")
                      for v, s in stats.items())
    return f"[{matched.fixed}] {parts}"
