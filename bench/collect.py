"""The sweep collector: every record under a directory, flattened to one row per (run, stage).

A record that cannot be read (truncated, not JSON, wrong schema) becomes a Problem and is skipped; the
rest still make a report. Rows keep the units in the column names (`_bytes`, `_s`, `_per_s`); memory
figures are the max over ranks, rates are global (summed over data-parallel replicas).
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any

from bench.record import PHASE_ORDER, SCHEMA_VERSION, SETUP_PHASES

RECORD_NAME = "record.json"
# Config keys that identify a cell in the tables; repeated runs of one cell aggregate to median/spread.
CONFIG_COLUMNS = ("framework", "stage", "model", "precision", "zero", "lora", "batch", "nproc", "tp", "pp",
                  "plugin", "offload", "grad_ckpt", "reference", "upstream_fix", "harness_extension", "seed")


@dataclass
class Problem:
    path: str
    reason: str


@dataclass
class Collection:
    root: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)  # run directory (relative) -> record
    problems: list[Problem] = field(default_factory=list)


def _config_columns(config: dict[str, Any]) -> dict[str, Any]:
    framework = config.get("framework", {})
    return {
        "framework": framework.get("name"),
        "stage": None,  # set per stage row
        "model": config.get("model", {}).get("name"),
        "precision": config.get("precision"),
        "zero": config.get("zero"),
        "lora": config.get("lora"),
        "batch": config.get("batch"),
        "nproc": config.get("launcher", {}).get("nproc"),
        "tp": config.get("tp", 1),
        "pp": config.get("pp", 1),
        "plugin": config.get("plugin", "auto"),
        "offload": config.get("offload"),
        "grad_ckpt": config.get("grad_ckpt"),
        "reference": _trlx_reference(config) if framework.get("name") == "trlx" else None,
        # an opt-in fix of an upstream defect changes what runs: such runs never pool with upstream's
        "upstream_fix": "fp16-zero0-loss-scale" if framework.get("fix_fp16_zero0_loss_scale") else None,
        "harness_extension": None,  # from the record (the framework's options name the knobs upstream lacks)
        "seed": config.get("seed"),
    }


def update_passes(config: dict[str, Any]) -> int:
    """Optimizer passes over each rollout per PPO step: trlx's and DS-Chat's ppo_epochs, coati's
    num_update_steps (1 where the framework names neither)."""
    ppo = config.get("framework", {}).get("ppo") or {}
    return int(ppo.get("ppo_epochs") or ppo.get("num_update_steps") or 1)


def _trlx_reference(config: dict[str, Any]) -> str:
    """The reference mode a trlx run used, resolved by the adapter's own options (which import no framework)."""
    from adapters.trlx.options import TrlxOptions

    options = {k: v for k, v in config["framework"].items() if k != "name"}
    return TrlxOptions.from_dict(options).reference_mode(config.get("lora") or 0)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if value in ("nan", "inf", "-inf"):
        return float(value)
    return None


def stage_row(run: str, record: dict[str, Any], stage: str, result: dict[str, Any]) -> dict[str, Any]:
    """One flat row: config, status, per-phase peak memory and rates, stability, learning."""
    row: dict[str, Any] = {"run": run, **_config_columns(record["config"]), "stage": stage,
                           "status": result.get("status"), "run_status": record.get("status"),
                           "error": (result.get("error") or {}).get("message"),
                           "finished": bool(record.get("finished_utc"))}
    row["harness_extension"] = "; ".join(e["knob"] for e in record.get("harness_extension") or []) or None
    if stage != "ppo":  # the reference model exists in PPO only
        row["reference"] = None
    memory = result.get("memory") or {}
    row["memory_method"] = memory.get("method")
    peaks = []
    for phase, entry in (memory.get("phases") or {}).items():
        row[f"peak_{phase}_bytes"] = entry.get("peak_bytes")
        row[f"growth_{phase}_bytes"] = entry.get("growth_over_baseline_bytes")
        if entry.get("peak_bytes") is not None:
            peaks.append(entry["peak_bytes"])
    row["peak_bytes"] = max(peaks) if peaks else None
    baselines = [b for b in memory.get("baseline_bytes_per_rank", []) if b is not None]
    row["baseline_bytes"] = max(baselines) if baselines else None
    # What frameworks are compared on: growth over the post-import baseline, max over the work phases.
    work = {p: e for p, e in (memory.get("phases") or {}).items() if p not in SETUP_PHASES}
    growths = [e["growth_over_baseline_bytes"] for e in work.values()
               if e.get("growth_over_baseline_bytes") is not None]
    row["growth_bytes"] = max(growths) if growths else None
    peak_phase = max(work, key=lambda p: work[p].get("peak_bytes") or 0) if work else None
    parts = ((work[peak_phase].get("breakdown_bytes_per_rank") or [{}])[0] or {}) if peak_phase else {}
    row["runtime_bytes_rank0"] = parts.get("runtime_bytes")
    row["rest_at_peak_bytes_rank0"] = parts.get("rest_bytes")
    row["upstream_defects"] = ", ".join(d["id"] + (" (fixed)" if "fixed by" in d.get("handling", "") else "")
                                        for d in result.get("upstream_defects") or []) or None
    row["cut_short"] = bool(result.get("cut_short"))
    throughput = result.get("throughput") or {}
    for phase, entry in (throughput.get("phases") or {}).items():
        row[f"tokens_per_s_{phase}"] = _number(entry.get("tokens_per_s_global"))
        row[f"samples_per_s_{phase}"] = _number(entry.get("samples_per_s_global"))
        row[f"time_s_per_step_{phase}"] = _number(entry.get("time_s_per_step"))
    for phase, share in (throughput.get("share_of_step_time") or {}).items():
        row[f"share_{phase}"] = _number(share)
    stability = result.get("stability") or {}
    row["stability"] = stability.get("classification")
    row["first_nonfinite_step"] = stability.get("first_nonfinite_step")
    row["overflow_skips"] = sum((stability.get("overflow_skipped_steps") or {}).values()) if stability else None
    row["loss_scale_min"] = _number(stability.get("loss_scale_min"))
    learning = result.get("learning") or {}
    for key in ("reward_start", "reward_end", "accuracy_start", "accuracy_end", "generated_tokens_start",
                "generated_tokens_end"):
        row[key] = _number(learning.get(key))
    losses = learning.get("loss_curve") or []
    row["loss_start"], row["loss_end"] = (_number(losses[0]), _number(losses[-1])) if losses else (None, None)
    row["model_state_bytes_rank0"] = _model_state_rank0(result.get("model_state") or {})
    # the RM's evaluation runs outside the step loop; every other timed phase is part of a step
    step_phases = [row[k] for k in row if k.startswith("time_s_per_step_") and k != "time_s_per_step_evaluation"
                   and row[k] is not None]
    row["step_time_s"] = sum(step_phases) if step_phases else None
    replicas = (row["nproc"] or 1) // ((row["tp"] or 1) * (row["pp"] or 1))
    row["samples_per_s_step"] = (row["batch"] * replicas / row["step_time_s"]
                                 if row["step_time_s"] and row["batch"] else None)
    # Equal work across frameworks: the step as it would run with one update pass over its rollout (trlx
    # makes 4 by default, the others 1): generation + experience + training / passes.
    row["update_passes"] = update_passes(record["config"]) if stage == "ppo" else None
    training = row.get("time_s_per_step_training")
    one_pass = (row["step_time_s"] - training * (1 - 1 / row["update_passes"])
                if stage == "ppo" and row["step_time_s"] and training is not None else None)
    row["samples_per_s_one_pass"] = row["batch"] * replicas / one_pass if one_pass and row["batch"] else None
    row["wall_time_s"] = _number(result.get("wall_time_s"))
    return row


def _model_state_rank0(state: dict[str, Any]) -> int | None:
    """Parameter + optimizer-state bytes that rank 0's engines hold, over every model role."""
    roles = [role for name, role in state.items() if name != "method" and isinstance(role, dict)]
    if not roles:
        return None
    return sum((role.get(key) or [0])[0] or 0 for role in roles
               for key in ("param_bytes_per_rank", "optimizer_state_bytes_per_rank"))


def _check(record: Any) -> str | None:
    if not isinstance(record, dict):
        return "not a JSON object"
    if record.get("schema_version") != SCHEMA_VERSION:
        return f"schema_version {record.get('schema_version')!r}, this report reads {SCHEMA_VERSION}"
    for key in ("config", "status", "stages"):
        if key not in record:
            return f"missing key {key!r}"
    if not isinstance(record["stages"], dict) or not isinstance(record["config"], dict):
        return "config and stages must be objects"
    return None


def collect(root: str) -> Collection:
    """Every record.json under `root` (a sweep, a runs directory, or several)."""
    collection = Collection(root=root)
    for path in sorted(glob.glob(os.path.join(root, "**", RECORD_NAME), recursive=True)):
        if f"{os.sep}report{os.sep}" in path:
            continue
        run = os.path.relpath(os.path.dirname(path), root)
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError) as err:
            collection.problems.append(Problem(path, f"unreadable: {type(err).__name__}: {err}"))
            continue
        reason = _check(record)
        if reason is not None:
            collection.problems.append(Problem(path, reason))
            continue
        collection.records[run] = record
        for stage, result in record["stages"].items():
            collection.rows.append(stage_row(run, record, stage, result))
    return collection


def phases_in(rows: list[dict[str, Any]], prefix: str) -> list[str]:
    """Phases that some row has a `<prefix>_<phase>...` column for, in pipeline order."""
    return [p for p in PHASE_ORDER if any(f"{prefix}_{p}" in k for row in rows for k in row)]
