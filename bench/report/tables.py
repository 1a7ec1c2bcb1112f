"""The report's tables, as plain data (title, caption with unit and method, header, rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.collect import phases_in
from bench.report.aggregate import CELL_COLUMNS, group, stat, status_of

MIB = 1024.0 * 1024.0
SHOWN_CONFIG = ("framework", "stage", "precision", "zero", "lora", "batch", "nproc")
EXTRA_CONFIG = ("tp", "pp", "plugin", "offload", "grad_ckpt", "reference", "upstream_fix", "harness_extension")


@dataclass
class Table:
    key: str
    title: str
    caption: str
    header: list[str]
    rows: list[list[str]]


def _config_header(rows: list[dict[str, Any]]) -> list[str]:
    """The config columns worth showing: the main ones always, the others only where they vary."""
    extra = [c for c in EXTRA_CONFIG if len({str(r.get(c)) for r in rows}) > 1]
    return list(SHOWN_CONFIG) + extra


def _config_cells(cell: tuple, header: list[str]) -> list[str]:
    values = dict(zip(CELL_COLUMNS, cell, strict=True))
    return ["-" if values[c] is None else str(values[c]) for c in header]


def runs_table(rows: list[dict[str, Any]]) -> Table:
    header = ["run", "stage", "status", "stability", "error"]
    body = [[r["run"], r["stage"], r["status"], r.get("stability") or "-",
             (r.get("error") or "").splitlines()[0][:160] if r.get("error") else ""] for r in rows]
    return Table("runs", "Every run", "One line per run and stage, as recorded; `skipped` stages follow a failed one "
                 "or were cut by the OOM back-stop.", header, body)


def memory_table(rows: list[dict[str, Any]]) -> Table:
    phases = phases_in(rows, "peak")
    config = _config_header(rows)
    header = (config + ["runs", "status", "growth MiB"] + [f"{p} MiB" for p in phases]
              + ["runtime MiB (rank 0)", "model state MiB (rank 0)", "rest at peak MiB (rank 0)"])
    body = []
    for cell, runs in group(rows).items():
        body.append(_config_cells(cell, config) + [str(len(runs)), status_of(runs),
                                                   stat([r.get("growth_bytes") for r in runs]).fmt(MIB)]
                    + [stat([r.get(f"peak_{p}_bytes") for r in runs]).fmt(MIB) for p in phases]
                    + [stat([r.get("runtime_bytes_rank0") for r in runs]).fmt(MIB),
                       stat([r.get("model_state_bytes_rank0") for r in runs]).fmt(MIB, 2),
                       stat([r.get("rest_at_peak_bytes_rank0") for r in runs]).fmt(MIB)])
    method = next((r["memory_method"] for r in rows if r.get("memory_method")), "not recorded")
    return Table("memory", "Peak memory per phase",
                 f"MiB (2^20 bytes), max over ranks; method: {method}. Growth: the largest phase peak minus the "
                 "rank's post-import baseline (engine libraries, JIT ops and process groups already loaded): "
                 "what frameworks are compared on. Phase columns: absolute peaks (`imports` is the runtime "
                 "phase itself). Rank 0's peak splits into process start + runtime (the imports) + model state "
                 "(parameter and optimizer-state bytes its engines hold) + rest (activations, gradients, caches, "
                 "buffers, allocator slack). Median over repeated runs, ± half the range, n = runs.", header, body)


def throughput_table(rows: list[dict[str, Any]]) -> Table:
    phases = [p for p in phases_in(rows, "tokens_per_s") if p not in ("imports", "init")]
    config = _config_header(rows)
    header = config + ["ok runs"] + [f"{p} tok/s" for p in phases] + ["step samples/s", "update passes",
                                                                      "samples/s at one pass", "generation share %"]
    body = []
    for cell, runs in group(rows).items():
        ok = [r for r in runs if r["status"] == "ok"]
        if not ok:
            continue
        body.append(_config_cells(cell, config) + [str(len(ok))]
                    + [stat([r.get(f"tokens_per_s_{p}") for r in ok]).fmt() for p in phases]
                    + [stat([r.get("samples_per_s_step") for r in ok]).fmt(digits=2),
                       str(ok[0].get("update_passes") or "-"),
                       stat([r.get("samples_per_s_one_pass") for r in ok]).fmt(digits=2),
                       stat([r.get("share_generation") for r in ok]).fmt(0.01, 0)])
    return Table("throughput", "Throughput",
                 "Tokens/s per phase: real (non-pad) tokens summed over data-parallel replicas / the slowest "
                 "rank's time, warm-up steps excluded (time.perf_counter around each phase). Step samples/s: "
                 "samples of one step over all replicas / the summed per-phase step times. Update passes: "
                 "optimizer passes over each rollout per PPO step (trlx's ppo_epochs is 4, the others' 1); "
                 "samples/s at one pass: the same step with its training time divided by the passes, so "
                 "frameworks compare on equal work. Generation share: generation's share of the PPO step time. "
                 "A harness_extension column names knobs the framework's own scripts cannot run. Median over "
                 "repeated ok runs.", header, body)


def stability_table(rows: list[dict[str, Any]]) -> Table:
    header = ["precision", "framework", "runs", "classification", "first non-finite step", "overflow skips",
              "loss-scale min", "upstream defects hit"]
    keyed: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("stability"):
            keyed.setdefault((row["precision"], row["framework"]), []).append(row)
    body = []
    for (precision, framework), runs in sorted(keyed.items()):
        classes: dict[str, int] = {}
        for r in runs:
            classes[r["stability"]] = classes.get(r["stability"], 0) + 1
        first = [r["first_nonfinite_step"] for r in runs if r.get("first_nonfinite_step") is not None]
        scales = [r["loss_scale_min"] for r in runs if r.get("loss_scale_min") is not None]
        body.append([precision, framework, str(len(runs)),
                     ", ".join(f"{c} {n}" for c, n in sorted(classes.items())),
                     str(min(first)) if first else "none",
                     str(sum(r.get("overflow_skips") or 0 for r in runs)),
                     f"{min(scales):g}" if scales else "-", _defects(runs)])
    return Table("stability", "Numerical stability by precision",
                 "Per (precision, framework), over every stage run that reached training: classification counts "
                 "(stable, recovered, skip-storm, diverged; rules in the record's stability.rules), the earliest "
                 "non-finite step of any run, overflow-skipped steps summed over runs (fp16 dynamic loss scaling), "
                 "the smallest loss scale seen, and the known upstream defects those runs hit (runs: n; see the "
                 "README's list).", header, body)


def _defects(runs: list[dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for r in runs:
        for defect in filter(None, (r.get("upstream_defects") or "").split(", ")):
            counts[defect] = counts.get(defect, 0) + 1
    return "; ".join(f"{d} (runs: {n})" for d, n in sorted(counts.items())) or "none"


def all_tables(rows: list[dict[str, Any]]) -> list[Table]:
    return [memory_table(rows), throughput_table(rows), stability_table(rows), runs_table(rows)]
