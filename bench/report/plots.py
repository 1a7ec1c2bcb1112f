"""The report's figures (matplotlib, PNG), each with a caption saying unit and method.

Memory figures plot growth over the post-import baseline from 0 (or absolute bytes stacked from 0), max
over ranks; error bars span the repeats (min to max); a line or a group of bars holds every other cell key
fixed and says at what. Runs tagged forced-failure appear in no figure of trained runs.
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from dataclasses import dataclass
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on a cluster node or in CI
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from bench.report.aggregate import stat  # noqa: E402
from bench.report.pairs import KNOBS  # noqa: E402
from bench.results.collect import BREAKDOWN_TERMS, is_forced_failure  # noqa: E402
from bench.results.record import PHASE_ORDER, SETUP_PHASES  # noqa: E402

MIB = 1024.0 * 1024.0
Rows = list[dict[str, Any]]
Cells = dict[str, dict[str, Any]]
KNOB_LABEL = {"zero": "ZeRO stage", "lora": "LoRA rank (0 = full fine-tuning)", "batch": "micro-batch per rank",
              "nproc": "ranks (GPUs, or processes on a CPU host)"}
CONFIG_KEY = {"nproc": "launcher.nproc", "batch": "batch"}
TERM_LABEL = {"process_start": "process start (torch, transformers)",
              "runtime": "engine runtime (its imports, JIT ops, process groups)", "params": "parameters",
              "optimizer": "optimizer state (+ fp32 masters)", "reward_fn": "trlx reward function",
              "rest": "rest (activations, gradients, caches, slack)"}


@dataclass
class Figure:
    path: str
    caption: str


def _save(fig: Any, directory: str, name: str) -> str:
    path = os.path.join(directory, f"{name}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # titles and outside legends are kept whole, never cropped
    plt.close(fig)
    return path


def trained(rows: Rows) -> Rows:
    """Finished runs that are evidence: ok, not forced to fail, not of a cell of mixed provenance."""
    return [r for r in rows if r["status"] == "ok" and not is_forced_failure(r) and not r.get("refused")]


def _free(knob: str):
    """Cell keys a panel lets vary: the knob's and the framework's own (each framework's options)."""
    config_key = CONFIG_KEY.get(knob, knob)
    knob_free = KNOBS.get(knob, lambda key: key == config_key)
    return lambda key: knob_free(key) or KNOBS["framework"](key)


@dataclass
class Panel:
    """One configuration's cells that differ only in the framework and `knob`: every bar or point of a panel
    is one cell, and the panel's title says what is fixed."""
    fixed: str                                  # the shared configuration, in words
    stats: dict[str, dict[Any, Any]]            # framework -> knob value -> Stat of the plotted column
    missing: dict[tuple[str, Any], str]         # (framework, value) measured but not plotted -> its status


def _panel(rows: Rows, all_rows: Rows, cells: Cells, knob: str, column: str) -> Panel | None:
    """Of the configurations whose cells differ only in the framework and `knob`, the one that covers the most
    (framework, knob value) pairs (ties: the most runs); None unless the knob takes two values in it."""
    free = _free(knob)

    def key_of(row: dict[str, Any]) -> str:
        return json.dumps({k: v for k, v in cells[row["cell"]].items() if not free(k)}, sort_keys=True, default=str)

    groups: dict[str, Rows] = {}
    for row in rows:
        if row.get(column) is not None:
            groups.setdefault(key_of(row), []).append(row)
    if not groups:
        return None
    chosen = max(groups.values(), key=lambda runs: (len({(r["framework"], r[knob]) for r in runs}), len(runs)))
    if len({r[knob] for r in chosen}) < 2:
        return None
    stats: dict[str, dict[Any, Any]] = {}
    for framework in sorted({r["framework"] for r in chosen}):
        mine = [r for r in chosen if r["framework"] == framework]
        stats[framework] = {x: stat([r[column] for r in mine if r[knob] == x]) for x in sorted({r[knob] for r in mine})}
    key = key_of(chosen[0])
    missing = {}
    for row in all_rows:
        known = stats.get(row["framework"], {})
        if row["stage"] == chosen[0]["stage"] and key_of(row) == key and row[knob] not in known:
            missing[(row["framework"], row[knob])] = "mixed provenance" if row.get("refused") else row["status"]
    first = chosen[0]
    shown = " ".join(f"{k}={first.get(k)}" for k in ("model", "precision", "zero", "lora", "batch", "nproc")
                     if k != knob)
    return Panel(shown, stats, missing)


def _error(stats: list[Any], scale: float) -> list[list[float]]:
    return [[(s.median - s.low) / scale for s in stats], [(s.high - s.median) / scale for s in stats]]


def _stages(rows: Rows) -> list[str]:
    return [s for s in ("sft", "rm", "ppo") if any(r["stage"] == s for r in rows)]


def _title(ax: Any, text: str) -> None:
    ax.set_title(textwrap.fill(text, 48), fontsize=8)


def _bars(ax: Any, panel: Panel, scale: float) -> None:
    """One bar per cell (median, whisker min to max, n above it); a cell that ran but did not finish is named."""
    values = sorted({x for by in panel.stats.values() for x in by} | {x for _, x in panel.missing}, key=str)
    frameworks = sorted(set(panel.stats) | {f for f, _ in panel.missing})
    width = 0.8 / max(len(frameworks), 1)
    top = max((s.high / scale for by in panel.stats.values() for s in by.values()), default=1.0)
    for i, framework in enumerate(frameworks):
        by = panel.stats.get(framework, {})
        xs = [values.index(x) + i * width for x in by]
        ax.bar(xs, [s.median / scale for s in by.values()], width, color=f"C{i}", label=framework,
               yerr=_error(list(by.values()), scale), capsize=3)
        for x, s in zip(xs, by.values(), strict=True):
            ax.text(x, s.high / scale + 0.01 * top, f"n={s.n}", ha="center", va="bottom", fontsize=6)
        for (f, value), status in panel.missing.items():
            if f == framework:
                ax.text(values.index(value) + i * width, 0.02 * top, status, rotation=90, ha="center", va="bottom",
                        fontsize=6, color=f"C{i}")
    ax.set_xticks([j + width * (len(frameworks) - 1) / 2 for j in range(len(values))], [str(v) for v in values])
    ax.set_ylim(bottom=0, top=top * 1.25)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _knob_label(knob: str, rows: Rows) -> str:
    """The axis's label; LoRA rank 0 is full fine-tuning except for a framework that freezes part of the model
    without LoRA (trlx's hydra policy: finetune `partial`), whose bars at 0 the label names."""
    partial = sorted({r["framework"] for r in rows if not r["lora"] and r.get("finetune") == "partial"})
    if knob != "lora" or not partial:
        return KNOB_LABEL[knob]
    return f"LoRA rank (0 = no LoRA: full fine-tuning;\n{', '.join(partial)} at 0: partial freezing, top blocks only)"


def memory_by(rows: Rows, cells: Cells, directory: str, knob: str) -> list[Figure]:
    """Growth over the post-import baseline (MiB, max over ranks and the phases after imports) against `knob`,
    one cell per bar, bars from 0."""
    ok = [r for r in trained(rows) if r.get("growth_bytes") is not None]
    panels = {s: p for s in _stages(ok) if (p := _panel([r for r in ok if r["stage"] == s], rows, cells, knob,
                                                         "growth_bytes"))}
    if not panels:
        return []
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False)
    for ax, (stage, panel) in zip(axes[0], panels.items(), strict=True):
        _bars(ax, panel, MIB)
        ax.set_xlabel(_knob_label(knob, [r for r in ok if r["stage"] == stage]))
        ax.set_ylabel("growth over post-import baseline, MiB\n(max over ranks and phases after imports)", fontsize=8)
        _title(ax, f"{stage}: {panel.fixed}")
    return [Figure(_save(fig, directory, f"memory_by_{knob}"),
                   f"Memory growth against {KNOB_LABEL[knob]}, per stage: MiB over each rank's post-import baseline, "
                   "max over ranks and the phases after imports, host RSS on a CPU / device memory on a GPU. Each bar "
                   "is one cell (the panel's title names the configuration they share; only the framework and the "
                   "knob differ): its median over the cell's repeats, whisker = min to max, n above it. A cell that "
                   "ran but did not finish is named by its status at the bar's place." + _partial_note(knob, ok))]


def _partial_note(knob: str, rows: Rows) -> str:
    partial = sorted({r["framework"] for r in rows if not r["lora"] and r.get("finetune") == "partial"})
    if knob != "lora" or not partial:
        return ""
    return (f" At LoRA rank 0 {', '.join(partial)} trains only part of its model (partial freezing: its hydra "
            "policy's top blocks), so its bars there are not full fine-tuning.")


def _measured_rate(row: dict[str, Any]) -> float | None:
    rate = row.get("samples_per_s_step")
    return rate / (row.get("nproc") or 1) if rate else None


def _lines(ax: Any, panel: Panel, scale: float) -> None:
    for i, (framework, by) in enumerate(panel.stats.items()):
        n = sorted({s.n for s in by.values()})
        ax.errorbar(list(by), [s.median / scale for s in by.values()], yerr=_error(list(by.values()), scale),
                    marker="o", capsize=3, color=f"C{i}", label=f"{framework} (n={'/'.join(map(str, n))} a point)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def throughput_vs(rows: Rows, cells: Cells, directory: str, knob: str) -> list[Figure]:
    ok = [dict(r, samples_per_s_per_rank=_measured_rate(r)) for r in trained(rows) if _measured_rate(r)]
    panels = {s: p for s in _stages(ok) if (p := _panel([r for r in ok if r["stage"] == s], rows, cells, knob,
                                                         "samples_per_s_per_rank"))}
    if not panels:
        return []
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.6), squeeze=False)
    for ax, (stage, panel) in zip(axes[0], panels.items(), strict=True):
        _lines(ax, panel, 1.0)
        ax.set_xlabel(KNOB_LABEL[knob])
        ax.set_ylabel("samples/s per rank (measured, whole steps)", fontsize=8)
        _title(ax, f"{stage}: {panel.fixed}")
    return [Figure(_save(fig, directory, f"throughput_vs_{knob}"),
                   f"Throughput against {KNOB_LABEL[knob]}: measured samples/s per rank (global samples per step / "
                   "step time / ranks, each framework's own update passes), warm-up steps excluded; point = one "
                   "cell's median over its repeats, bar = min to max, n in the legend. The cells of a panel share "
                   "the configuration in its title; only the framework and the knob differ.")]


def memory_vs_ranks(rows: Rows, cells: Cells, directory: str) -> list[Figure]:
    ok = [r for r in trained(rows) if r.get("growth_bytes") is not None]
    panels = {s: p for s in _stages(ok) if (p := _panel([r for r in ok if r["stage"] == s], rows, cells, "nproc",
                                                         "growth_bytes"))}
    if not panels:
        return []
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.6), squeeze=False)
    for ax, (stage, panel) in zip(axes[0], panels.items(), strict=True):
        _lines(ax, panel, MIB)
        ax.set_xticks(sorted({x for by in panel.stats.values() for x in by}))
        ax.set_xlabel(KNOB_LABEL["nproc"])
        ax.set_ylabel("growth over baseline, MiB (max over ranks)", fontsize=8)
        _title(ax, f"{stage}: {panel.fixed}")
    return [Figure(_save(fig, directory, "memory_vs_ranks"),
                   "Memory growth against the number of ranks: MiB over the post-import baseline of the rank that "
                   "peaks (max over ranks and the phases after imports); with ZeRO > 0 the per-rank share of the "
                   "model state falls as ranks grow; point = one cell's median over its repeats, bar = min to max, "
                   "n in the legend; only the framework and the rank count differ within a panel.")]


def _shared_configuration(rows: Rows, cells: Cells) -> tuple[tuple, Rows]:
    """The runs of the one configuration most frameworks share: cells equal in every key but the framework's
    own (the framework comparison's matched set), so bars side by side differ only in the framework."""
    free = KNOBS["framework"]
    by_config: dict[str, Rows] = {}
    for r in rows:
        key = json.dumps({k: v for k, v in cells[r["cell"]].items() if not free(k)}, sort_keys=True, default=str)
        by_config.setdefault(key, []).append(r)
    chosen = max(by_config.values(), key=lambda runs: (len({r["framework"] for r in runs}), len(runs)))
    return tuple(chosen[0].get(k) for k in ("model", "precision", "zero", "lora", "batch", "nproc")), chosen


def memory_breakdown(rows: Rows, cells: Cells, directory: str) -> list[Figure]:
    """Stacked per-phase peak per framework, for each stage at the configuration most frameworks share."""
    ok = [r for r in trained(rows) if r.get("peak_phase")]
    figures = []
    for stage in _stages(ok):
        rows_s = [r for r in ok if r["stage"] == stage]
        config, chosen = _shared_configuration(rows_s, cells)
        frameworks = sorted({r["framework"] for r in chosen})
        phases = [p for p in PHASE_ORDER if p not in SETUP_PHASES and p != "evaluation"
                  and any(r.get(f"process_start_{p}_bytes") is not None for r in chosen)]
        if not phases:
            continue
        fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(frameworks) * len(phases)), 4.2))
        labels, positions, x = [], [], -1
        shown: set[str] = set()  # terms already in the legend; a term that holds nothing in the panel gets none
        for framework in frameworks:
            runs = [r for r in chosen if r["framework"] == framework]
            x += 1  # a gap between frameworks
            for phase in phases:
                if all(r.get(f"process_start_{phase}_bytes") is None for r in runs):
                    continue  # a phase this framework does not have (only coati shuttles models)
                x += 1
                bottom = 0.0
                for k, term in enumerate(BREAKDOWN_TERMS):
                    value = stat([r.get(f"{term}_{phase}_bytes") for r in runs]).median or 0.0
                    label = TERM_LABEL[term] if value and term not in shown else None  # one entry per term
                    shown |= {term} if value else set()
                    ax.bar(x, value / MIB, bottom=bottom, color=f"C{k}", label=label)
                    bottom += value / MIB
                positions.append(x)
                labels.append(f"{framework}\n{phase}\nn={len(runs)}")
        ax.set_xticks(positions, labels, fontsize=7)
        ax.set_ylabel("peak MiB of the rank that peaks\n(median over the cell's n runs)", fontsize=8)
        _title(ax, f"{stage}: model={config[0]} {config[1]} zero={config[2]} lora={config[3]} batch={config[4]} "
                   f"x{config[5]} ranks")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        figures.append(Figure(_save(fig, directory, f"memory_breakdown_{stage}"),
                              f"Where {stage}'s memory goes, per framework and phase: the phase's peak (MiB, the rank "
                              "with the highest peak, median over repeats) stacked from 0 as the process start "
                              "(torch and transformers imported), the engine runtime (its libraries, JIT ops and "
                              "process groups: the two make up the baseline growth is measured from), parameters "
                              "and optimizer state (bytes the engines hold, split by their own counts; read after the "
                              "last step), trlx's reward function, and the rest (activations, gradients, caches, "
                              "logits, buckets, allocator slack: the peak minus the others)."))
    return figures


TIMELINE_STEPS = 10  # more steps than this leave no room to read a phase: the first ones are drawn


def ppo_memory_timeline(rows: Rows, records: dict[str, dict[str, Any]], cells: Cells, directory: str
                        ) -> list[Figure]:
    """Per-step, per-phase peak of one ok PPO run per framework at one shared configuration, aligned by phase."""
    ppo = [r for r in trained(rows) if r["stage"] == "ppo" and
           ((records[r["run"]]["stages"]["ppo"].get("memory") or {}).get("timeline"))]
    if not ppo:
        return []
    config, chosen = _shared_configuration(ppo, cells)
    phases = [p for p in PHASE_ORDER if any(s["phase"] == p for r in chosen
                                            for s in records[r["run"]]["stages"]["ppo"]["memory"]["timeline"])]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    ran = 1 + max(s["step"] for r in chosen for s in records[r["run"]]["stages"]["ppo"]["memory"]["timeline"])
    steps = min(ran, TIMELINE_STEPS)
    for framework in sorted({r["framework"] for r in chosen}):
        run = next(r["run"] for r in chosen if r["framework"] == framework)
        timeline = records[run]["stages"]["ppo"]["memory"]["timeline"]
        measured = {s["step"] * len(phases) + phases.index(s["phase"]): s["peak_bytes"] / MIB for s in timeline
                    if s["peak_bytes"] is not None and s["step"] < steps}
        # a slot not measured is a gap (NaN), so no line is drawn across it
        slots = range(steps * len(phases))
        ax.plot(list(slots), [measured.get(x, float("nan")) for x in slots], marker="o", markersize=3,
                label=framework)
    warmup = min((records[r["run"]].get("config") or {}).get("warmup_steps") or 0 for r in chosen)
    if warmup:
        ax.axvspan(-0.5, min(warmup, steps) * len(phases) - 0.5, color="grey", alpha=0.15, linewidth=0)
        ax.text(-0.3, 0, f"warm-up ({warmup} step{'s' if warmup > 1 else ''}, untimed)", fontsize=6,
                va="bottom")
    # the first step's ticks name its phases in full (rotated to fit); the later steps repeat the order
    ax.set_xticks(range(steps * len(phases)), [phases[i % len(phases)] if i // len(phases) == 0 else ""
                                               for i in range(steps * len(phases))], fontsize=6, rotation=60)
    for step in range(1, steps):
        ax.axvline(step * len(phases) - 0.5, color="grey", linewidth=0.4)
    shown = f"the first {steps} of {ran} PPO steps" if ran > steps else "PPO steps"
    ax.set_xlabel(f"{shown} (grey lines), each split into its phases: {', '.join(phases)}")
    ax.set_ylabel("phase peak MiB (max over ranks)", fontsize=8)
    ax.set_ylim(bottom=0)
    _title(ax, f"model={config[0]} {config[1]} zero={config[2]} lora={config[3]} batch={config[4]} x{config[5]} "
               "ranks (one run, seed-ordered first, per framework)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return [Figure(_save(fig, directory, "ppo_memory_timeline"),
                   "PPO memory over time, one run per framework at one shared configuration: each step's phases in "
                   "the same slots for every framework, so a phase compares across frameworks (at most the first "
                   f"{TIMELINE_STEPS} steps); value = the phase's "
                   "absolute peak (MiB, max over ranks), y from 0. A phase with no point was not measured in that "
                   "step: it started above its own floor and the heap was not handed back first, so it records only "
                   "an upper bound (memory_release_every: the first two runs of a phase and at least one in every "
                   "4 are measured); the line breaks there rather than join its neighbours. The shaded steps are the "
                   "warm-up, which the throughput figures leave out.")]


Curves = dict[str, dict[str, list[list[float]]]]  # panel title -> cell label -> one curve per run


MAIN_KEYS = ("model", "precision", "zero", "lora", "batch", "launcher.nproc")  # a panel's only cell, in words


def _cell_labels(cells: Cells, ids: list[str]) -> dict[str, str]:
    """Each cell by the keys in which it differs from the panel's other cells; a panel's only cell by its main
    keys (its id where it has none of them)."""
    keys = sorted({k for c in ids for k in cells[c]} - {"stage_row"})
    differing = [k for k in keys if len({json.dumps(cells[c].get(k), default=str) for c in ids}) > 1]
    shown = differing or list(MAIN_KEYS)
    last = [k.split(".")[-1] for k in shown]
    # a key by its last part where that is unambiguous (reference.quant and reward.quant are not)
    name = {k: k.split(".")[-1] if last.count(k.split(".")[-1]) == 1 else k for k in shown}
    return {c: " ".join(f"{name[k]}={cells[c].get(k)}" for k in shown if k in cells[c]) or c for c in ids}


def _curve_panels(panels: Curves, ylabel: str, xlabel: str, directory: str, name: str) -> str:
    """One panel per key; per cell a line at the median over its runs with the min-max band, labelled by what
    sets the cell apart and its n; a red x at the top for each step where a run went non-finite."""
    columns = min(3, len(panels))
    grid = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(grid, columns, figsize=(6.0 * columns, 5.2 * grid), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (title, by_cell) in zip(axes.flat, panels.items(), strict=False):  # spare axes hidden above
        for i, (label, curves) in enumerate(sorted(by_cell.items())):
            steps = min(len(c) for c in curves)
            at = [[c[t] for c in curves if math.isfinite(c[t])] for t in range(steps)]
            middle = [stat(v).median if v else float("nan") for v in at]
            color = f"C{i % 10}"
            ax.plot(range(steps), middle, marker=".", linewidth=1, color=color, label=f"{label} (n={len(curves)})")
            if len(curves) > 1:
                ax.fill_between(range(steps), [min(v) if v else math.nan for v in at],
                                [max(v) if v else math.nan for v in at], color=color, alpha=0.15)
            bad = sorted({t for c in curves for t in range(steps) if not math.isfinite(c[t])})
            if bad:
                ax.plot(bad, [1.0] * len(bad), "x", color="red", transform=ax.get_xaxis_transform(), clip_on=False)
        _title(ax, title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1)
    return _save(fig, directory, name)


def _finite_or_nan(values: list[Any]) -> list[float]:
    return [float(v) if isinstance(v, (int, float)) else float("nan") for v in values]


def _curves(rows: Rows, records: dict[str, dict[str, Any]], cells: Cells, stages: tuple[str, ...], curve_key: str,
            what: str) -> Curves:
    """Per framework and stage, each cell's curves (one per run) of `curve_key` from the finished runs that are
    evidence."""
    by_panel: dict[str, dict[str, list[list[float]]]] = {}
    for row in trained(rows):
        if row["stage"] not in stages:
            continue
        curve = _finite_or_nan((records[row["run"]]["stages"][row["stage"]].get("learning") or {}).get(curve_key)
                               or [])
        if len(curve) > 1:
            title = f"{row['framework']} {row['stage']} {what}"
            by_panel.setdefault(title, {}).setdefault(row["cell"], []).append(curve)
    out: Curves = {}
    for title, by_cell in sorted(by_panel.items()):
        labels = _cell_labels(cells, list(by_cell))
        out[title] = {labels[c]: curves for c, curves in by_cell.items()}
    return out


def loss_curves(rows: Rows, records: dict[str, dict[str, Any]], cells: Cells, directory: str) -> list[Figure]:
    """SFT and RM training loss per step, per cell (median over its runs), forced failures left out."""
    panels = _curves(rows, records, cells, ("sft", "rm"), "loss_curve", "loss")
    if not panels:
        return []
    return [Figure(_curve_panels(panels, "loss (mean over ranks)", "step", directory, "loss_curves"),
                   "SFT and RM training loss per step (mean over ranks), one panel per framework and stage; per cell "
                   "a line at the median over its runs, the band from min to max, the legend naming what sets the "
                   "cell apart in its panel and its n. Runs tagged forced-failure and cells of mixed provenance "
                   "are left out (the stability table shows the failures).")]


def reward_curves(rows: Rows, records: dict[str, dict[str, Any]], cells: Cells, directory: str) -> list[Figure]:
    """PPO reward (RM score) per step, per cell (median over its runs), one panel per framework."""
    panels = _curves(rows, records, cells, ("ppo",), "reward_curve", "reward")
    if not panels:
        return []
    return [Figure(_curve_panels(panels, "reward (RM score, mean over ranks)", "PPO step", directory,
                                 "reward_curves"),
                   "PPO reward (the RM's score of each rollout, mean over ranks) per step, one panel per framework; "
                   "per cell a line at the median over its runs, the band from min to max, the legend naming what "
                   "sets the cell apart and its n; forced failures and cells of mixed provenance left out."
                   + _reward_model_note(rows, records))]


def _reward_model_note(rows: Rows, records: dict[str, dict[str, Any]]) -> str:
    """Where a cell's runs scored with different prerequisite reward models (each seed trains its own), its band
    spans those models as well as PPO's run-to-run noise: say so, with their held-out accuracies."""
    by_cell: dict[str, list[dict[str, Any]]] = {}
    for r in trained(rows):
        if r["stage"] == "ppo" and not is_forced_failure(r):
            by_cell.setdefault(r["cell"], []).append((records[r["run"]].get("prerequisites") or {}).get("rm") or {})
    mixed = {cell: rms for cell, rms in by_cell.items() if len({rm.get("checkpoint") for rm in rms}) > 1}
    if not mixed:
        return ""
    accuracies = sorted({"/".join(f"{rm['accuracy_end']:.2f}" for rm in rms if rm.get("accuracy_end") is not None)
                         for rms in mixed.values()} - {""})
    return (f" In {len(mixed)} of {len(by_cell)} PPO cells each run scored with its own prerequisite reward model "
            "(trained with the run's seed): those bands show reward-model differences as well as PPO's noise"
            + (f" (the models' held-out accuracies, per cell: {'; '.join(accuracies)})" if accuracies else "")
            + ".")


def all_plots(rows: Rows, records: dict[str, dict[str, Any]], cells: Cells, directory: str) -> list[Figure]:
    os.makedirs(directory, exist_ok=True)
    return (memory_breakdown(rows, cells, directory) + memory_by(rows, cells, directory, "zero")
            + memory_by(rows, cells, directory, "lora") + memory_vs_ranks(rows, cells, directory)
            + throughput_vs(rows, cells, directory, "batch") + throughput_vs(rows, cells, directory, "nproc")
            + ppo_memory_timeline(rows, records, cells, directory) + loss_curves(rows, records, cells, directory)
            + reward_curves(rows, records, cells, directory))
