"""The result table printed after a run."""

from __future__ import annotations

import os
from typing import Any

from rich import box
from rich.console import Console
from rich.padding import Padding
from rich.table import Table

MIB = 1024 * 1024
PHASE_WIDTH = len("experience")  # the longest phase name (also evaluation, checkpoint)


def _fmt(value: Any, scale: float = 1.0, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value / scale:,.{digits}f}"


COLUMNS = ("stage", "phase", "peak\nMiB", "growth\nMiB", "s/step", "tok/s", "samp/s", "TFLOP/s")


def run_title(record: dict[str, Any]) -> str:
    cfg = record["config"]
    return (f"{cfg['framework']['name']} {cfg['stage']['name']} · {cfg['model']['name']} · {cfg['precision']} · "
            f"ZeRO-{cfg['zero']} · LoRA {cfg['lora'] or 'off'} · batch {cfg['batch']} x "
            f"{cfg['launcher']['nproc']} rank(s) · status: {record['status']}")


def _caption(record: dict[str, Any]) -> str:
    """How the figures were measured, in a line or two; the record holds each method in full."""
    stage = next((s for s in record["stages"].values() if s.get("memory", {}).get("phases")), None)
    if stage is None:
        return ""
    memory = stage["memory"].get("method", "")
    method = memory.split(" (")[0].split(",")[0].split(";")[0]
    warmup = stage.get("throughput", {}).get("warmup_steps_excluded")
    return (f"peak: {method}, max over ranks and steps; growth: over the rank's baseline after the imports "
            f"phase; s/step: per step after {warmup} warm-up steps, the slowest rank; tok/s, samp/s: all "
            "data-parallel ranks; TFLOP/s: rank 0 (formula in the record)")


def result_table(record: dict[str, Any]) -> Table:
    """Every phase of every stage, narrow enough for an 80-column terminal with each phase name whole: the
    stage is named once per section and units sit in the headers."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True, caption=_caption(record),
                  caption_justify="left")
    for name in COLUMNS:
        left = name in ("stage", "phase")
        table.add_column(name, justify="left" if left else "right", no_wrap=True,
                         min_width=PHASE_WIDTH if name == "phase" else None)
    for stage, result in record["stages"].items():
        memory = result.get("memory", {}).get("phases", {})
        speed = result.get("throughput", {}).get("phases", {})
        if not memory:
            table.add_row(stage, "-", "-", "-", "-", "-", "-", "-")
        for i, (phase, mem) in enumerate(memory.items()):
            t = speed.get(phase, {})
            tflops = t.get("tflops_per_s_per_rank", [None])[0]
            table.add_row(
                stage if i == 0 else "", phase, _fmt(mem.get("peak_bytes"), MIB),
                _fmt(mem.get("growth_over_baseline_bytes"), MIB),
                _fmt(t.get("time_s_per_step", t.get("time_s")), digits=3), _fmt(t.get("tokens_per_s_global")),
                _fmt(t.get("samples_per_s_global")), _fmt(tflops, digits=4),
            )
        table.add_section()
    return table


def reward_line(learning: dict[str, Any], steps: int) -> str:
    """The reward's start and end and what its change means against the step-to-step noise."""
    window = learning["reward_window_steps"]
    line = (f"reward {_fmt(learning['reward_start'], digits=3)} -> {_fmt(learning['reward_end'], digits=3)} "
            f"(means of the first and last {window} of {steps} steps)")
    trend = learning.get("reward_trend")
    if not trend:
        return line
    if trend["verdict"] in ("rose", "fell"):
        return (f"{line}: {trend['verdict']} by {abs(trend['change']):.3g}, "
                f"{abs(trend['change']) / trend['change_se']:.1f} standard errors")
    if trend["verdict"] == "within noise":
        return (f"{line}: no trend yet, the change {trend['change']:+.3g} is within 2 standard errors "
                f"(±{2 * trend['change_se']:.3g}) of step-to-step noise")
    return f"{line}: one step per window, no noise estimate"


def _prerequisite_line(record: dict[str, Any]) -> str | None:
    """Where PPO's models came from when the run trained (or reused) prerequisites for them."""
    made = record.get("prerequisites") or {}
    parts = []
    if "sft" in made:
        sft = made["sft"]
        loss = f"{_fmt(sft.get('loss_start'), digits=3)} -> {_fmt(sft.get('loss_end'), digits=3)}"
        parts.append(f"actor and reference from the prerequisite SFT model (loss {loss}"
                     f"{', cached' if sft.get('cached') else ''})")
    if "rm" in made:
        rm = made["rm"]
        parts.append(f"critic and reward from the prerequisite RM (accuracy {_fmt(rm.get('accuracy_end'), digits=2)}"
                     f"{', cached' if rm.get('cached') else ''})")
    return "  " + "; ".join(parts) if parts else None


def stage_summaries(record: dict[str, Any], run_dir: str | None = None) -> list[str]:
    """A line per stage (status, stability, what it learned), then indented lines: where PPO's models came
    from, the reward's trend, the stage's notes, and for a failed stage the log that holds its output."""
    lines = []
    for stage, result in record["stages"].items():
        stability = result.get("stability", {})
        learning = result.get("learning", {})
        parts = [f"[bold]{stage}[/bold]: {result['status']}"]
        if stability:
            parts.append(f"stability {stability['classification']}")
            if stability.get("first_nonfinite_step") is not None:
                parts.append(f"first non-finite {stability['first_nonfinite_metric']} at step "
                             f"{stability['first_nonfinite_step']}")
            skips = sum(stability.get("overflow_skipped_steps", {}).values())
            if skips:
                parts.append(f"{skips} overflow-skipped steps, min loss scale {stability.get('loss_scale_min')}")
        if "reward_start" in learning:
            parts.append(f"generated tokens per step {_fmt(learning.get('generated_tokens_start'))} -> "
                         f"{_fmt(learning.get('generated_tokens_end'))}")
        if "accuracy_end" in learning:
            parts.append(f"RM accuracy {_fmt(learning['accuracy_start'], digits=2)} -> "
                         f"{_fmt(learning['accuracy_end'], digits=2)}")
        curve = learning.get("loss_curve")
        if curve and stage == "sft":
            parts.append(f"loss {_fmt(curve[0], digits=3)} -> {_fmt(curve[-1], digits=3)}")
        if result.get("error"):
            parts.append(f"[red]{result['error'].get('message', '')[:300]}[/red]")
        lines.append(", ".join(parts))
        prerequisites = _prerequisite_line(record) if stage == "ppo" else None
        if prerequisites:
            lines.append(prerequisites)
        if "reward_start" in learning:
            lines.append("  " + reward_line(learning, len(result.get("steps") or [])))
        lines.extend(f"  note: {note}" for note in result.get("notes", []))
        if result["status"] not in ("ok", "skipped") and run_dir is not None:
            lines.append(f"  every rank's output: {_short(os.path.join(run_dir, stage, 'worker.log'))}")
    return lines


def print_record(record: dict[str, Any], path: str, console: Console | None = None,
                 report_root: str | None = None) -> None:
    """The run's title, its table, a line per stage, and where the record is with the command that turns the
    runs beside it into a report. Paths are shown whole (never wrapped), relative when under the cwd."""
    console = console or Console()
    console.print(f"[bold]{run_title(record)}[/bold]", soft_wrap=True)
    console.print(result_table(record))
    for line in stage_summaries(record, os.path.dirname(path)):
        text = line.lstrip(" ")
        console.print(Padding(text, (0, 0, 0, len(line) - len(text)), expand=False))  # wrapped lines keep the indent
    console.print(f"record: {_short(path)}", soft_wrap=True)
    if report_root is not None:
        console.print(f"report: python -m bench.report {_short(report_root)}", soft_wrap=True)


def _short(path: str) -> str:
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative
