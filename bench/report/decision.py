"""The decision tree for choosing a framework, built from the measured rows.

Questions: which model, how many GPUs (ranks), which precision, full fine-tuning, LoRA or partial
freezing (a framework that trains only some blocks is not doing full fine-tuning). At each leaf, per
framework: the fastest configuration that finished, stayed numerically stable and fits the memory budget
(peak, max over ranks). Speed is samples/s per GPU at one update pass per rollout (equal work: trlx's 4
PPO epochs count as one). A leaf names a framework only when both leaders have an interval (3 repeats,
or 3 timed steps of one run) and the leader is >= 10 % ahead with intervals that do not overlap.
Forced-failure runs never count. Cells only this harness
can run (`harness_extension`: DS-Chat or coati in fp32, coati's PPO on ddp/zero1, trlx with gradient
checkpointing, ...) are left out unless asked for: no user of the framework could deploy them. The
plain-PyTorch reference (`framework=torch`) appears in a leaf's evidence as the yardstick, never as its verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bench.report.aggregate import Stat, group, overlap, per_gpu, stat
from bench.results.collect import YARDSTICK, is_forced_failure

MIB = 1024.0 * 1024.0
STABLE = ("stable", "recovered")
CLOSE_CALL = 1.10  # a lead under 10 % (or overlapping spreads) is within run-to-run noise on shared machines
STAGE_PREFERENCE = ("ppo", "rm", "sft", "grpo")  # grpo (TRL only) is decided on its own, never pooled with ppo
MIN_REPEATS = 3  # runs per cell, or timed steps of one run, before a lead can be judged against noise
FINETUNE = (("full fine-tuning", "full"), ("LoRA", "lora"),
            ("partial freezing (only some blocks train, e.g. trlx's hydra policy)", "partial"))


@dataclass
class Leaf:
    verdict: str
    decided: bool
    evidence: list[str] = field(default_factory=list)


@dataclass
class Node:
    question: str
    branches: list[tuple[str, Node | Leaf]] = field(default_factory=list)


@dataclass
class Candidate:
    framework: str
    config: str
    speed: Stat            # samples/s per GPU: over repeats, or one run's per-step interval
    interval_from: str     # "repeats" | "steps" | "" (no interval: cannot be named)
    peak_bytes: float
    runs: int
    timed_steps: int


def _config_text(runs: list[dict[str, Any]]) -> str:
    r = runs[0]
    extra = "".join(f" {k}={r[k]}" for k in ("tp", "pp") if r.get(k, 1) != 1)
    if r.get("offload"):
        extra += " offload"
    if r.get("reference"):
        extra += f" ref={r['reference']}"
    return f"zero={r['zero']} lora={r['lora']} batch={r['batch']} x{r['nproc']} ranks{extra}"


def speed(row: dict[str, Any]) -> float | None:
    """samples/s per GPU: at one update pass per rollout where the row has it (PPO), else per step."""
    return per_gpu(row)


def cell_speed(runs: list[dict[str, Any]]) -> tuple[Stat, str]:
    """The cell's speed and where its interval comes from: its repeats (n >= 3), else one run's per-step
    times (>= 3 timed steps: the speed at its slowest and fastest step), else none."""
    over_runs = stat([speed(r) for r in runs])
    if over_runs.n >= MIN_REPEATS:
        return over_runs, "repeats"
    best = max(runs, key=lambda r: r.get("timed_steps") or 0)
    if (best.get("timed_steps") or 0) >= MIN_REPEATS and best.get("step_time_min_s"):
        centre = speed(best)  # the run's speed at its median step, scaled to its slowest and fastest step
        low = centre * best["step_time_median_s"] / best["step_time_max_s"]
        high = centre * best["step_time_median_s"] / best["step_time_min_s"]
        return Stat(centre, high - low, 1, low, high), "steps"
    return over_runs, ""


def _why_not(runs: list[dict[str, Any]], budget: float | None) -> str:
    statuses = sorted({r["status"] for r in runs})
    if "ok" not in statuses:
        return "no run finished (" + ", ".join(statuses) + ")"
    ok = [r for r in runs if r["status"] == "ok"]
    if not any(r.get("stability") in STABLE for r in ok):
        return "every finished run was numerically unstable (" + ", ".join(sorted({r["stability"] for r in ok})) + ")"
    peaks = [r["peak_bytes"] for r in ok if r.get("peak_bytes") is not None]
    return f"over the budget of {budget / MIB:,.0f} MiB (smallest peak {min(peaks) / MIB:,.0f} MiB)" if budget else "?"


def _fits(r: dict[str, Any], budget: float | None) -> bool:
    return (r["status"] == "ok" and r.get("stability") in STABLE and speed(r) is not None
            and (budget is None or (r.get("peak_bytes") is not None and r["peak_bytes"] <= budget)))


def _yardstick(rows: list[dict[str, Any]], budget: float | None) -> str | None:
    """The plain-PyTorch reference's fastest fitting configuration, as evidence only."""
    fitting = [r for r in rows if r["framework"] == YARDSTICK and _fits(r, budget)]
    if not fitting:
        return None
    best = max(group(fitting).values(), key=lambda cell: stat([speed(r) for r in cell]).median)
    measured, _ = cell_speed(best)
    return (f"yardstick ({YARDSTICK}, plain PyTorch; never a verdict): {_config_text(best)}: {measured.median:.3f} "
            f"samples/s per GPU; peak {stat([r['peak_bytes'] for r in best]).median / MIB:,.0f} MiB "
            f"({len(best)} run(s))")


def leaf(rows: list[dict[str, Any]], budget: float | None, frameworks: list[str]) -> Leaf:
    yardstick = _yardstick(rows, budget)
    rows = [r for r in rows if r["framework"] != YARDSTICK]
    frameworks = [f for f in frameworks if f != YARDSTICK]
    if not rows:
        return Leaf("not measured: no run in this branch, cannot decide", False, [yardstick] if yardstick else [])
    evidence, candidates = ([yardstick] if yardstick else []), []
    unmeasured = [f for f in frameworks if not any(r["framework"] == f for r in rows)]
    if unmeasured:
        evidence.append(f"not measured in this branch: {', '.join(unmeasured)}")
    for framework in sorted({r["framework"] for r in rows}):
        runs = [r for r in rows if r["framework"] == framework]
        fitting = [r for r in runs if _fits(r, budget)]
        if not fitting:
            evidence.append(f"{framework}: ruled out -- {_why_not(runs, budget)} ({len(runs)} runs)")
            continue
        best = max(group(fitting).values(), key=lambda cell: stat([speed(r) for r in cell]).median)
        measured, source = cell_speed(best)
        steps = sum(r.get("timed_steps") or 0 for r in best)
        candidate = Candidate(framework, _config_text(best), measured, source,
                              stat([r["peak_bytes"] for r in best]).median, len(best), steps)
        candidates.append(candidate)
        interval = (f"[{measured.low:.3f}, {measured.high:.3f}] over {source}" if source
                    else f"no interval: n={len(best)} < {MIN_REPEATS} repeats and {steps} < {MIN_REPEATS} timed steps")
        evidence.append(f"{framework}: fastest fitting config {candidate.config}: {measured.median:.3f} samples/s per "
                        f"GPU {interval}; peak {candidate.peak_bytes / MIB:,.0f} MiB; rests on {len(best)} run(s), "
                        f"{steps} timed steps ({len(fitting)} of {len(runs)} runs fit and stayed stable)")
    if not candidates:
        return Leaf("no measured framework finishes, stays stable and fits", True, evidence)
    candidates.sort(key=lambda c: c.speed.median, reverse=True)
    first = candidates[0]
    if len(candidates) == 1:
        alone = "measured framework" if unmeasured else "framework"
        return Leaf(f"{first.framework} (the only {alone} that fits and stays stable)", True, evidence)
    second = candidates[1]
    if not first.interval_from or not second.interval_from:
        return Leaf(f"cannot call: {first.framework} leads {second.framework} but without {MIN_REPEATS} repeats "
                    f"or {MIN_REPEATS} timed steps there is no interval to judge the lead by", False, evidence)
    lead = first.speed.median / second.speed.median
    if lead < CLOSE_CALL or overlap(first.speed, second.speed):
        return Leaf(f"too close to call: {first.framework} and {second.framework} within noise "
                    f"(lead {100 * (lead - 1):.0f} %, needs >= {100 * (CLOSE_CALL - 1):.0f} % and intervals that do "
                    "not overlap)", False, evidence)
    return Leaf(f"{first.framework} (fastest per GPU that fits; {100 * (lead - 1):.0f} % ahead of "
                f"{second.framework}, intervals apart)", True, evidence)


def decision_stage(rows: list[dict[str, Any]]) -> str | None:
    return next((s for s in STAGE_PREFERENCE if any(r["stage"] == s for r in rows)), None)


def build(rows: list[dict[str, Any]], budget_bytes: float | None = None, stage: str | None = None,
          include_extensions: bool = False) -> Node:
    stage = stage or decision_stage(rows)
    frameworks = sorted({r["framework"] for r in rows})
    rows = [r for r in rows if r["stage"] == stage and not is_forced_failure(r)]
    extensions = [r for r in rows if r.get("harness_extension")]
    if not include_extensions:
        rows = [r for r in rows if not r.get("harness_extension")]
    budget = f"{budget_bytes / MIB:,.0f} MiB per rank" if budget_bytes else "no budget given (finishing = fits)"
    left_out = ("harness-extension cells counted (--include-harness-extensions)" if include_extensions else
                f"{len(extensions)} harness-extension run(s) left out: knobs the frameworks' own scripts cannot run; "
                "--include-harness-extensions counts them")
    root = Node(f"Which model? (decided on the {stage} stage; memory budget: {budget}; {left_out}; speed: "
                "samples/s per GPU at one update pass; forced-failure runs never count)")
    for model in sorted({r["model"] for r in rows}):
        by_model = [r for r in rows if r["model"] == model]
        ranks_node = Node("How many GPUs (ranks)?")
        for nproc in sorted({r["nproc"] for r in by_model}):
            by_ranks = [r for r in by_model if r["nproc"] == nproc]
            precision_node = Node("Which precision?")
            for precision in ("bf16", "fp16", "fp32"):
                by_precision = [r for r in by_ranks if r["precision"] == precision]
                tune_node = Node("Full fine-tuning, LoRA, or partial freezing?")
                for answer, mode in FINETUNE:
                    chosen = [r for r in by_precision if r.get("finetune", "lora" if r["lora"] else "full") == mode]
                    if mode == "partial" and not chosen:
                        continue  # only shown where a framework trains part of the model
                    tune_node.branches.append((answer, leaf(chosen, budget_bytes, frameworks)))
                precision_node.branches.append((precision, tune_node))
            ranks_node.branches.append((str(nproc), precision_node))
        root.branches.append((model, ranks_node))
    return root


def questions(node: Node, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Leaf]]:
    """Every root-to-leaf path as (answers, leaf), for the plain-questions rendering."""
    out = []
    for answer, child in node.branches:
        if isinstance(child, Leaf):
            out.append((path + (answer,), child))
        else:
            out.extend(questions(child, path + (answer,)))
    return out
