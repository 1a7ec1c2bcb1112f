"""Each framework against the plain-PyTorch reference: what the framework costs over the simplest correct
implementation, as ratios.

In every matched set (cells that differ only in the framework) that holds the reference, each framework's
step time per phase, tokens/s per phase and peak growth per phase are divided by the reference's. Repeats
are paired by seed (bench.perf runs them interleaved, so a pair ran side by side and shares the machine's
drift); a ratio is the median over pairs with its range. Above 1 means more time, more tokens/s or more
memory than plain PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.report.aggregate import stat
from bench.report.pairs import matched_sets
from bench.report.tables import Table
from bench.results.collect import YARDSTICK
from bench.results.record import OUTSIDE_STEP, PHASE_ORDER, SETUP_PHASES

Row = dict[str, Any]
METRICS = (("time_s_per_step", "step time"), ("tokens_per_s", "tokens/s"), ("growth", "peak growth"))


@dataclass
class Ratio:
    fixed: str  # the shared configuration, in words
    framework: str
    phase: str
    metric: str
    median: float
    low: float
    high: float
    pairs: int


def _column(metric: str, phase: str) -> str:
    return f"growth_{phase}_bytes" if metric == "growth" else f"{metric}_{phase}"


def ratios(rows: list[Row], cells: dict[str, dict[str, Any]], stage: str) -> list[Ratio]:
    found = []
    for matched in matched_sets(rows, cells, "framework", stage):
        reference = {r["seed"]: r for r in matched.by_value.get(YARDSTICK, [])}
        if not reference:
            continue
        for framework, runs in matched.by_value.items():
            if framework == YARDSTICK:
                continue
            for phase in PHASE_ORDER:
                if phase in OUTSIDE_STEP or phase == "imports":
                    continue
                for metric, label in METRICS:
                    if phase in SETUP_PHASES and metric != "growth":
                        continue  # init runs once: no per-step rate
                    column = _column(metric, phase)
                    values = [r[column] / reference[r["seed"]][column] for r in runs
                              if r["seed"] in reference and r.get(column) is not None
                              and reference[r["seed"]].get(column)]
                    if values:
                        s = stat(values)
                        found.append(Ratio(matched.fixed, framework, phase, label, s.median, s.low, s.high,
                                           len(values)))
    return found


def yardstick_tables(rows: list[Row], cells: dict[str, dict[str, Any]]) -> list[Table]:
    """The ratio table; none when no cell holds both the reference and a framework."""
    body = []
    for stage in ("sft", "rm", "ppo"):
        by_key: dict[tuple[str, str, str], dict[str, Ratio]] = {}
        for ratio in ratios(rows, cells, stage):
            by_key.setdefault((ratio.fixed, ratio.framework, ratio.phase), {})[ratio.metric] = ratio
        for (fixed, framework, phase), metrics in by_key.items():
            shown = [f"{m.median:.2f} [{m.low:.2f}, {m.high:.2f}]" if (m := metrics.get(label)) else "-"
                     for _, label in METRICS]
            body.append([stage, fixed, framework, phase, *shown, str(max(m.pairs for m in metrics.values()))])
    if not body:
        return []
    return [Table("yardstick", "Each framework against the plain-PyTorch reference",
                  f"Ratios to the reference (`framework={YARDSTICK}`: the same models, data and PPO arithmetic in "
                  "plain PyTorch on DDP / FSDP2) in cells that differ only in the framework, runs paired by seed: "
                  "median over pairs [min, max]. Step time: seconds of the phase per step on rank 0; tokens/s: the "
                  "phase's global rate; peak growth: MiB over the post-import baseline, max over ranks. Above 1: "
                  "slower, faster or heavier than plain PyTorch, in that order.",
                  ["stage", "configuration", "framework", "phase", "step time x", "tokens/s x", "peak growth x",
                   "pairs"], body)]
