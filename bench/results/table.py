"""The result table printed after a run."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

MIB = 1024 * 1024


def _fmt(value: Any, scale: float = 1.0, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value / scale:,.{digits}f}"


def result_table(record: dict[str, Any]) -> Table:
    cfg = record["config"]
    title = (f"{cfg['framework']['name']} {cfg['stage']['name']} | {cfg['model']['name']} | {cfg['precision']} | "
             f"ZeRO-{cfg['zero']} | LoRA {cfg['lora'] or 'off'} | batch {cfg['batch']} x "
             f"{cfg['launcher']['nproc']} rank(s) | status: {record['status']}")
    table = Table(title=title, title_justify="left")
    # peak: max over ranks; growth: over the rank's post-import baseline; rates: global; TFLOP/s: rank 0
    for column in ("stage", "phase", "peak MiB", "growth MiB", "s/step", "tok/s", "samp/s", "TFLOP/s"):
        table.add_column(column, justify="left" if column in ("stage", "phase") else "right")
    for stage, result in record["stages"].items():
        memory = result.get("memory", {}).get("phases", {})
        speed = result.get("throughput", {}).get("phases", {})
        if not memory:
            table.add_row(stage, "-", "-", "-", "-", "-", "-", "-")
        for phase, mem in memory.items():
            t = speed.get(phase, {})
            tflops = t.get("tflops_per_s_per_rank", [None])[0]
            table.add_row(
                stage, phase, _fmt(mem.get("peak_bytes"), MIB), _fmt(mem.get("growth_over_baseline_bytes"), MIB),
                _fmt(t.get("time_s_per_step", t.get("time_s")), digits=3), _fmt(t.get("tokens_per_s_global")),
                _fmt(t.get("samples_per_s_global")), _fmt(tflops, digits=4),
            )
        table.add_section()
    return table


def stage_summaries(record: dict[str, Any]) -> list[str]:
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
            start, end = _fmt(learning["reward_start"], digits=3), _fmt(learning["reward_end"], digits=3)
            parts.append(f"reward {start} -> {end} (mean of first/last {learning['reward_window_steps']} steps)")
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
        lines.extend(f"  note: {note}" for note in result.get("notes", []))
    return lines


def print_record(record: dict[str, Any], path: str, console: Console | None = None) -> None:
    console = console or Console()
    console.print(result_table(record))
    for line in stage_summaries(record):
        console.print(line)
    console.print(f"record: {path}")
