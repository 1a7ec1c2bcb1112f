"""The sweep collector: every record under a directory, flattened to one row per (run, stage).

A record that cannot be read (truncated, not JSON, wrong schema) becomes a Problem and is skipped; the
rest still make a report. Rows keep the units in the column names (`_bytes`, `_s`, `_per_s`); memory
figures are the max over ranks, rates are global (summed over data-parallel replicas).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import statistics
from dataclasses import dataclass, field
from typing import Any

from bench.results import provenance
from bench.results.record import OUTSIDE_STEP, PHASE_ORDER, SCHEMA_VERSION

RECORD_NAME = "record.json"
# Config columns every table shows; the cell itself is the whole resolved configuration (`cell_config`).
CONFIG_COLUMNS = ("framework", "stage", "model", "precision", "zero", "lora", "batch", "grad_accum", "nproc", "tp",
                  "pp", "plugin", "offload", "grad_ckpt", "quant", "normalize", "reference", "upstream_fix",
                  "harness_extension", "seed")
# Keys that never tell two cells apart: the seed (repeats differ in it alone) and where/how a run was filed.
# global_batch: a check before launch, nothing the run does; verbose: what the terminal shows.
BOOKKEEPING_KEYS = ("seed", "output_root", "force", "sweep_name", "run_name", "wandb", "launcher.timeout_s",
                    "launcher.stall_s", "preflight", "global_batch", "verbose",
                    # where a node stands in a run over several nodes, not what the run does
                    "launcher.node_rank", "launcher.rdzv_endpoint", "launcher.rdzv_id", "launcher.rdzv_timeout_s",
                    # where a plan=FILE run's plan was read from (what it sets is in the config's other keys)
                    "plan_file")
# Keys added to conf/config.yaml after records were first kept, with the value a record without the key ran
# with: an older record counts as that default, so that adding a knob never splits its cells.
# (memory_release_every: records before the key had the heap released before every phase that needed it; the
# key's null default means 4 outside soak runs, so new runs do not pool with them.)
ADDED_KEYS = {"soak": False, "memory_budget_gb": None, "memory_release_every": 1, "debug.leak_mib_per_step": 0,
              "debug.leak_phase": "training", "checkpoint.every": 0, "checkpoint.async": False, "resume": False,
              "reference.quant": "none", "reward.quant": "none", "grad_clip": None,
              "quant_library": "bitsandbytes",  # the only library before the key existed
              "reward.normalize": None, "ds.allgather_bucket_size": None, "ds.reduce_bucket_size": None,
              "ds.overlap_comm": None, "lora_targets": None, "lora_alpha": None,
              "grad_accum": 1, "stage_steps.grpo": 10,
              "init.sft_prerequisite": False,  # PPO's actor started from random base weights before the key
              "launcher.nnodes": 1,
              "framework.critic_zero_stage": None, "framework.critic_gradient_checkpointing": None,
              # curated records before the key ran under glibc's own threshold (no script set an allocator variable)
              "memory_mmap_threshold": None}
# A run carrying this tag is meant to fail (a forced divergence): the stability table shows it, no claim,
# decision or figure of trained runs takes it as evidence.
FORCED_FAILURE = "forced-failure"
# Cell keys that set how a run is measured rather than what it runs: a decision-tree leaf compares frameworks'
# cells only where these agree (the workload's lengths, the warm-up, the heap release schedule, the allocator's
# mmap threshold, soak mode).
MEASUREMENT_KEYS = ("prompt_len", "answer_len", "warmup_steps", "memory_release_every", "memory_mmap_threshold",
                    "soak")
# The phases peak, growth and peak phase are all read from: every phase after `imports` (the post-import
# baseline itself), init included, since a device runs out of memory in whichever phase peaks.
MEMORY_PHASES = tuple(p for p in PHASE_ORDER if p != "imports")
# Notes whose first word names a piece of the resolved engine (plugin, optimizer, engine, reference mode).
ENGINE_NOTES = ("plugin:", "engine:", "optimizer:", "reference:")


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
    cells: dict[str, dict[str, Any]] = field(default_factory=dict)  # cell id -> its flat configuration
    duplicates: list[tuple[str, str]] = field(default_factory=list)  # (copy skipped, run kept)
    allow_mixed: bool = False  # cells whose runs differ in provenance still count as evidence

    def refused(self) -> dict[str, str]:
        """Cells of mixed provenance that verdicts and leaves leave out: cell id -> the reasons."""
        return {} if self.allow_mixed else {r["cell"]: r["mixed"] for r in self.rows if r.get("mixed")}


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config -> {"a.b.c": value}; lists become JSON text so values stay hashable."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = json.dumps(value) if isinstance(value, list) else value
    return flat


def cell_config(record: dict[str, Any], stage: str) -> dict[str, Any]:
    """What identifies a cell: the whole resolved configuration of a stage row, the device it ran on, minus
    the seed and bookkeeping; a checkpoint path counts only as "given" (each run writes its own)."""
    flat = {k: v for k, v in flatten(record["config"]).items() if k not in BOOKKEEPING_KEYS}
    for key, default in ADDED_KEYS.items():
        flat.setdefault(key, default)
    if flat.get("init.sft") is not None or flat.get("stage.name") != "ppo":
        flat["init.sft_prerequisite"] = None  # it decides only where a PPO run without init.sft starts
    for key in ("init.sft", "init.rm"):
        if flat.get(key) is not None:
            flat[key] = "given"
    if flat["reference.quant"] == flat["reward.quant"] == "none":
        flat["quant_library"] = None  # nothing quantized: which library would have is no difference
    flat["stage_row"] = stage
    flat["device"] = (record.get("environment") or {}).get("device")
    return flat


def cell_id(config: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:10]


def tags_of(config: dict[str, Any]) -> tuple[str, ...]:
    return tuple(config.get("tags") or ())


def is_forced_failure(row: dict[str, Any]) -> bool:
    return FORCED_FAILURE in (row.get("tags") or "").split(", ")


def _config_columns(config: dict[str, Any]) -> dict[str, Any]:
    framework = config.get("framework", {})
    return {
        "framework": framework.get("name"),
        "stage": None,  # set per stage row
        "model": config.get("model", {}).get("name"),
        "precision": config.get("precision"),
        "zero": config.get("zero"),
        "lora": config.get("lora"),
        "lora_targets": _lora_targets(config),
        "lora_alpha": config.get("lora_alpha") if config.get("lora") else None,  # None: the framework's
        "batch": config.get("batch"),
        "grad_accum": config.get("grad_accum", 1),
        # every rank of the run: launcher.nproc on each of launcher.nnodes nodes (the per-rank rates divide by it)
        "nproc": (config.get("launcher", {}).get("nproc") or 1) * (config.get("launcher", {}).get("nnodes") or 1),
        "nnodes": config.get("launcher", {}).get("nnodes") or 1,
        "tp": config.get("tp", 1),
        "pp": config.get("pp", 1),
        "plugin": config.get("plugin", "auto"),
        "offload": config.get("offload"),
        "grad_ckpt": config.get("grad_ckpt"),
        "quant": _quant(config),
        "normalize": (config.get("reward") or {}).get("normalize") or "upstream",
        "allgather_bucket": (config.get("ds") or {}).get("allgather_bucket_size"),  # None: the engine default
        "reference": _trlx_reference(config) if framework.get("name") == "trlx" else None,
        # an opt-in fix of an upstream defect changes what runs: such runs never pool with upstream's
        "upstream_fix": "fp16-zero0-loss-scale" if framework.get("fix_fp16_zero0_loss_scale") else None,
        "harness_extension": None,  # from the record (the framework's options name the knobs upstream lacks)
        "seed": config.get("seed"),
    }


def _lora_targets(config: dict[str, Any]) -> str | None:
    """lora_targets as asked ("upstream": the framework's default set); None without LoRA."""
    if not config.get("lora"):
        return None
    targets = config.get("lora_targets")
    return "upstream" if targets is None else targets if isinstance(targets, str) else "+".join(targets)


def engine_text(notes: list[str]) -> str | None:
    """The resolved engine in a few words: the notes naming plugin, engine, optimizer and reference mode,
    each cut before its explanation."""
    parts = [n.split(" (")[0].split("(")[0].split(";")[0].strip() for n in notes if n.startswith(ENGINE_NOTES)]
    return "; ".join(parts) or None


def finetune_mode(config: dict[str, Any], result: dict[str, Any]) -> str:
    """lora, full, or partial: a trained model (one with optimizer state) whose trainable parameters are
    fewer than its parameters without LoRA (trlx's hydra policy trains only its top blocks)."""
    if config.get("lora"):
        return "lora"
    state, params = result.get("model_state") or {}, result.get("params") or {}
    for role, entry in state.items():
        trained = isinstance(entry, dict) and any(entry.get("optimizer_state_bytes_per_rank") or [])
        counts = params.get(role) or {}
        if trained and counts.get("total") and counts.get("trainable", 0) < counts["total"]:
            return "partial"
    return "full"


# Dense bf16/fp16 tensor-core peak of one device (TFLOP/s, SXM parts), for MFU; none for CPUs (no published peak).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "V100": 125.0, "A10": 125.0, "L4": 121.0}


def device_peak_tflops(environment: dict[str, Any]) -> float | None:
    gpu = str(environment.get("gpu") or "")
    return next((peak for name, peak in PEAK_TFLOPS.items() if name in gpu), None)


def update_passes(config: dict[str, Any], stage: dict[str, Any] | None = None) -> int:
    """Passes over each step's rollouts a PPO stage's update made: what the stage record states (the adapter's
    own option), else, for records written before it did, the config's ppo_epochs (DS-Chat, trlx, the
    reference), num_update_steps (coati) or num_ppo_epochs (TRL)."""
    stated = (stage or {}).get("update_passes")
    if isinstance(stated, int) and stated >= 1:
        return stated
    ppo = config.get("framework", {}).get("ppo") or {}
    return int(ppo.get("ppo_epochs") or ppo.get("num_update_steps") or ppo.get("num_ppo_epochs") or 1)


def rollouts_per_step(config: dict[str, Any], stage: dict[str, Any] | None = None) -> int:
    """Prompt batches (of `batch` each, per replica) a PPO step generated and trained on: what the stage record
    states (the adapter's own count), else, for records written before it did, from the config: coati's
    num_collect_steps, trlx's num_rollouts / batch (upstream's default 4 x batch x grad_accum), the others'
    grad_accum."""
    stated = (stage or {}).get("rollouts_per_step")
    if isinstance(stated, int) and stated >= 1:
        return stated
    framework = config.get("framework") or {}
    ppo = framework.get("ppo") or {}
    batch, accum = config.get("batch") or 1, config.get("grad_accum") or 1
    if framework.get("name") == "colossalai":
        return int(ppo.get("num_collect_steps") or 1)
    if framework.get("name") == "trlx":
        return int((ppo.get("num_rollouts") or 4 * batch * accum) // batch)
    return int(accum)


def _quant(config: dict[str, Any]) -> str:
    """The frozen roles' weights: "none", or e.g. "ref int8, reward int8 (torchao)"."""
    modes = {role: (config.get(key) or {}).get("quant", "none") for role, key in (("ref", "reference"),
                                                                                   ("reward", "reward"))}
    quantized = ", ".join(f"{role} {mode}" for role, mode in modes.items() if mode != "none")
    return f"{quantized} ({config.get('quant_library', ADDED_KEYS['quant_library'])})" if quantized else "none"


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
    row["tags"] = ", ".join(tags_of(record["config"])) or None
    row["cell"] = cell_id(cell_config(record, stage))
    row["device"] = (record.get("environment") or {}).get("device")
    row["finetune"] = finetune_mode(record["config"], result)
    row["engine"] = engine_text(result.get("notes") or [])
    row["notes"] = " | ".join(result.get("notes") or []) or None
    origin = provenance.of(record)
    row.update(git_commit=origin.commit, git_dirty=origin.dirty, git_diff=origin.diff, code=origin.code,
               host_type=origin.host_type, versions=origin.versions, measurement_env=origin.settings)
    flat = cell_config(record, stage)
    row["measurement"] = " ".join(f"{k}={flat.get(k)}" for k in MEASUREMENT_KEYS)
    row["mixed"], row["refused"] = None, False  # set by collect() once the cell's other runs are known
    if stage != "ppo":  # the reference model exists in PPO only
        row["reference"] = None
    for part in (_memory_columns, _throughput_columns, _stability_columns, _learning_columns, _state_columns,
                 _rate_columns, _checkpoint_columns, _step_columns):
        part(row, record, stage, result)
    return row


def _memory_columns(row: dict[str, Any], record: dict[str, Any], stage: str, result: dict[str, Any]) -> None:
    """Per-phase peaks and growths; the peak, its growth and phase over MEMORY_PHASES; the breakdown."""
    memory = result.get("memory") or {}
    row["memory_method"] = memory.get("method")
    for phase, entry in (memory.get("phases") or {}).items():
        row[f"peak_{phase}_bytes"] = entry.get("peak_bytes")
        row[f"growth_{phase}_bytes"] = entry.get("growth_over_baseline_bytes")
    baselines = [b for b in memory.get("baseline_bytes_per_rank", []) if b is not None]
    row["baseline_bytes"] = max(baselines) if baselines else None
    # Peak, growth over the post-import baseline and the phase that sets them, all over MEMORY_PHASES
    work = {p: e for p, e in (memory.get("phases") or {}).items() if p in MEMORY_PHASES}
    peaks = {p: e["peak_bytes"] for p, e in work.items() if e.get("peak_bytes") is not None}
    growths = [e["growth_over_baseline_bytes"] for e in work.values()
               if e.get("growth_over_baseline_bytes") is not None]
    row["peak_bytes"] = max(peaks.values()) if peaks else None
    row["growth_bytes"] = max(growths) if growths else None
    peak_phase = max(peaks, key=lambda p: peaks[p]) if peaks else None
    parts = ((work[peak_phase].get("breakdown_bytes_per_rank") or [{}])[0] or {}) if peak_phase else {}
    row["runtime_bytes_rank0"] = parts.get("runtime_bytes")
    row["rest_at_peak_bytes_rank0"] = parts.get("rest_bytes")
    row["peak_phase"] = peak_phase
    for phase, entry in work.items():
        for term, value in phase_breakdown(entry, result.get("model_state") or {}).items():
            row[f"{term}_{phase}_bytes"] = value
    row["upstream_defects"] = ", ".join(d["id"] + (" (fixed)" if "fixed by" in d.get("handling", "") else "")
                                        for d in result.get("upstream_defects") or []) or None
    row["cut_short"] = bool(result.get("cut_short"))


def _throughput_columns(row: dict[str, Any], record: dict[str, Any], stage: str, result: dict[str, Any]) -> None:
    """Per-phase rates and step-time shares."""
    throughput = result.get("throughput") or {}
    for phase, entry in (throughput.get("phases") or {}).items():
        row[f"tokens_per_s_{phase}"] = _number(entry.get("tokens_per_s_global"))
        row[f"samples_per_s_{phase}"] = _number(entry.get("samples_per_s_global"))
        row[f"time_s_per_step_{phase}"] = _number(entry.get("time_s_per_step"))
    for phase, share in (throughput.get("share_of_step_time") or {}).items():
        row[f"share_{phase}"] = _number(share)


def _stability_columns(row: dict[str, Any], record: dict[str, Any], stage: str, result: dict[str, Any]) -> None:
    """The stability classification and its counters."""
    stability = result.get("stability") or {}
    row["stability"] = stability.get("classification")
    row["first_nonfinite_step"] = stability.get("first_nonfinite_step")
    row["overflow_skips"] = sum((stability.get("overflow_skipped_steps") or {}).values()) if stability else None
    row["loss_scale_min"] = _number(stability.get("loss_scale_min"))


def _learning_columns(row: dict[str, Any], record: dict[str, Any], stage: str, result: dict[str, Any]) -> None:
    """Learning figures: rewards, accuracies, KL, held-out scores, the loss at start and end."""
    learning = result.get("learning") or {}
    for key in ("reward_start", "reward_end", "accuracy_start", "accuracy_end", "generated_tokens_start",
                "generated_tokens_end", "kl_start", "kl_end", "converged_step", "preferred_fraction_start",
                "preferred_fraction_end"):
        row[key] = _number(learning.get(key))
    heldout = learning.get("heldout_scores") or {}
    row["heldout_score_mean"], row["heldout_score_std"] = heldout.get("mean"), heldout.get("std")
    losses = learning.get("loss_curve") or []
    row["loss_start"], row["loss_end"] = (_number(losses[0]), _number(losses[-1])) if losses else (None, None)
    # the training loss at the end as one figure: the mean over the last steps (PPO's window rule, 1-10 steps)
    tail = [v for v in losses[-max(1, min(10, len(losses) // 3)):] if _number(v) is not None]
    row["loss_end_mean"] = sum(_number(v) for v in tail) / len(tail) if tail else None


def _state_columns(row: dict[str, Any], record: dict[str, Any], stage: str, result: dict[str, Any]) -> None:
    """Rank 0's model state, the frozen roles' weights, the quantized roles' deviations."""
    row["model_state_bytes_rank0"] = _model_state_rank0(result.get("model_state") or {})
    state = result.get("model_state") or {}
    frozen = [(state.get(role) or {}).get("param_bytes_per_rank") or [None] for role in ("ref", "reward")]
    row["frozen_param_bytes_rank0"] = (sum(b[0] for b in frozen) if stage == "ppo" and all(b[0] is not None
                                                                                         for b in frozen) else None)
    for role, entry in (result.get("quantized") or {}).items():
        row[f"{role}_quant_deviation"] = entry.get("mean_abs_deviation")
        row[f"{role}_quant_scale"] = entry.get("mean_abs_value")
        row[f"{role}_quant_saved_bytes"] = entry["weight_bytes_before"] - entry["weight_bytes_after"]


def _rate_columns(row: dict[str, Any], record: dict[str, Any], stage: str, result: dict[str, Any]) -> None:
    """The step time, the samples a step trains on and the rates per step and at one update pass."""
    # the RM's evaluation and checkpoint saves run outside the steps; every other timed phase is part of one
    step_phases = [row[k] for k in row if k.startswith("time_s_per_step_")
                   and k.removeprefix("time_s_per_step_") not in OUTSIDE_STEP and row[k] is not None]
    row["step_time_s"] = sum(step_phases) if step_phases else None
    replicas = (row["nproc"] or 1) // ((row["tp"] or 1) * (row["pp"] or 1))
    # samples a step trains on: PPO's are its rollouts (coati collects 2 a step, trlx num_rollouts / batch)
    per_replica = rollouts_per_step(record["config"], result) if stage == "ppo" else row["grad_accum"]
    row["rollouts_per_step"] = per_replica if stage == "ppo" else None
    row["global_batch"] = row["batch"] * per_replica * replicas if row["batch"] else None
    row["samples_per_s_step"] = (row["global_batch"] / row["step_time_s"]
                                 if row["step_time_s"] and row["global_batch"] else None)
    # Equal work across frameworks: the step as it would run with one update pass over its rollout (trlx
    # makes 4 by default, the others 1): generation + experience + training / passes.
    row["update_passes"] = update_passes(record["config"], result) if stage == "ppo" else None
    training = row.get("time_s_per_step_training")
    one_pass = (row["step_time_s"] - training * (1 - 1 / row["update_passes"])
                if stage == "ppo" and row["step_time_s"] and training is not None else None)
    row["samples_per_s_one_pass"] = row["global_batch"] / one_pass if one_pass and row["global_batch"] else None


def _checkpoint_columns(row: dict[str, Any], record: dict[str, Any], stage: str, result: dict[str, Any]) -> None:
    """Wall time, checkpoint saves and their stalls, the step a resumed run started from."""
    row["wall_time_s"] = _number(result.get("wall_time_s"))
    saves = (result.get("checkpoints") or {}).get("saves") or []
    stalls = [s["stall_s"] for s in saves if s.get("stall_s") is not None]
    writes = [s["background_write_s"] for s in saves if s.get("background_write_s") is not None]
    row["checkpoint_mode"] = saves[0]["mode"] if saves else None
    row["checkpoint_saves"] = len(saves) or None
    row["checkpoint_stall_s"] = statistics.median(stalls) if stalls else None  # per save
    row["checkpoint_write_s"] = statistics.median(writes) if writes else None
    row["checkpoint_bytes"] = max((s.get("bytes_written") or 0 for s in saves), default=None) or None
    row["resumed_from_step"] = result.get("resumed_from_step")


def _step_columns(row: dict[str, Any], record: dict[str, Any], stage: str, result: dict[str, Any]) -> None:
    """Timed steps, their spread, rank 0's TFLOP/s and MFU, trained parameters, LoRA layout, fixed cost."""
    throughput = result.get("throughput") or {}
    step_times = [t for t in throughput.get("step_times_s") or [] if isinstance(t, (int, float))]
    row["timed_steps"] = len(step_times) or None
    row["step_time_min_s"] = min(step_times) if step_times else None
    row["step_time_max_s"] = max(step_times) if step_times else None
    row["step_time_median_s"] = statistics.median(step_times) if step_times else None
    # rank 0's TFLOP per step (each phase's rate x its time on rank 0) over the step time of the slowest rank
    tflop = sum(entry["tflops_per_s_per_rank"][0] * entry["time_s_per_step_per_rank"][0]
                for phase, entry in (throughput.get("phases") or {}).items()
                if phase not in OUTSIDE_STEP and entry.get("tflops_per_s_per_rank"))
    row["tflops_per_s_rank0"] = tflop / row["step_time_s"] if tflop and row["step_time_s"] else None
    peak = device_peak_tflops(record.get("environment") or {})
    row["mfu"] = row["tflops_per_s_rank0"] / peak if peak and row["tflops_per_s_rank0"] else None
    row["trained_params"] = _trained_params(result)
    row["trainable_params"] = _trained_params(result, "trainable")
    # the block layers the built models adapt (the first trained role's), and their alpha: what ran
    layout = next(iter(((result.get("engine_knobs") or {}).get("lora") or {}).values()), None)
    row["lora_layers"] = "+".join(layout["targets"] + layout["other"]) if layout else None
    row["lora_alpha_applied"] = _number(layout["alpha"]) if layout else None
    for part, seconds in (result.get("fixed_cost") or {}).items():  # launch_s, imports_s, init_s, ... fixed_s
        if part != "method":
            row[f"fixed_{part}"] = _number(seconds)

def _trained_params(result: dict[str, Any], count: str = "total") -> int | None:
    """Parameters of the trained models (those with optimizer state): the denominator of model-state bytes;
    `count` trainable: those of them that train (LoRA: its factors, and what else the framework leaves on)."""
    state, params = result.get("model_state") or {}, result.get("params") or {}
    trained = {role for role, e in state.items()
               if isinstance(e, dict) and any(e.get("optimizer_state_bytes_per_rank") or [])}
    # PPO trains its critic beside the actor in every framework; TRL's one optimizer over both models
    # (PolicyAndValueWrapper) books all of its DeepSpeed partitions to the actor, so its critic shows none of its own
    if "actor" in trained and "critic" in state and (params.get("critic") or {}).get("trainable"):
        trained.add("critic")
    return sum((params.get(role) or {}).get(count, 0) for role in trained) or None


# The plain-PyTorch reference (adapters/reference): measured like a framework, shown as the yardstick, never
# a verdict (no one deploys "no framework" for RLHF without writing one).
YARDSTICK = "torch"

# the first two make up the post-import baseline that growth is measured from
BASELINE_TERMS = ("process_start", "runtime")
BREAKDOWN_TERMS = (*BASELINE_TERMS, "params", "optimizer", "reward_fn", "rest")


def phase_breakdown(entry: dict[str, Any], model_state: dict[str, Any]) -> dict[str, float]:
    """One phase's peak, on the rank with the highest peak, split into the baseline's two terms (process start,
    the engine runtime's imports), parameters, optimizer state (the model state split by the engines' own
    param/optimizer byte counts), the trlx reward function, and the rest (activations, gradients, caches, logits,
    buckets, slack)."""
    peaks = entry.get("peak_bytes_per_rank") or []
    if not any(p is not None for p in peaks):
        return {}
    rank = max(range(len(peaks)), key=lambda i: peaks[i] or 0)
    parts = (entry.get("breakdown_bytes_per_rank") or [{}] * (rank + 1))[rank] or {}
    if parts.get("process_start_bytes") is None:
        return {}
    state = parts.get("model_state_bytes") or 0
    roles = [r for n, r in model_state.items() if isinstance(r, dict) and n != "reward_fn"]
    params = sum(((r.get("param_bytes_per_rank") or [])[rank:rank + 1] or [0])[0] or 0 for r in roles)
    optim = sum(((r.get("optimizer_state_bytes_per_rank") or [])[rank:rank + 1] or [0])[0] or 0 for r in roles)
    share = params / (params + optim) if params + optim else 1.0
    return {"process_start": parts["process_start_bytes"], "runtime": parts.get("runtime_bytes") or 0,
            "params": state * share, "optimizer": state * (1 - share),
            "reward_fn": parts.get("reward_fn_bytes") or 0, "rest": parts.get("rest_bytes") or 0}


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


def collect(root: str, allow_mixed: bool = False) -> Collection:
    """Every record.json under `root` (a sweep, a runs directory, or several). A run found twice (a sweep and
    its curated copy: same run id, same creation time) counts once, at its first path. Each row's `mixed`
    names how its cell's runs differ in provenance (bench.results.provenance), None where they agree."""
    collection = Collection(root=root, allow_mixed=allow_mixed)
    seen: dict[tuple[str, str], str] = {}
    for path in sorted(glob.glob(os.path.join(glob.escape(root), "**", RECORD_NAME), recursive=True)):
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
        identity = (str(record.get("run_id")), str(record.get("created_utc")))
        if identity in seen:
            collection.duplicates.append((run, seen[identity]))
            continue
        seen[identity] = run
        collection.records[run] = record
        for stage, result in record["stages"].items():
            collection.rows.append(stage_row(run, record, stage, result))
            collection.cells.setdefault(collection.rows[-1]["cell"], cell_config(record, stage))
    by_cell: dict[str, list[dict[str, Any]]] = {}
    for row in collection.rows:
        by_cell.setdefault(row["cell"], []).append(row)
    for runs in by_cell.values():
        reasons = provenance.mixture([provenance.of(collection.records[r["run"]]) for r in runs])
        for row in runs:
            row["mixed"] = ", ".join(reasons) or None
            row["refused"] = bool(reasons) and not allow_mixed  # no verdict or leaf takes it as evidence
    return collection


def phases_in(rows: list[dict[str, Any]], prefix: str) -> list[str]:
    """Phases that some row has a `<prefix>_<phase>...` column for, in pipeline order."""
    return [p for p in PHASE_ORDER if any(f"{prefix}_{p}" in k for row in rows for k in row)]
