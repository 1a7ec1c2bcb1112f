"""The report's tables, as plain data (title, caption with unit and method, header, rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.report.aggregate import SPREAD_RULE, distinguishing_keys, group, other_config, per_gpu, stat, status_of
from bench.results import provenance
from bench.results.collect import is_forced_failure, phases_in

MIB = 1024.0 * 1024.0
SHOWN_CONFIG = ("framework", "stage", "model", "precision", "zero", "lora", "batch", "nproc")
EXTRA_CONFIG = ("tp", "pp", "plugin", "offload", "grad_ckpt", "quant", "normalize", "reference",
                "upstream_fix", "harness_extension", "tags")
Cells = dict[str, dict[str, Any]]


@dataclass
class Table:
    key: str
    title: str
    caption: str
    header: list[str]
    rows: list[list[str]]
    links: tuple[str, ...] = ()  # columns whose cells are space-separated relative paths, rendered as links


def cell_flag(runs: list[dict[str, Any]]) -> str:
    """A cell's provenance flag (bench.results.provenance.flag): mixed commits, hosts, versions or settings;
    a dirty tree; "-" for clean repeats at one commit."""
    return provenance.flag([provenance.from_row(r) for r in runs])


class ConfigColumns:
    """The config columns of a table: the main ones always, the optional ones where they vary, the fine-tuning
    mode, and one "other config" column with every cell key that tells apart cells the others show alike."""

    def __init__(self, rows: list[dict[str, Any]], cells: Cells) -> None:
        self.extra = [c for c in EXTRA_CONFIG if len({str(r.get(c)) for r in rows}) > 1
                      or (c == "tags" and any(r.get("tags") for r in rows))]
        self.header = ["cell"] + list(SHOWN_CONFIG) + self.extra + ["finetune"]
        self.cells = cells
        self.other = distinguishing_keys(rows, cells)
        if self.other:
            self.header.append("other config")
        # the provenance column, wherever a cell's runs mix commits, hosts, versions or settings, or are dirty
        self.flagged = any(cell_flag(runs) != "-" for runs in group(rows).values())
        if self.flagged:
            self.header.append("provenance")

    def values(self, runs: list[dict[str, Any]]) -> list[str]:
        row = runs[0]
        shown = ["-" if row.get(c) is None else str(row[c]) for c in self.header
                 if c not in ("other config", "provenance")]
        return (shown + ([other_config(row, self.cells, self.other)] if self.other else [])
                + ([cell_flag(runs)] if self.flagged else []))


def runs_table(rows: list[dict[str, Any]]) -> Table:
    header = ["run", "stage", "cell", "status", "stability", "tags", "engine", "error", "notes"]
    body = [[r["run"], r["stage"], r["cell"], r["status"], r.get("stability") or "-", r.get("tags") or "-",
             r.get("engine") or "-", (r.get("error") or "").splitlines()[0][:160] if r.get("error") else "",
             r.get("notes") or ""] for r in rows]
    return Table("runs", "Every run", "One line per run and stage, as recorded; `skipped` stages follow a failed one "
                 "or were cut by the OOM back-stop. cell: the id of the run's configuration (the whole resolved "
                 "config minus seed and bookkeeping); runs with one id are repeats. engine: the resolved engine "
                 "(plugin, optimizer, reference mode) from the run's notes, which follow in full.", header, body)


def memory_table(rows: list[dict[str, Any]], cells: Cells) -> Table:
    phases = phases_in(rows, "peak")
    config = ConfigColumns(rows, cells)
    header = (config.header + ["engine", "runs", "status", "peak MiB", "growth MiB", "peak phase"]
              + [f"{p} MiB" for p in phases]
              + ["model state MiB (rank 0)", "model state / init growth %", "rest at peak MiB (rank 0)"])
    body = []
    for runs in group(rows).values():
        state = stat([r.get("model_state_bytes_rank0") for r in runs])
        init = stat([r.get("growth_init_bytes") for r in runs])
        share = f"{100 * state.median / init.median:.0f}" if state.median and init.median else "-"
        phase = sorted({r.get("peak_phase") or "-" for r in runs})
        body.append(config.values(runs) + [runs[0].get("engine") or "-", str(len(runs)), status_of(runs),
                                           stat([r.get("peak_bytes") for r in runs]).fmt(MIB),
                                           stat([r.get("growth_bytes") for r in runs]).fmt(MIB), "/".join(phase)]
                    + [stat([r.get(f"peak_{p}_bytes") for r in runs]).fmt(MIB) for p in phases]
                    + [state.fmt(MIB, 1), share, stat([r.get("rest_at_peak_bytes_rank0") for r in runs]).fmt(MIB)])
    method = next((r["memory_method"] for r in rows if r.get("memory_method")), "not recorded")
    return Table("memory", "Peak memory per phase",
                 f"MiB (2^20 bytes), max over ranks; method: {method}. Peak: the largest phase peak; growth: that "
                 "minus the rank's post-import baseline (engine libraries, JIT ops and process groups already "
                 "loaded): what frameworks are compared on, next to the phase that sets it. Phase columns: "
                 "absolute peaks (`imports` is the runtime phase itself). Model state: parameter and optimizer-state "
                 "bytes rank 0's engines hold; its share of the init phase's growth says how much of building the "
                 "models is the models themselves. Rest: activations, gradients, caches, buffers, allocator slack "
                 "at rank 0's peak. Peak, growth and peak phase are all read over the same phases: every phase after "
                 "`imports` (init included: a device runs out of memory in whichever phase peaks). A cell is the "
                 "whole resolved configuration minus seed and bookkeeping (other config: the keys that tell apart "
                 "cells the columns show alike; the cells table names the command that re-runs each). "
                 + SPREAD_RULE, header, body)


def throughput_table(rows: list[dict[str, Any]], cells: Cells) -> Table:
    phases = [p for p in phases_in(rows, "tokens_per_s") if p not in ("imports", "init")]
    config = ConfigColumns(rows, cells)
    header = (config.header + ["ok runs", "timed steps"] + [f"{p} tok/s" for p in phases]
              + ["step s (min-max over steps)", "step samples/s", "samples/s per rank at one pass", "update passes",
                 "samples/s at one pass", "TFLOP/s (rank 0)", "MFU %", "generation share %"])
    body = []
    for runs in group(rows).values():
        ok = [r for r in runs if r["status"] == "ok"]
        if not ok:
            continue
        lows = [r["step_time_min_s"] for r in ok if r.get("step_time_min_s") is not None]
        highs = [r["step_time_max_s"] for r in ok if r.get("step_time_max_s") is not None]
        steps = sum(r.get("timed_steps") or 0 for r in ok)
        mfu = stat([r.get("mfu") for r in ok])
        body.append(config.values(ok) + [str(len(ok)), f"{steps} ({len(ok)} runs)"]
                    + [stat([r.get(f"tokens_per_s_{p}") for r in ok]).fmt() for p in phases]
                    + [f"{min(lows):.2f}-{max(highs):.2f}" if lows else "-",
                       stat([r.get("samples_per_s_step") for r in ok]).fmt(digits=2),
                       stat([per_gpu(r) for r in ok]).fmt(digits=3),
                       str(ok[0].get("update_passes") or "-"),
                       stat([r.get("samples_per_s_one_pass") for r in ok]).fmt(digits=2),
                       stat([r.get("tflops_per_s_rank0") for r in ok]).fmt(digits=3),
                       mfu.fmt(0.01, 1) if mfu.n else "- (device peak unknown)",
                       stat([r.get("share_generation") for r in ok]).fmt(0.01, 0)])
    return Table("throughput", "Throughput",
                 "Tokens/s per phase: real (non-pad) tokens summed over data-parallel replicas / the slowest "
                 "rank's time, warm-up steps excluded (time.perf_counter around each phase). Timed steps: "
                 "measured steps summed over the cell's ok runs; step s: the fastest and slowest single step "
                 "among them (each the slowest rank's summed phase times). Step samples/s: samples of one step "
                 "(PPO: every rollout it generates and trains on, the record's rollouts_per_step x batch: coati "
                 "collects 2, trlx num_rollouts / batch) over all replicas / the step time (per-phase mean step "
                 "times summed); per rank at one pass (a rank is a GPU on a GPU host, a process on a CPU "
                 "host): that at one update pass for PPO / ranks. "
                 "Update passes: optimizer passes over each rollout per PPO step (the record's update_passes, the "
                 "framework's own PPO epochs); samples/s at one pass: the same step with its "
                 "training time divided by the passes, so frameworks compare on equal work. TFLOP/s: rank 0's "
                 "FLOPs per step (the record's flops_formula, real tokens) / the step time; MFU: that / the "
                 "device's dense 16-bit peak where it is known (GPUs; none for CPUs). Generation share: its "
                 "share of the PPO step time. " + SPREAD_RULE, header, body)


def stability_table(rows: list[dict[str, Any]], cells: Cells) -> Table:
    chosen = [r for r in rows if r.get("stability")]
    config = ConfigColumns(chosen, cells) if chosen else None
    header = (config.header if config else []) + ["runs", "classification", "first non-finite step",
                                                  "overflow skips", "loss-scale min", "upstream defects hit",
                                                  "evidence"]
    body = []
    for runs in group(chosen).values():
        classes: dict[str, int] = {}
        for r in runs:
            classes[r["stability"]] = classes.get(r["stability"], 0) + 1
        first = [r["first_nonfinite_step"] for r in runs if r.get("first_nonfinite_step") is not None]
        scales = [r["loss_scale_min"] for r in runs if r.get("loss_scale_min") is not None]
        forced = any(is_forced_failure(r) for r in runs)
        body.append(config.values(runs) + [str(len(runs)), ", ".join(f"{c} {n}" for c, n in sorted(classes.items())),
                                           str(min(first)) if first else "none",
                                           str(sum(r.get("overflow_skips") or 0 for r in runs)),
                                           f"{min(scales):g}" if scales else "-", _defects(runs),
                                           "no (forced failure)" if forced else "yes"])
    return Table("stability", "Numerical stability by stage and configuration",
                 "Per cell (stage and whole configuration), over every run that reached training: classification "
                 "counts (stable, recovered, skip-storm, diverged; rules in the record's stability.rules), the "
                 "earliest non-finite step of any run, overflow-skipped steps summed over runs (fp16 dynamic loss "
                 "scaling), the smallest loss scale seen, and the known upstream defects those runs hit (see the "
                 "framework pages, docs/frameworks/). Evidence: no for runs tagged forced-failure (meant to fail, "
                 "e.g. a learning rate that must diverge): they show how a failure looks and are never evidence "
                 "for a claim.",
                 header, body)


def _defects(runs: list[dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for r in runs:
        for defect in filter(None, (r.get("upstream_defects") or "").split(", ")):
            counts[defect] = counts.get(defect, 0) + 1
    return "; ".join(f"{d} (runs: {n})" for d, n in sorted(counts.items())) or "none"


def all_tables(rows: list[dict[str, Any]], cells: Cells) -> list[Table]:
    return [memory_table(rows, cells), throughput_table(rows, cells), stability_table(rows, cells),
            runs_table(rows)]
