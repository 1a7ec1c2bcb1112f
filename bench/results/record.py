"""The result record: one JSON file per run, written atomically, with a schema version.

Every figure carries its unit in its key (`*_bytes`, `*_s`, `*_per_s`). Per-rank files written by the
workers are merged here: peaks aggregate as the max over ranks (never a sum), throughput per rank and
globally, stability as the worst rank.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.measure.flops import FORMULA
from bench.measure.reward_trend import reward_trend
from bench.run.spec import ROLLOUT_STAGES

SCHEMA_VERSION = 2  # 2: growth over the post-import baseline, an `imports` phase, CUDA peaks on allocated bytes
STATUSES = ("ok", "oom", "nan", "unsupported", "error", "timeout", "skipped")
# When ranks disagree, the most telling failure names the stage: an OOM on one rank with a knock-on error on
# another is an OOM (and the sweep's OOM back-stop fires).
STATUS_PRECEDENCE = ("oom", "nan", "timeout", "unsupported", "error")
_CLASS_ORDER = ("stable", "recovered", "skip-storm", "diverged")
PHASE_ORDER = ("imports", "init", "onload", "generation", "experience", "offload", "training", "checkpoint",
               "evaluation")
SETUP_PHASES = ("imports", "init")  # run once per stage: time and memory, no per-step throughput
# Timed, but not part of a step's work: the RM's evaluation, and checkpoint saves (their time is the stall)
OUTSIDE_STEP = ("checkpoint", "evaluation")
_NON_FINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _jsonable(value: Any) -> Any:
    """Non-finite floats become the strings "nan" / "inf" / "-inf": strict JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_json(path: str, data: Any) -> None:
    """Write atomically: a reader sees the old file or the complete new one, never a torn one."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(_jsonable(data), f, indent=2, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class StageRecord:
    status: str  # one of STATUSES; ranks that disagree resolve by STATUS_PRECEDENCE
    error: dict[str, Any] | None = None  # type, message and traceback of the failure that set the status
    ranks: int = 0  # ranks that wrote a result
    wall_time_s: float | None = None  # the stage's torchrun, launch to exit
    params: dict[str, Any] = field(default_factory=dict)  # total and trainable parameters per role
    model_state: dict[str, Any] = field(default_factory=dict)  # parameter and optimizer bytes per rank and role
    memory: dict[str, Any] = field(default_factory=dict)  # per-phase peaks, growth, breakdown, timeline, prediction
    throughput: dict[str, Any] = field(default_factory=dict)  # per-phase s/step, tokens/s, samples/s, TFLOP/s
    stability: dict[str, Any] = field(default_factory=dict)  # classification, non-finite steps, skips, loss scale
    learning: dict[str, Any] = field(default_factory=dict)  # loss / reward windows, accuracy, trend, convergence
    steps: list[dict[str, Any]] = field(default_factory=list)  # losses, norms, lr, optimizer steps, PPO figures
    notes: list[str] = field(default_factory=list)  # facts about how the engines ran (one sentence each)
    upstream_defects: list[dict[str, str]] = field(default_factory=list)  # known engine defects the run hit
    layout_per_rank: list[dict[str, int]] = field(default_factory=list)  # each rank's dp (and tp, pp) rank
    computation_dtypes: dict[str, str] = field(default_factory=dict)  # the dtype of each loss-side computation
    quantized: dict[str, Any] = field(default_factory=dict)  # frozen roles in 8/4 bits (reference.quant, reward.quant)
    engine_knobs: dict[str, Any] = field(default_factory=dict)  # common knobs read back from the built engines
    update_passes: int | None = None  # PPO: the passes the framework's update makes over each step's rollouts
    rollouts_per_step: int | None = None  # PPO: prompt batches (of `batch` each) a step generates and trains on
    live_tensors: dict[str, Any] = field(default_factory=dict)  # PPO: storages alive at the reward model's call
    cut_short: dict[str, Any] | None = None  # ranks stopped by SIGTERM and the steps they had done
    checkpoint: str | None = None  # the stage's closing save (what a later stage loads)
    checkpoints: dict[str, Any] = field(default_factory=dict)  # saves during the stage (checkpoint.every)
    resumed_from_step: int | None = None  # steps done by the checkpoint this stage resumed from (resume=true)
    fixed_cost: dict[str, Any] = field(default_factory=dict)  # where the time outside the steps goes
    nodes: list[dict[str, Any]] = field(default_factory=list)  # launcher.nnodes > 1: each node's host, ranks, fate


@dataclass
class ResultRecord:
    run_id: str  # the run's directory name
    config: dict[str, Any]  # the fully resolved Hydra config
    model: dict[str, Any] = field(default_factory=dict)  # the model as built: family and dimensions (a checkpoint's
    # own at model.path, the family's defaults filled in)
    status: str = "ok"  # the first failed stage's status (and its error below), else ok
    error: dict[str, Any] | None = None  # the first failed stage's error, or a refusal before any stage ran
    schema_version: int = SCHEMA_VERSION  # bumped when a figure's meaning changes
    created_utc: str = field(default_factory=utc_now)  # when the run started (UTC)
    finished_utc: str | None = None  # set by the last write: a record without it is a run cut short
    environment: dict[str, Any] = field(default_factory=dict)  # library versions, git commit, CPU/GPU, ranks, threads
    prerequisites: dict[str, Any] = field(default_factory=dict)  # the cached SFT and RM models a PPO stage started from
    harness_extension: list[dict[str, str]] = field(default_factory=list)  # knobs upstream cannot run
    preflight: dict[str, Any] | None = None  # preflight=on|shrink: the predicted peak, the budget, the batch run
    batch: dict[str, Any] = field(default_factory=dict)  # micro-batch, accumulation, ranks, global (batch_shape)
    plan: dict[str, Any] | None = None  # plan=FILE: the plan, each role's knobs, planned against measured
    stages: dict[str, StageRecord] = field(default_factory=dict)  # by stage name, in the order they ran

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def write(self, path: str) -> None:
        write_json(path, self.to_dict())


def _num(value: Any) -> float | None:
    """A number, including the non-finite values JSON stores as strings ("nan", "inf", "-inf")."""
    if isinstance(value, str):
        return _NON_FINITE.get(value)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _mean(values: list[Any]) -> Any:
    """Mean over ranks; a non-finite value on any rank makes the mean non-finite (it must not vanish)."""
    numbers = [v for v in (_num(x) for x in values) if v is not None]
    if not numbers:
        return values[0] if values else None
    if all(math.isfinite(n) for n in numbers):
        return statistics.fmean(numbers)
    return next(n for n in numbers if math.isnan(n)) if any(math.isnan(n) for n in numbers) else sum(numbers)


def batch_shape(micro: int, grad_accum: int, data_parallel: int) -> dict[str, Any]:
    """What one optimizer step of the record trains on: the global batch is micro x grad_accum x data parallel."""
    return {"micro_per_rank": micro, "grad_accum": grad_accum, "data_parallel": data_parallel,
            "global": micro * grad_accum * data_parallel,
            "definition": ("samples (PPO: prompts) per optimizer step over all data-parallel replicas; a step of the "
                           "record is one optimizer step of grad_accum micro-batches (PPO: rollouts) per rank, each "
                           "its own measured phase(s), their times summed and peaks maxed per step")}


def merge_status(statuses: list[str]) -> str:
    """The stage's status from its ranks' (and the launcher's) by STATUS_PRECEDENCE; "ok" only if all are."""
    failed = [s for s in statuses if s != "ok"]
    if not failed:
        return "ok"
    return min(failed, key=lambda s: STATUS_PRECEDENCE.index(s) if s in STATUS_PRECEDENCE else len(STATUS_PRECEDENCE))


def _live_tensors(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Each probed moment from the lowest rank that reached it (trlx scores on rank 0 only)."""
    live: dict[str, Any] = {}
    for rank in ranks:
        for point, groups in rank.get("live_tensors", {}).items():
            live.setdefault(point, {"rank": rank["rank"], "groups": groups})
    if live:
        live["method"] = ("gc census at the first call of each probed module in step 0: tensor storages alive "
                          "then and not alive after setup (weights, optimizer state, engine buffers left out), "
                          "grouped by the largest view's shape, dtype and device; bytes per storage")
    return live


#: Models that are not engines of the run but a function it calls (trlx's reward_fn): their own breakdown line.
SEPARATE_STATE_ROLES = ("reward_fn",)


def _state_bytes(rank: dict[str, Any], roles: tuple[str, ...] | None = None) -> int:
    """Model-state bytes this rank holds where phases are measured: on the accelerator under CUDA, all of it
    (parameters and optimizer state) on the CPU. `roles` None = every role but the separate ones. A model on
    a device of its own (not the rank's) is not where the phases are measured and counts nothing."""
    device = str(rank.get("device", "cpu"))
    on_cuda = device.startswith("cuda")
    total = 0
    for role, state in rank.get("model_state", {}).items():
        if (role in SEPARATE_STATE_ROLES) if roles is None else (role not in roles):
            continue
        if state.get("device") not in (None, device):
            continue
        total += state.get("accelerator_bytes", 0) if on_cuda else state["param_bytes"] + state["optimizer_state_bytes"]
    return total


def _breakdown(peak: int | None, rank: dict[str, Any]) -> dict[str, int | None]:
    start, baseline = rank.get("process_start_bytes"), rank.get("baseline_bytes")
    if peak is None or start is None or baseline is None:
        return {}
    state = _state_bytes(rank) if rank.get("model_state") else None
    breakdown: dict[str, int | None] = {
        "process_start_bytes": start,
        "runtime_bytes": baseline - start,
        "model_state_bytes": state,
    }
    separate = 0
    for role in SEPARATE_STATE_ROLES:
        if role in rank.get("model_state", {}):
            breakdown[f"{role}_bytes"] = _state_bytes(rank, (role,))
            separate += breakdown[f"{role}_bytes"]
    breakdown["rest_bytes"] = peak - baseline - (state or 0) - separate
    return breakdown


def _memory(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    phases: dict[str, Any] = {}
    names = [p for p in PHASE_ORDER if any(s["phase"] == p for r in ranks for s in r.get("phase_samples", []))]
    for phase in names:
        per_rank: dict[str, list[int | None]] = {}
        for key in ("peak_bytes", "host_peak_bytes", "allocated_peak_bytes", "reserved_peak_bytes", "end_bytes"):
            per_rank[key] = []
            for r in ranks:
                values = [s[key] for s in r.get("phase_samples", []) if s["phase"] == phase and s.get(key) is not None]
                per_rank[key].append(max(values) if values else None)
        peaks = [p for p in per_rank["peak_bytes"] if p is not None]
        growth = [p - r["baseline_bytes"] for p, r in zip(per_rank["peak_bytes"], ranks, strict=True)
                  if p is not None and r.get("baseline_bytes") is not None]
        entry = {
            "peak_bytes": max(peaks) if peaks else None,
            "peak_bytes_per_rank": per_rank["peak_bytes"],
            "growth_over_baseline_bytes": max(growth) if growth else None,
            "end_bytes_per_rank": per_rank["end_bytes"],
            "breakdown_bytes_per_rank": [_breakdown(p, r) if phase != "imports" else {}
                                         for p, r in zip(per_rank["peak_bytes"], ranks, strict=True)],
        }
        for key in ("host_peak_bytes", "allocated_peak_bytes", "reserved_peak_bytes"):
            values = [v for v in per_rank[key] if v is not None]
            if values and (key != "host_peak_bytes" or ranks[0].get("device", "cpu").startswith("cuda")):
                entry[key] = max(values)
                entry[f"{key}_per_rank"] = per_rank[key]
        phases[phase] = entry
    timeline: dict[tuple[str, int], dict[str, Any]] = {}
    for r in ranks:
        previous_end = None
        for s in r.get("phase_samples", []):
            if s.get("step") is not None and s["step"] >= 0:
                entry = timeline.setdefault((s["phase"], s["step"]), {"phase": s["phase"], "step": s["step"],
                                                                      "peak_bytes": 0})
                if s.get("peak_bytes") is None:  # this rank started the phase above its floor (memory tracker)
                    bound = s.get("peak_upper_bound_bytes") or 0
                    entry["peak_upper_bound_bytes"] = max(entry.get("peak_upper_bound_bytes", 0), bound)
                    entry["peak_bytes"] = None
                elif entry["peak_bytes"] is not None:  # max over ranks only where every rank measured
                    entry["peak_bytes"] = max(entry["peak_bytes"], s["peak_bytes"])
                if previous_end is not None and s.get("live_end_bytes") is not None:
                    # what the phase left alive: live allocations at its end minus at the end of the phase
                    # before it (this rank)
                    retained = s["live_end_bytes"] - previous_end
                    entry["retained_bytes"] = max(entry.get("retained_bytes", retained), retained)
                if s.get("reserved_peak_bytes") is not None and s.get("allocated_peak_bytes") is not None:
                    # CUDA: what the caching allocator holds beyond its tensors (fragmentation, pooled blocks)
                    slack = s["reserved_peak_bytes"] - s["allocated_peak_bytes"]
                    entry["allocator_slack_bytes"] = max(entry.get("allocator_slack_bytes", slack), slack)
            previous_end = s.get("live_end_bytes", previous_end)
    memory = {
        "method": ranks[0].get("memory_method"),
        "floor_rule": ranks[0].get("memory_floor_rule", 1),  # bench.measure.memory.FLOOR_RULE; 1 before the stamp
        "unit": "bytes",
        "aggregate": ("max over ranks of the max over steps (per-rank values alongside), of the steps whose phase "
                      "started from its own floor (see method); a timeline step a rank did not measure has "
                      "peak_bytes null and peak_upper_bound_bytes"),
        "process_start_bytes_per_rank": [r.get("process_start_bytes") for r in ranks],
        "baseline_bytes_per_rank": [r.get("baseline_bytes") for r in ranks],
        "baseline_definition": ("after the `imports` phase: the framework's engine libraries imported, their JIT "
                                "ops loaded and its process groups started, before any model is built; "
                                "growth_over_baseline_bytes (what frameworks are compared on) is measured from "
                                "here, so no difference between runs comes from which libraries they import"),
        "breakdown_definition": ("per rank and phase: process_start (torch and transformers imported; transformers "
                                 "itself imports accelerate and, where installed, deepspeed), runtime "
                                 "(the `imports` phase: engine libraries, JIT ops, process groups), model_state "
                                 "(parameters and optimizer states read from the engines' tensors after the last "
                                 "step; on CUDA only those on the GPU), reward_fn where the framework scores with a "
                                 "reward function outside its engines (trlx, rank 0; counted only on the rank's own "
                                 "device) and rest = peak - baseline - model_state - reward_fn "
                                 "(activations, gradients, caches, logits, communication buckets, allocator "
                                 "slack); they add up to the phase's peak"),
        "phases": phases,
        "timeline": [entry for _, entry in sorted(timeline.items(), key=lambda kv: kv[0][1])],
    }
    outside = [r.get("outside_allocator") for r in ranks]
    if any(o and "not_available" not in o for o in outside):
        memory["outside_allocator_per_rank"] = outside
    return memory


def _one_per_replica(per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    seen: dict[int, dict[str, Any]] = {}
    for entry in per_rank:
        seen.setdefault(entry["replica"], entry)
    return list(seen.values())


def _throughput(ranks: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    phases: dict[str, Any] = {}
    names = [p for p in PHASE_ORDER if any(s["phase"] == p for r in ranks for s in r.get("phase_samples", []))]
    for phase in names:
        if phase in SETUP_PHASES:
            times = [sum(s["time_s"] for s in r.get("phase_samples", []) if s["phase"] == phase) for r in ranks]
            phases[phase] = {"time_s": max(times), "time_s_per_rank": times}
            continue
        per_rank = []
        for r in ranks:
            measured = [s for s in r.get("phase_samples", [])
                        if s["phase"] == phase and s.get("step") is not None and s["step"] >= warmup]
            if not measured:
                continue
            time_s = sum(s["time_s"] for s in measured)
            tokens = sum(s.get("tokens") or 0 for s in measured)
            samples = sum(s.get("samples") or 0 for s in measured)
            flops = sum(s.get("flops") or 0.0 for s in measured)
            # a step may run a phase several times (grad_accum micro-batches): it counts once
            per_rank.append({"steps": len({s["step"] for s in measured}), "time_s": time_s, "tokens": tokens,
                             "samples": samples,
                             "flops": flops, "replica": r.get("data_parallel_rank", r["rank"])})
        if not per_rank:
            continue
        slowest = max(p["time_s"] for p in per_rank)
        if not any(s.get("tokens") is not None for r in ranks for s in r.get("phase_samples", [])
                   if s["phase"] == phase):  # host<->device model moves: time and bytes, no tokens
            moved = [s.get("bytes_moved") or 0 for s in ranks[0]["phase_samples"] if s["phase"] == phase]
            phases[phase] = {"measured_steps": per_rank[0]["steps"], "time_s_per_step": slowest / per_rank[0]["steps"],
                             "time_s_per_step_per_rank": [p["time_s"] / p["steps"] for p in per_rank],
                             "bytes_moved_per_step_rank0": max(moved) if moved else 0}
            continue
        steps = per_rank[0]["steps"]
        phases[phase] = {
            "measured_steps": steps,
            "time_s_per_step": slowest / steps,
            "time_s_per_step_per_rank": [p["time_s"] / p["steps"] for p in per_rank],
            "tokens_per_s_per_rank": [p["tokens"] / p["time_s"] for p in per_rank],
            "tokens_per_s_global": sum(p["tokens"] for p in _one_per_replica(per_rank)) / slowest,
            "samples_per_s_per_rank": [p["samples"] / p["time_s"] for p in per_rank],
            "samples_per_s_global": sum(p["samples"] for p in _one_per_replica(per_rank)) / slowest,
            "tflops_per_s_per_rank": [p["flops"] / p["time_s"] / 1e12 for p in per_rank],
        }
    step_phases = [p for p in phases if p not in (*SETUP_PHASES, *OUTSIDE_STEP)]
    total = sum(phases[p]["time_s_per_step"] for p in step_phases)
    return {
        "time_method": ranks[0].get("time_method"),
        "warmup_steps_excluded": warmup,
        "token_count": "real (non-pad) tokens; generation: prompt + generated tokens",
        "global_definition": ("sum of tokens over data-parallel replicas (ranks that split one model with "
                              "TP/PP share a batch and count once) / the slowest rank's time"),
        "flops_formula": FORMULA,
        "phases": phases,
        "share_of_step_time": {p: phases[p]["time_s_per_step"] / total for p in step_phases} if total else {},
        "step_times_s": _step_times(ranks, warmup),
        "step_times_definition": ("per measured step: the slowest rank's time summed over the step's phases "
                                  "(setup, the RM's evaluation and checkpoint saves excluded)"),
    }


def _step_times(ranks: list[dict[str, Any]], warmup: int) -> list[float]:
    """Each measured step's time (max over ranks of the summed phase times): the spread within one run."""
    per_rank: list[dict[int, float]] = []
    for r in ranks:
        steps: dict[int, float] = {}
        for s in r.get("phase_samples", []):
            if s["phase"] in (*SETUP_PHASES, *OUTSIDE_STEP) or s.get("step") is None or s["step"] < warmup:
                continue
            steps[s["step"]] = steps.get(s["step"], 0.0) + s["time_s"]
        per_rank.append(steps)
    common = sorted(set.intersection(*(set(steps) for steps in per_rank))) if per_rank else []
    return [max(steps[step] for steps in per_rank) for step in common]


def _stability(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    summaries = [r["stability"] for r in ranks if r.get("stability")]
    if not summaries:
        return {}
    worst = max(summaries, key=lambda s: _CLASS_ORDER.index(s["classification"]))
    firsts = [s["first_nonfinite_step"] for s in summaries if s["first_nonfinite_step"] is not None]
    merged = dict(worst)
    merged["first_nonfinite_step"] = min(firsts) if firsts else None
    merged["checks"] = ("non-finite loss, gradient norm (of non-skipped steps), reward, KL and value per step, "
                        "every precision; overflow skips and loss scale from the engine (fp16 only)")
    merged["aggregate"] = "worst rank"
    return merged


def _steps(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in ranks:
        for s in r.get("steps", []):
            by_step.setdefault(s["step"], []).append(s)
    merged = []
    for step in sorted(by_step):
        rows = by_step[step]
        keys = {k for row in rows for k in row}
        merged.append({k: (step if k == "step" else _mean([row.get(k) for row in rows if k in row]))
                       for k in sorted(keys)})
    return merged


CONVERGED_FRACTION = 0.9  # of the preferred-token share's gain from the first window to the last


def convergence_step(shares: list[float | None], window: int, fraction: float = CONVERGED_FRACTION) -> int | None:
    """PPO's convergence on the synthetic task: the first step (0-based) whose trailing `window`-step mean of
    the preferred-token share has covered `fraction` of the way from the first window's mean to the last
    window's; None where the share did not rise (nothing to converge to) or a value is missing."""
    if len(shares) < 2 * window or any(v is None for v in shares):
        return None
    start, final = sum(shares[:window]) / window, sum(shares[-window:]) / window
    if final <= start:
        return None
    target = start + fraction * (final - start)
    # found at the latest in the last window, whose mean is the final value itself
    return next(step for step in range(window - 1, len(shares))
                if sum(shares[step - window + 1:step + 1]) / window >= target)


def _learning(stage: str, steps: list[dict[str, Any]], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    learning: dict[str, Any] = {}
    for key in ("accuracy_start", "accuracy_end"):
        values = [r["learning"][key] for r in ranks if key in r.get("learning", {})]
        if values:
            learning[key] = _mean(values)
    heldout = [r["learning"]["heldout_scores"] for r in ranks if "heldout_scores" in r.get("learning", {})]
    if heldout:  # pooled over the ranks already: every rank holds the same
        learning["heldout_scores"] = heldout[0]
    if stage in ("sft", "rm"):
        role = "actor" if stage == "sft" else "reward"
        learning["loss_curve"] = [s.get(f"loss/{role}") for s in steps]
    if stage in ROLLOUT_STAGES and steps:
        window = max(1, min(10, len(steps) // 3))
        rewards = [s.get("reward") for s in steps]
        learning.update(
            reward_curve=rewards,
            reward_window_steps=window,
            reward_start=_mean(rewards[:window]),
            reward_end=_mean(rewards[-window:]),
            reward_trend=reward_trend(rewards, window),
            kl_start=_mean([s.get("kl") for s in steps[:window]]),
            kl_end=_mean([s.get("kl") for s in steps[-window:]]),
            preferred_fraction_start=_mean([s.get("preferred_fraction") for s in steps[:window]]),
            preferred_fraction_end=_mean([s.get("preferred_fraction") for s in steps[-window:]]),
            generated_tokens_start=_mean([s.get("generated_tokens") for s in steps[:window]]),
            generated_tokens_end=_mean([s.get("generated_tokens") for s in steps[-window:]]),
            converged_step=convergence_step([s.get("preferred_fraction") for s in steps], window),
            converged_definition=(
                f"the first timed step (0-based) whose trailing {window}-step mean of the preferred-token share "
                f"covers {CONVERGED_FRACTION:.0%} of its rise from the first {window} steps' mean to the last "
                f"{window} steps'; null where it did not rise"),
        )
    learning["aggregate"] = "mean over ranks per step"
    return learning


def _checkpoints(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Each save of the stage: its stall (the `checkpoint` phase, max over ranks), the bytes written (rank 0,
    all ranks' files), and for overlapped saves the background write time and any wait for it."""
    saves = []
    for i, entry in enumerate(ranks[0].get("checkpoints") or []):
        step = entry["steps_done"] - 1
        stalls = [s["time_s"] for r in ranks for s in r.get("phase_samples", [])
                  if s["phase"] == "checkpoint" and s.get("step") == step]
        merged = {"steps_done": entry["steps_done"], "mode": entry["mode"],
                  "stall_s": max(stalls) if stalls else None, "bytes_written": entry.get("bytes_written")}
        for key in ("waited_for_writes_s", "background_write_s"):
            values = [(r.get("checkpoints") or [])[i].get(key) for r in ranks if i < len(r.get("checkpoints") or [])]
            values = [v for v in values if v is not None]
            if values:
                merged[key] = max(values)
        saves.append(merged)
    if not saves:
        return {}
    return {"saves": saves, "method": (
        "stall_s: time of the `checkpoint` phase after the save's step (max over ranks): the framework's save "
        "call with its writes (sync) or with host copies of what it writes (async), plus any wait for the "
        "previous save's writes; background_write_s: the writer thread's time for this save (async); "
        "waited_for_writes_s: how long completing it waited for that thread; bytes_written: the complete "
        "checkpoint directory (every rank's files)")}


FIXED_COST_METHOD = (
    "seconds on rank 0 (time.perf_counter / the process's start time): launch = the stage's wall time minus the "
    "longest rank lifetime (torchrun, process spawn, merging the ranks' results); process_start = from the "
    "rank's process start to its first line of work (the interpreter, torch, transformers and the harness "
    "imported); imports = the engine libraries, JIT ops and process groups (phase `imports`); init = models "
    "built and wrapped in their engines (phase `init`), of which init_model_build = inside the model builders "
    "(random initialisation or loading; under zero.Init partitioning too) and init_engines = the rest; jit_ops = "
    "inside torch's JIT extension loader (DeepSpeed's compiled ops built or loaded), a part of imports and init; "
    "steps = every step's phases, warm-up included; checkpoints = mid-stage saves; evaluation = the RM's "
    "accuracy before and after training; save = the stage's closing save; close = engine teardown; other = the "
    "lifetime's remainder (data, records, progress). fixed = wall time minus steps: what a run costs whatever "
    "its length")


def fixed_cost(ranks: list[dict[str, Any]], wall_time_s: float) -> dict[str, Any]:
    """Where a stage's time goes outside its steps (see FIXED_COST_METHOD); {} without rank timings."""
    first = next((r for r in ranks if r.get("lifetime_s") is not None), None)
    if first is None:
        return {}
    samples = first.get("phase_samples", [])

    def phase_time(keep) -> float:
        return sum(s.get("time_s") or 0.0 for s in samples if keep(s))

    split = {
        "launch_s": wall_time_s - max(r["lifetime_s"] for r in ranks if r.get("lifetime_s") is not None),
        "process_start_s": first.get("process_start_s") or 0.0,
        "imports_s": phase_time(lambda s: s["phase"] == "imports"),
        "init_s": phase_time(lambda s: s["phase"] == "init"),
        "steps_s": phase_time(lambda s: s.get("step") is not None and s["phase"] not in OUTSIDE_STEP),
        "checkpoints_s": phase_time(lambda s: s["phase"] == "checkpoint"),
        "evaluation_s": phase_time(lambda s: s["phase"] == "evaluation"),
        "save_s": first.get("save_s") or 0.0,
        "close_s": first.get("close_s") or 0.0,
    }
    split["other_s"] = first["lifetime_s"] - sum(v for k, v in split.items() if k != "launch_s")
    split["fixed_s"] = wall_time_s - split["steps_s"]
    if first.get("model_build_s") is not None:  # parts of the figures above, not added to them
        split["init_model_build_s"] = first["model_build_s"]
        split["init_engines_s"] = split["init_s"] - first["model_build_s"]
    if first.get("jit_ops_s") is not None:
        split["jit_ops_s"] = first["jit_ops_s"]
    return {**{k: round(v, 3) for k, v in split.items()}, "method": FIXED_COST_METHOD}


def stage_record(stage: str, ranks: list[dict[str, Any]], warmup: int, wall_time_s: float,
                 failure: dict[str, Any] | None = None) -> StageRecord:
    """Merge the per-rank results of one stage. `failure` is the launcher's view when ranks are missing
    or the process tree died or timed out."""
    statuses = [r.get("status", "error") for r in ranks] + ([failure["status"]] if failure else [])
    status = merge_status(statuses)
    error = None
    if status != "ok":
        if failure and failure["status"] == status:
            error = failure["error"]
        else:
            first = next(r for r in sorted(ranks, key=lambda r: r["rank"]) if r.get("status") == status)
            error = dict(first["error"], rank=first["rank"])
    record = StageRecord(status=status, error=error, ranks=len(ranks), wall_time_s=wall_time_s)
    if not ranks:
        return record
    ranks = sorted(ranks, key=lambda r: r["rank"])
    record.params = ranks[0].get("params", {})
    for role, state in ranks[0].get("model_state", {}).items():
        record.model_state[role] = {
            f"{key}_per_rank": [r.get("model_state", {}).get(role, {}).get(key) for r in ranks] for key in state
        }
    if record.model_state:
        record.model_state["method"] = ("bytes of the tensors each rank's engine holds: parameters (ZeRO-3 "
                                        "partitions plus any gathered copy), optimizer states plus fp32 master "
                                        "copies; read after the last step")
    if any(r.get("phase_samples") for r in ranks):
        record.memory = _memory(ranks)
        record.throughput = _throughput(ranks, warmup)
    record.stability = _stability(ranks)
    record.steps = _steps(ranks)
    record.learning = _learning(stage, record.steps, ranks)
    record.notes = ranks[0].get("notes", [])
    record.upstream_defects = ranks[0].get("upstream_defects", [])
    record.layout_per_rank = [r.get("layout", {}) for r in ranks]
    record.computation_dtypes = ranks[0].get("computation_dtypes", {})
    record.engine_knobs = ranks[0].get("engine_knobs", {})
    record.update_passes = ranks[0].get("update_passes")
    for r in ranks:  # a role held on some ranks only (trlx's reward function: rank 0) is reported by those
        for role, entry in (r.get("quantized") or {}).items():
            record.quantized.setdefault(role, entry)
    record.live_tensors = _live_tensors(ranks)
    cut = [dict(r["cut_short"], rank=r["rank"]) for r in ranks if r.get("cut_short")]
    if cut:
        record.cut_short = {"ranks": cut, "meaning": "ranks stopped by SIGTERM; figures cover the steps done"}
    record.checkpoint = ranks[0].get("checkpoint")
    record.checkpoints = _checkpoints(ranks)
    record.resumed_from_step = ranks[0].get("resumed_from_step")
    record.fixed_cost = fixed_cost(ranks, wall_time_s)
    record.nodes = nodes(ranks)
    lost = [n["why"] for n in record.nodes if n.get("why")]
    if lost and record.error is not None:  # the lost node is the cause; the others' failures follow from it
        record.error = dict(record.error, nodes=lost,
                            message=f"{'; '.join(lost)}. Then: {record.error['message']}")
    return record


NODE_HOST_BYTES = ("per phase, the sum over the node's ranks of each rank's host-memory peak (CPU: peak_bytes; "
                   "CUDA: host_peak_bytes): an upper bound of the node's process tree, as the ranks' peaks need "
                   "not coincide")


def nodes(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A run over several nodes: each node's host and ranks, its ranks' host memory, and, for a node whose ranks
    ended without finishing, which ranks and why (their agent died, or they wrote nothing at all). Places come
    from each rank's own result and, for ranks that wrote none, from what the collecting rank read at start."""
    places = {e["rank"]: e for r in ranks for e in r.get("places", [])}
    places.update({r["rank"]: r["place"] for r in ranks if r.get("place")})
    if not places:
        return []
    by_rank = {r["rank"]: r for r in ranks}
    out: dict[int, dict[str, Any]] = {}
    for rank in sorted(places):
        e = places[rank]
        node = out.setdefault(e["node"], {"node": e["node"], "host": e["host"], "group_rank": e["group_rank"],
                                          "ranks": [], "missing_ranks": [], "agent_ended_ranks": [],
                                          "host_peak_bytes": {}})
        node["ranks"].append(rank)
        result = by_rank.get(rank)
        if result is None:
            node["missing_ranks"].append(rank)
            continue
        if (result.get("cut_short") or {}).get("agent_ended"):
            node["agent_ended_ranks"].append(rank)
        key = "host_peak_bytes" if str(result.get("device", "cpu")).startswith("cuda") else "peak_bytes"
        for sample in result.get("phase_samples", []):
            if sample.get(key) is not None:
                peaks = node.setdefault("_peaks", {}).setdefault(sample["phase"], {})
                peaks[rank] = max(peaks.get(rank, 0), sample[key])
    for node in out.values():
        node["host_peak_bytes"] = {p: sum(v.values()) for p, v in node.pop("_peaks", {}).items()}
        node["host_peak_bytes_definition"] = NODE_HOST_BYTES
        why = []
        if node["agent_ended_ranks"]:
            why.append(f"rank(s) {node['agent_ended_ranks']} stopped when their torchrun agent ended")
        if node["missing_ranks"]:
            why.append(f"rank(s) {node['missing_ranks']} wrote no result that reached node 0")
        if why:
            node["why"] = f"node {node['node']} (host {node['host']}): " + "; ".join(why)
    return [out[k] for k in sorted(out)]
