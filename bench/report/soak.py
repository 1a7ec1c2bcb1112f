"""Soak runs in the report: each phase's memory verdict, and a figure of the per-step peaks with their fit."""

from __future__ import annotations

import os
from typing import Any

from bench.report.plots import Figure, _save, plt
from bench.report.tables import Table

MIB = 1024.0 * 1024.0
MAX_PANELS = 4  # soak runs drawn; the table lists them all


def _soak_runs(rows: list[dict[str, Any]], records: dict[str, dict[str, Any]]) -> list[tuple[dict, dict]]:
    out = []
    for row in rows:
        trend = ((records[row["run"]]["stages"].get(row["stage"]) or {}).get("memory") or {}).get("trend")
        if trend:
            out.append((row, trend))
    return out


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:+,.1f}"


def soak_table(rows: list[dict[str, Any]], records: dict[str, dict[str, Any]]) -> list[Table]:
    """One line per soak run and phase; no table when no run was a soak."""
    runs = _soak_runs(rows, records)
    if not runs:
        return []
    header = ["run", "framework", "stage", "model", "precision", "zero", "lora", "nproc", "phase", "verdict",
              "MiB / 100 steps", "fitted steps", "retained MiB / 100 steps", "budget crossed at step", "grows in",
              "with it (per 100 steps)"]
    body = []
    for row, trend in runs:
        for phase, t in trend["phases"].items():
            fitted = t.get("fitted_steps")
            with_it = "; ".join(f"{k.removesuffix('_per_100_steps')} {v:+,.1f}" if "tokens" in k else
                                f"{k.removesuffix('_bytes_per_100_steps')} {v / MIB:+,.1f} MiB"
                                for k, v in (t.get("with_it") or {}).items()) or "-"
            body.append([row["run"], row["framework"], row["stage"], row["model"], row["precision"],
                         str(row["zero"]), str(row["lora"]), str(row["nproc"]), phase, t["verdict"],
                         _mib(t.get("bytes_per_100_steps")), f"{fitted[0]}-{fitted[1]}" if fitted else "-",
                         _mib(t.get("retained_bytes_per_100_steps")), str(t.get("budget_crossed_at_step", "-")),
                         trend.get("grows_in") or "-", with_it])
    method = runs[0][1]["method"]
    budgets = sorted({f"{(t['budget_bytes'] or 0) / MIB / 1024:,.1f} GiB ({t['budget_source']})" for _, t in runs})
    return [Table("soak", "Memory over long runs (soak=true)",
                  f"Method: {method}. MiB / 100 steps: the fitted slope of the phase's per-step peak (max over "
                  "ranks). Retained: what the phase's end keeps alive over the end of the phase before it, in live "
                  "allocations (CUDA allocated; CPU malloc's, glibc mallinfo2), mean per step, max over ranks; "
                  "a leak raises every later phase's peak, and `grows in` names the "
                  "phase that keeps the memory. Budget crossed: the step at which the fitted peak passes the "
                  f"per-rank budget: {'; '.join(budgets)}. With it: slopes of what may grow alongside (generated "
                  "tokens per step; on CUDA the caching allocator's slack, reserved - allocated).", header, body)]


def soak_figure(rows: list[dict[str, Any]], records: dict[str, dict[str, Any]], directory: str) -> list[Figure]:
    """Per-step peak of each phase of the first soak runs, with the fitted line over the window."""
    runs = _soak_runs(rows, records)[:MAX_PANELS]
    if not runs:
        return []
    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 4.0), squeeze=False)
    for ax, (row, trend) in zip(axes[0], runs, strict=True):
        timeline = records[row["run"]]["stages"][row["stage"]]["memory"]["timeline"]
        for phase, t in trend["phases"].items():
            points = [(e["step"], e["peak_bytes"] / MIB) for e in timeline
                      if e["phase"] == phase and e["peak_bytes"] is not None]
            (line,) = ax.plot([p[0] for p in points], [p[1] for p in points], ".", markersize=3,
                              label=f"{phase}: {t['verdict']}")
            if t.get("fitted_steps"):
                first, last = t["fitted_steps"]
                slope = t["bytes_per_100_steps"] / 100 / MIB
                end = t["fitted_last_bytes"] / MIB
                ax.plot([first, last], [end - slope * (last - first), end], "-", color=line.get_color(), linewidth=1)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("step")
        ax.set_ylabel("phase peak MiB (max over ranks)")
        ax.set_title(f"{row['framework']} {row['stage']} {row['model']} {row['precision']} z{row['zero']} "
                     f"lora={row['lora']} x{row['nproc']}", fontsize=9)
        ax.legend(fontsize=7)
    os.makedirs(directory, exist_ok=True)
    return [Figure(_save(fig, directory, "soak_memory"),
                   "Soak runs: each phase's peak per step (MiB, max over ranks; y from 0) with its least-squares "
                   "line over the fitted window (after warm-up and the first tenth of the run); the legend gives "
                   "each phase's verdict. The table `Memory over long runs` has the slopes and projections.")]
