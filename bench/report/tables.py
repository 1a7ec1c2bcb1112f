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
    """A table's configuration, read at 1280 px: one short "configuration" label per row, made of the keys whose
    values vary across the table's rows (the main ones, the optional ones, the fine-tuning mode, and the other
    keys that tell apart cells those show alike), ahead of the measured figures; the keys every row shares are
    stated once, in the caption (`shared()`). The cell id and, where a cell's runs mix commits, hosts, versions
    or settings or are dirty, its provenance flag close the row (`tail`)."""

    def __init__(self, rows: list[dict[str, Any]], cells: Cells) -> None:
        keys = [*SHOWN_CONFIG, *(c for c in EXTRA_CONFIG if any(r.get(c) for r in rows) or c != "tags"),
                "finetune"]
        self.varying = [k for k in keys if len({_text(r.get(k)) for r in rows}) > 1]
        # unset or switched-off optional keys (None, "", [], False) say nothing worth a caption
        self.constant = {k: _text(rows[0].get(k)) for k in keys if k not in self.varying and rows
                         and rows[0].get(k) is not False and rows[0].get(k) not in (None, "", [])}
        self.cells = cells
        self.other = distinguishing_keys(rows, cells)
        self.header = ["configuration"]
        # the provenance column, wherever a cell's runs mix commits, hosts, versions or settings, or are dirty
        self.flagged = any(cell_flag(runs) != "-" for runs in group(rows).values())
        self.tail = ["cell"] + (["provenance"] if self.flagged else [])

    def values(self, runs: list[dict[str, Any]]) -> list[str]:
        row = runs[0]
        # a key unset in this row ("-") is left out of its label: the rows that set it name it
        label = " ".join(f"{k}={_text(row.get(k))}" for k in self.varying if _text(row.get(k)) != "-")
        if self.other:
            others = [part for part in other_config(row, self.cells, self.other).split(" ") if not part.endswith("=-")]
            label = " ".join([label, *others]).strip()
        return [label or "(one configuration)"]

    def tail_values(self, runs: list[dict[str, Any]]) -> list[str]:
        return [runs[0]["cell"]] + ([cell_flag(runs)] if self.flagged else [])

    def shared(self) -> str:
        """The keys every row shares, for the caption."""
        if not self.constant:
            return ""
        return "Every row: " + ", ".join(f"{k}={v}" for k, v in self.constant.items()) + ". "


def _text(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value)) or "-"
    return "-" if value is None else str(value)


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
    header = (config.header + ["peak MiB", "growth MiB", "peak phase", "runs", "status"]
              + [f"{p} MiB" for p in phases]
              + ["model state MiB (rank 0)", "model state / init growth %", "rest at peak MiB (rank 0)", "engine"]
              + config.tail)
    body = []
    for runs in group(rows).values():
        state = stat([r.get("model_state_bytes_rank0") for r in runs])
        init = stat([r.get("growth_init_bytes") for r in runs])
        share = f"{100 * state.median / init.median:.0f}" if state.median and init.median else "-"
        phase = sorted({r.get("peak_phase") or "-" for r in runs})
        body.append(config.values(runs) + [stat([r.get("peak_bytes") for r in runs]).fmt(MIB),
                                           stat([r.get("growth_bytes") for r in runs]).fmt(MIB), "/".join(phase),
                                           str(len(runs)), status_of(runs)]
                    + [stat([r.get(f"peak_{p}_bytes") for r in runs]).fmt(MIB) for p in phases]
                    + [state.fmt(MIB, 1), share, stat([r.get("rest_at_peak_bytes_rank0") for r in runs]).fmt(MIB),
                       runs[0].get("engine") or "-"] + config.tail_values(runs))
    method = next((r["memory_method"] for r in rows if r.get("memory_method")), "not recorded")
    return Table("memory", "Peak memory per phase",
                 config.shared()
                 + f"MiB (2^20 bytes), max over ranks; method: {method}. Peak: the largest phase peak; growth: that "
                 "minus the rank's post-import baseline (engine libraries, JIT ops and process groups already "
                 "loaded): what frameworks are compared on, next to the phase that sets it. Phase columns: "
                 "absolute peaks (`imports` is the runtime phase itself). Model state: parameter and optimizer-state "
                 "bytes rank 0's engines hold; its share of the init phase's growth says how much of building the "
                 "models is the models themselves. Rest: activations, gradients, caches, buffers, allocator slack "
                 "at rank 0's peak. Peak, growth and peak phase are all read over the same phases: every phase after "
                 "`imports` (init included: a device runs out of memory in whichever phase peaks). A cell is the "
                 "whole resolved configuration minus seed and bookkeeping (configuration: the keys whose values vary "
                 "across the rows, with any others that tell cells apart; the cells table names the command that "
                 "re-runs each). "
                 + SPREAD_RULE, header, body)


def throughput_table(rows: list[dict[str, Any]], cells: Cells) -> Table:
    phases = [p for p in phases_in(rows, "tokens_per_s") if p not in ("imports", "init")]
    config = ConfigColumns(rows, cells)
    header = (config.header + [f"{p} tok/s" for p in phases]
              + ["step s (min-max over steps)", "step samples/s", "samples/s per rank at one pass", "update passes",
                 "samples/s at one pass", "TFLOP/s (rank 0)", "MFU %", "generation share %", "ok runs",
                 "timed steps"] + config.tail)
    body = []
    for runs in group(rows).values():
        ok = [r for r in runs if r["status"] == "ok"]
        if not ok:
            continue
        lows = [r["step_time_min_s"] for r in ok if r.get("step_time_min_s") is not None]
        highs = [r["step_time_max_s"] for r in ok if r.get("step_time_max_s") is not None]
        steps = sum(r.get("timed_steps") or 0 for r in ok)
        mfu = stat([r.get("mfu") for r in ok])
        body.append(config.values(ok)
                    + [stat([r.get(f"tokens_per_s_{p}") for r in ok]).fmt() for p in phases]
                    + [f"{min(lows):.2f}-{max(highs):.2f}" if lows else "-",
                       stat([r.get("samples_per_s_step") for r in ok]).fmt(digits=2),
                       stat([per_gpu(r) for r in ok]).fmt(digits=3),
                       str(ok[0].get("update_passes") or "-"),
                       stat([r.get("samples_per_s_one_pass") for r in ok]).fmt(digits=2),
                       stat([r.get("tflops_per_s_rank0") for r in ok]).fmt(digits=3),
                       mfu.fmt(0.01, 1) if mfu.n else "- (device peak unknown)",
                       stat([r.get("share_generation") for r in ok]).fmt(0.01, 0), str(len(ok)),
                       f"{steps} ({len(ok)} runs)"] + config.tail_values(ok))
    return Table("throughput", "Throughput",
                 config.shared()
                 + "Tokens/s per phase: real (non-pad) tokens summed over data-parallel replicas / the slowest "
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
    header = (config.header if config else []) + ["classification", "first non-finite step", "overflow skips",
                                                  "loss-scale min", "upstream defects hit", "evidence", "runs"] + (
        config.tail if config else [])
    body = []
    for runs in group(chosen).values():
        classes: dict[str, int] = {}
        for r in runs:
            classes[r["stability"]] = classes.get(r["stability"], 0) + 1
        first = [r["first_nonfinite_step"] for r in runs if r.get("first_nonfinite_step") is not None]
        scales = [r["loss_scale_min"] for r in runs if r.get("loss_scale_min") is not None]
        forced = any(is_forced_failure(r) for r in runs)
        body.append(config.values(runs) + [", ".join(f"{c} {n}" for c, n in sorted(classes.items())),
                                           str(min(first)) if first else "none",
                                           str(sum(r.get("overflow_skips") or 0 for r in runs)),
                                           f"{min(scales):g}" if scales else "-", _defects(runs),
                                           "no (forced failure)" if forced else "yes", str(len(runs))]
                    + config.tail_values(runs))
    return Table("stability", "Numerical stability by stage and configuration",
                 (config.shared() if config else "")
                 + "Per cell (stage and whole configuration), over every run that reached training: classification "
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
