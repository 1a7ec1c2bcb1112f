"""The report's figures (matplotlib, PNG), each with a caption saying unit and method.

Memory figures plot growth over the post-import baseline from 0 (or absolute bytes stacked from 0), max
over ranks; error bars span the repeats (min to max); a line or a group of bars holds every other cell key
fixed and says at what. Runs tagged forced-failure appear in no figure of trained runs.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on a cluster node or in CI
import matplotlib.pyplot as plt  # noqa: E402

from bench.report.aggregate import per_gpu, stat  # noqa: E402
from bench.report.pairs import KNOBS  # noqa: E402
from bench.results.collect import BREAKDOWN_TERMS, FORCED_FAILURE, is_forced_failure, tags_of  # noqa: E402
from bench.results.record import PHASE_ORDER, SETUP_PHASES  # noqa: E402

MIB = 1024.0 * 1024.0
Rows = list[dict[str, Any]]
Cells = dict[str, dict[str, Any]]
KNOB_LABEL = {"zero": "ZeRO stage", "lora": "LoRA rank (0 = full fine-tuning)", "batch": "micro-batch per rank",
              "nproc": "ranks (GPUs)"}
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def trained(rows: Rows) -> Rows:
    """Finished runs that are evidence: ok and not forced to fail."""
    return [r for r in rows if r["status"] == "ok" and not is_forced_failure(r)]


def _free(knob: str):
    config_key = CONFIG_KEY.get(knob, knob)
    return KNOBS.get(knob, lambda key: key == config_key)


def _slice(rows: Rows, cells: Cells, knob: str, value: str, framework: str
           ) -> tuple[str, list[Any], list[Any]]:
    """One framework's line against `knob`: of the sets of cells that differ only in `knob`, the one with the
    most knob values (ties: the most runs). Returns (its label, knob values, Stat of `value` per knob value)."""
    free = _free(knob)
    slices: dict[str, Rows] = {}
    for row in rows:
        if row["framework"] == framework and row.get(value) is not None:
            key = json.dumps({k: v for k, v in cells[row["cell"]].items() if not free(k)}, sort_keys=True,
                             default=str)
            slices.setdefault(key, []).append(row)
    if not slices:
        return framework, [], []
    chosen = max(slices.values(), key=lambda runs: (len({r[knob] for r in runs}), len(runs)))
    first = chosen[0]
    shown = {k: first.get(k) for k in ("precision", "zero", "lora", "batch", "nproc") if k != knob}
    label = f"{framework} ({' '.join(f'{k}={v}' for k, v in shown.items())})"
    xs = sorted({r[knob] for r in chosen})
    return label, xs, [stat([r[value] for r in chosen if r[knob] == x]) for x in xs]


def _error(stats: list[Any], scale: float) -> list[list[float]]:
    return [[(s.median - s.low) / scale for s in stats], [(s.high - s.median) / scale for s in stats]]


def _stages(rows: Rows) -> list[str]:
    return [s for s in ("sft", "rm", "ppo") if any(r["stage"] == s for r in rows)]


def memory_by(rows: Rows, cells: Cells, directory: str, knob: str) -> list[Figure]:
    """Growth over the post-import baseline (MiB, max over ranks and phases) against `knob`, bars from 0."""
    ok = [r for r in trained(rows) if r.get("growth_bytes") is not None]
    stages = [s for s in _stages(ok) if len({r[knob] for r in ok if r["stage"] == s}) > 1]  # a knob that moved
    if not stages:
        return []
    fig, axes = plt.subplots(1, len(stages), figsize=(4.6 * len(stages), 3.8), squeeze=False)
    for ax, stage in zip(axes[0], stages, strict=True):
        rows_s = [r for r in ok if r["stage"] == stage]
        frameworks = sorted({r["framework"] for r in rows_s})
        values = sorted({r[knob] for r in rows_s})
        width = 0.8 / max(len(frameworks), 1)
        for i, framework in enumerate(frameworks):
            label, xs, stats = _slice(rows_s, cells, knob, "growth_bytes", framework)
            ax.bar([values.index(x) + i * width for x in xs], [s.median / MIB for s in stats], width, label=label,
                   yerr=_error(stats, MIB), capsize=3)
        ax.set_xticks([j + width * (len(frameworks) - 1) / 2 for j in range(len(values))], [str(v) for v in values])
        ax.set_xlabel(KNOB_LABEL[knob])
        ax.set_ylabel("growth over post-import baseline, MiB\n(max over ranks and phases)", fontsize=8)
        ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * (1.0 + 0.12 * len(frameworks)))  # room for the legend
        ax.set_title(stage)
        ax.legend(fontsize=7, loc="upper left")
    return [Figure(_save(fig, directory, f"memory_by_{knob}"),
                   f"Memory growth against {KNOB_LABEL[knob]}, per stage: MiB over each rank's post-import baseline, "
                   "max over ranks and phases, host RSS on a CPU / device memory on a GPU; bar = median over the "
                   "cell's repeats, whisker = min to max. Each framework's bars hold every other cell key fixed (the "
                   "legend names the main ones).")]


def throughput_vs(rows: Rows, cells: Cells, directory: str, knob: str) -> list[Figure]:
    ok = [dict(r, samples_per_s_per_gpu=per_gpu(r)) for r in trained(rows) if per_gpu(r) is not None]
    stages = _stages(ok)
    if not stages or len({r[knob] for r in ok}) < 2:
        return []
    fig, axes = plt.subplots(1, len(stages), figsize=(4.6 * len(stages), 3.6), squeeze=False)
    for ax, stage in zip(axes[0], stages, strict=True):
        rows_s = [r for r in ok if r["stage"] == stage]
        for framework in sorted({r["framework"] for r in rows_s}):
            label, xs, stats = _slice(rows_s, cells, knob, "samples_per_s_per_gpu", framework)
            ax.errorbar(xs, [s.median for s in stats], yerr=_error(stats, 1.0), marker="o", capsize=3, label=label)
        ax.set_xlabel(KNOB_LABEL[knob])
        ax.set_ylabel("samples/s per GPU (one update pass)")
        ax.set_ylim(bottom=0)
        ax.set_title(stage)
        ax.legend(fontsize=7)
    return [Figure(_save(fig, directory, f"throughput_vs_{knob}"),
                   f"Throughput against {KNOB_LABEL[knob]}: samples/s per GPU (global samples per step / step time / "
                   "ranks; PPO at one update pass per rollout), warm-up steps excluded; point = median over repeats, "
                   "bar = min to max. A line holds every other cell key fixed.")]


def memory_vs_ranks(rows: Rows, cells: Cells, directory: str) -> list[Figure]:
    ok = [r for r in trained(rows) if r.get("growth_bytes") is not None]
    stages = _stages(ok)
    if not stages or len({r["nproc"] for r in ok}) < 2:
        return []
    fig, axes = plt.subplots(1, len(stages), figsize=(4.6 * len(stages), 3.6), squeeze=False)
    for ax, stage in zip(axes[0], stages, strict=True):
        rows_s = [r for r in ok if r["stage"] == stage]
        for framework in sorted({r["framework"] for r in rows_s}):
            label, xs, stats = _slice(rows_s, cells, "nproc", "growth_bytes", framework)
            ax.errorbar(xs, [s.median / MIB for s in stats], yerr=_error(stats, MIB), marker="o", capsize=3,
                        label=label)
        ax.set_xlabel("ranks (GPUs)")
        ax.set_ylabel("growth over baseline, MiB (max over ranks)", fontsize=8)
        ax.set_ylim(bottom=0)
        ax.set_title(stage)
        ax.legend(fontsize=7)
    return [Figure(_save(fig, directory, "memory_vs_ranks"),
                   "Memory growth against the number of ranks: MiB over the post-import baseline of the rank that "
                   "peaks (max over ranks and phases); with ZeRO > 0 the per-rank share of the model state falls as "
                   "ranks grow; median over repeats, bar = min to max.")]


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
                    label = TERM_LABEL[term] if not positions else None  # one legend entry per term
                    ax.bar(x, value / MIB, bottom=bottom, color=f"C{k}", label=label)
                    bottom += value / MIB
                positions.append(x)
                labels.append(f"{framework}\n{phase}")
        ax.set_xticks(positions, labels, fontsize=7)
        ax.set_ylabel("peak MiB of the rank that peaks (median over repeats)", fontsize=8)
        ax.set_title(f"{stage}: model={config[0]} {config[1]} zero={config[2]} lora={config[3]} batch={config[4]} "
                     f"x{config[5]} ranks", fontsize=9)
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
    for framework in sorted({r["framework"] for r in chosen}):
        run = next(r["run"] for r in chosen if r["framework"] == framework)
        timeline = records[run]["stages"]["ppo"]["memory"]["timeline"]
        points = sorted((s["step"] * len(phases) + phases.index(s["phase"]), s["peak_bytes"] / MIB) for s in timeline
                        if s["peak_bytes"] is not None)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=framework)
    steps = 1 + max(s["step"] for r in chosen for s in records[r["run"]]["stages"]["ppo"]["memory"]["timeline"])
    ax.set_xticks(range(steps * len(phases)), [phases[i % len(phases)][:4] if i // len(phases) == 0 else ""
                                               for i in range(steps * len(phases))], fontsize=6)
    for step in range(1, steps):
        ax.axvline(step * len(phases) - 0.5, color="grey", linewidth=0.4)
    ax.set_xlabel(f"PPO steps (grey lines), each split into its phases: {', '.join(phases)}")
    ax.set_ylabel("phase peak MiB (max over ranks)", fontsize=8)
    ax.set_ylim(bottom=0)
    ax.set_title(f"model={config[0]} {config[1]} zero={config[2]} lora={config[3]} batch={config[4]} x{config[5]} "
                 "ranks", fontsize=9)
    ax.legend(fontsize=7)
    return [Figure(_save(fig, directory, "ppo_memory_timeline"),
                   "PPO memory over time, one run per framework at one shared configuration: each step's phases in "
                   "the same slots for every framework, so a phase compares across frameworks; value = the phase's "
                   "absolute peak (MiB, max over ranks), y from 0.")]


def _short_labels(runs: list[str]) -> dict[str, str]:
    """Each run's name (its overrides, comma-separated) without the overrides every run of the panel shares."""
    parts = {run: run.split(",") for run in runs}
    common = set.intersection(*(set(p) for p in parts.values())) if len(runs) > 1 else set()
    return {run: ",".join(p for p in parts[run] if p not in common) or run for run in runs}


def _curve_panels(panels: dict[str, list[tuple[str, list[float]]]], ylabel: str, xlabel: str, directory: str,
                  name: str) -> str:
    """One panel per key; a line per run; a red x at the top for each non-finite step of a run."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5.0 * len(panels), 4.2), squeeze=False)
    for ax, (title, lines) in zip(axes[0], panels.items(), strict=True):
        labels = _short_labels([run for run, _ in lines])
        for run, curve in lines:
            (line,) = ax.plot(range(len(curve)), curve, marker=".", linewidth=1, alpha=0.85, label=labels[run])
            bad = [i for i, v in enumerate(curve) if not math.isfinite(v)]
            if bad:
                ax.plot(bad, [1.0] * len(bad), "x", color="red", transform=ax.get_xaxis_transform(), clip_on=False)
                line.set_label(f"{labels[run]} (non-finite from step {bad[0]})")
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if len(lines) <= 12:
            ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2)
    return _save(fig, directory, name)


def _finite_or_nan(values: list[Any]) -> list[float]:
    return [float(v) if isinstance(v, (int, float)) else float("nan") for v in values]


def _evidence(records: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {run: r for run, r in sorted(records.items()) if FORCED_FAILURE not in tags_of(r["config"])}


def loss_curves(records: dict[str, dict[str, Any]], directory: str) -> list[Figure]:
    """SFT and RM training loss per step of every run that trained (forced failures left out)."""
    panels: dict[str, list[tuple[str, list[float]]]] = {}
    for run, record in _evidence(records).items():
        for stage in ("sft", "rm"):
            result = record["stages"].get(stage) or {}
            curve = _finite_or_nan((result.get("learning") or {}).get("loss_curve") or [])
            if len(curve) > 1 and result.get("status") == "ok":
                panels.setdefault(f"{record['config']['framework']['name']} {stage} loss", []).append((run, curve))
    if not panels:
        return []
    return [Figure(_curve_panels(panels, "loss (mean over ranks)", "step", directory, "loss_curves"),
                   "SFT and RM training loss per step (mean over ranks), one line per finished run, one panel per "
                   "framework and stage; legends name what differs between the panel's runs. Runs tagged "
                   "forced-failure are left out (the stability table shows them).")]


def reward_curves(records: dict[str, dict[str, Any]], directory: str) -> list[Figure]:
    """PPO reward (RM score) per step of every run that trained, one panel per framework."""
    panels: dict[str, list[tuple[str, list[float]]]] = {}
    for run, record in _evidence(records).items():
        result = record["stages"].get("ppo") or {}
        curve = _finite_or_nan((result.get("learning") or {}).get("reward_curve") or [])
        if len(curve) > 1 and result.get("status") == "ok":
            panels.setdefault(f"{record['config']['framework']['name']} PPO reward", []).append((run, curve))
    if not panels:
        return []
    return [Figure(_curve_panels(panels, "reward (RM score, mean over ranks)", "PPO step", directory,
                                 "reward_curves"),
                   "PPO reward (the RM's score of each rollout, mean over ranks) per step, one line per finished "
                   "run; forced failures left out.")]


def all_plots(rows: Rows, records: dict[str, dict[str, Any]], cells: Cells, directory: str) -> list[Figure]:
    os.makedirs(directory, exist_ok=True)
    return (memory_breakdown(rows, cells, directory) + memory_by(rows, cells, directory, "zero")
            + memory_by(rows, cells, directory, "lora") + memory_vs_ranks(rows, cells, directory)
            + throughput_vs(rows, cells, directory, "batch") + throughput_vs(rows, cells, directory, "nproc")
            + ppo_memory_timeline(rows, records, cells, directory) + loss_curves(records, directory)
            + reward_curves(records, directory))
