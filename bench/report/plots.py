"""The report's figures (matplotlib, PNG): memory by ZeRO stage and LoRA rank, throughput vs batch, a
PPO run's per-step memory timeline, SFT/RM loss curves, PPO reward curves. Each returns the files it wrote
(none when the sweep has nothing to show for it)."""

from __future__ import annotations

import math
import os
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on a cluster node or in CI
import matplotlib.pyplot as plt  # noqa: E402

from bench.record import PHASE_ORDER  # noqa: E402
from bench.report.aggregate import CELL_COLUMNS, stat  # noqa: E402

MIB = 1024.0 * 1024.0


def _save(fig: Any, directory: str, name: str) -> str:
    path = os.path.join(directory, f"{name}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _slice(rows: list[dict[str, Any]], knob: str, value: str, framework: str
           ) -> tuple[str, list[Any], list[float]]:
    """One framework's line against `knob`: of the configurations that differ only in `knob`, the one with the
    most distinct values (ties: the most runs). Returns (its label, knob values, median `value` per knob value),
    so a line never mixes configurations."""
    slices: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        if row["framework"] == framework and row.get(value) is not None:
            # trlx's reference follows LoRA under reference=auto (hydra <-> peft): it moves with the knob
            free = (knob, "stage", "reference") if knob == "lora" else (knob, "stage")
            key = tuple((c, row.get(c)) for c in CELL_COLUMNS if c not in free)
            slices.setdefault(key, []).append(row)
    if not slices:
        return framework, [], []
    key, chosen = max(slices.items(), key=lambda item: (len({r[knob] for r in item[1]}), len(item[1])))
    shown = {k: v for k, v in key if k in ("precision", "zero", "lora", "batch", "nproc") and k != knob}
    label = f"{framework} ({' '.join(f'{k}={v}' for k, v in shown.items())})"
    xs = sorted({r[knob] for r in chosen})
    return label, xs, [stat([r[value] for r in chosen if r[knob] == x]).median for x in xs]


def memory_by(rows: list[dict[str, Any]], directory: str, knob: str) -> list[str]:
    """Memory growth over the post-import baseline (max over phases, MiB) against `knob` (zero or lora), one
    panel per stage: runs differ in what they build, not in which libraries they import."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("growth_bytes") is not None]
    stages = [s for s in ("sft", "rm", "ppo") if any(r["stage"] == s for r in ok)]
    if not stages or len({r[knob] for r in ok}) < 2:
        return []
    fig, axes = plt.subplots(1, len(stages), figsize=(4.2 * len(stages), 3.4), squeeze=False)
    for ax, stage in zip(axes[0], stages, strict=True):
        rows_s = [r for r in ok if r["stage"] == stage]
        frameworks = sorted({r["framework"] for r in rows_s})
        values = sorted({r[knob] for r in rows_s})
        width = 0.8 / max(len(frameworks), 1)
        for i, framework in enumerate(frameworks):
            label, xs, ys = _slice(rows_s, knob, "growth_bytes", framework)
            ax.bar([values.index(x) + i * width for x in xs], [y / MIB for y in ys], width, label=label)
        ax.set_xticks([j + width * (len(frameworks) - 1) / 2 for j in range(len(values))], [str(v) for v in values])
        ax.set_xlabel("ZeRO stage" if knob == "zero" else "LoRA rank (0 = full fine-tuning)")
        ax.set_ylabel("growth over post-import baseline, MiB\n(max over ranks and phases, median)", fontsize=7)
        ax.set_title(stage)
        ax.set_ylim(top=ax.get_ylim()[1] * (1.0 + 0.12 * len(frameworks)))  # room for the legend above the bars
        ax.legend(fontsize=6, loc="upper left")
    return [_save(fig, directory, f"memory_by_{knob}")]


def throughput_vs_batch(rows: list[dict[str, Any]], directory: str) -> list[str]:
    ok = [r for r in rows if r["status"] == "ok" and r.get("samples_per_s_step") is not None]
    stages = [s for s in ("sft", "rm", "ppo") if any(r["stage"] == s for r in ok)]
    if not stages or len({r["batch"] for r in ok}) < 2:
        return []
    fig, axes = plt.subplots(1, len(stages), figsize=(4.2 * len(stages), 3.4), squeeze=False)
    for ax, stage in zip(axes[0], stages, strict=True):
        rows_s = [r for r in ok if r["stage"] == stage]
        for framework in sorted({r["framework"] for r in rows_s}):
            label, xs, ys = _slice(rows_s, "batch", "samples_per_s_step", framework)
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xlabel("micro-batch per rank")
        ax.set_ylabel("samples/s per step (global, median)")
        ax.set_title(stage)
        ax.legend(fontsize=7)
    return [_save(fig, directory, "throughput_vs_batch")]


def ppo_memory_timeline(records: dict[str, dict[str, Any]], directory: str) -> list[str]:
    """Per-step, per-phase peak of one ok PPO run per framework (the first found)."""
    chosen: dict[str, tuple[str, list[dict[str, Any]]]] = {}
    for run, record in records.items():
        ppo = record["stages"].get("ppo") or {}
        timeline = (ppo.get("memory") or {}).get("timeline") or []
        framework = record["config"]["framework"]["name"]
        if ppo.get("status") == "ok" and timeline and framework not in chosen:
            chosen[framework] = (run, timeline)
    if not chosen:
        return []
    fig, axes = plt.subplots(len(chosen), 1, figsize=(8, 2.4 * len(chosen)), squeeze=False)
    for ax, (framework, (run, timeline)) in zip(axes[:, 0], sorted(chosen.items()), strict=True):
        phases = list(dict.fromkeys(s["phase"] for s in timeline))
        for phase in phases:
            points = [(i, s["peak_bytes"] / MIB) for i, s in enumerate(timeline) if s["phase"] == phase]
            color = f"C{PHASE_ORDER.index(phase)}" if phase in PHASE_ORDER else None  # one colour per phase
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=4, linestyle="none",
                    label=phase, color=color)
        ax.plot(range(len(timeline)), [s["peak_bytes"] / MIB for s in timeline], color="grey", linewidth=0.6)
        ax.set_title(f"{framework}: {run}", fontsize=8)
        ax.set_ylabel("peak MiB (rank 0)")
        ax.legend(fontsize=7, ncol=len(phases))
    axes[-1, 0].set_xlabel("phase sample, in execution order (steps x phases)")
    return [_save(fig, directory, "ppo_memory_timeline")]


def _short_labels(runs: list[str]) -> dict[str, str]:
    """Each run's name (its overrides, comma-separated) without the overrides every run of the panel shares."""
    parts = {run: run.split(",") for run in runs}
    common = set.intersection(*(set(p) for p in parts.values())) if len(runs) > 1 else set()
    return {run: ",".join(p for p in parts[run] if p not in common) or run for run in runs}


def _curve_panels(panels: dict[str, list[tuple[str, list[float]]]], ylabel: str, xlabel: str, directory: str,
                  name: str) -> list[str]:
    """One panel per key; a line per run; a red x at the top for each non-finite step of a run."""
    fig, axes = plt.subplots(1, len(panels), figsize=(5.0 * len(panels), 3.6), squeeze=False)
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
        if len(lines) <= 8:
            ax.legend(fontsize=5)
    return [_save(fig, directory, name)]


def _finite_or_nan(values: list[Any]) -> list[float]:
    return [float(v) if isinstance(v, (int, float)) else float("nan") for v in values]


def loss_curves(records: dict[str, dict[str, Any]], directory: str) -> list[str]:
    """SFT and RM training loss per step of every run (mean over ranks), one panel per framework and stage."""
    panels: dict[str, list[tuple[str, list[float]]]] = {}
    for run, record in sorted(records.items()):
        for stage in ("sft", "rm"):
            curve = _finite_or_nan(((record["stages"].get(stage) or {}).get("learning") or {}).get("loss_curve") or [])
            if len(curve) > 1:
                panels.setdefault(f"{record['config']['framework']['name']} {stage} loss", []).append((run, curve))
    return _curve_panels(panels, "loss (mean over ranks)", "step", directory, "loss_curves") if panels else []


def reward_curves(records: dict[str, dict[str, Any]], directory: str) -> list[str]:
    """PPO reward (RM score) per step of every run, one panel per framework."""
    panels: dict[str, list[tuple[str, list[float]]]] = {}
    for run, record in sorted(records.items()):
        learning = (record["stages"].get("ppo") or {}).get("learning") or {}
        curve = _finite_or_nan(learning.get("reward_curve") or [])
        if len(curve) > 1:
            panels.setdefault(f"{record['config']['framework']['name']} PPO reward", []).append((run, curve))
    if not panels:
        return []
    return _curve_panels(panels, "reward (RM score, mean over ranks)", "PPO step", directory, "reward_curves")


def all_plots(rows: list[dict[str, Any]], records: dict[str, dict[str, Any]], directory: str) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    return (memory_by(rows, directory, "zero") + memory_by(rows, directory, "lora")
            + throughput_vs_batch(rows, directory) + ppo_memory_timeline(records, directory)
            + loss_curves(records, directory) + reward_curves(records, directory))
