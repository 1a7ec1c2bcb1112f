"""The decision tree for choosing a framework, built from the measured rows.

Questions: which model, which precision, LoRA or full fine-tuning. At each leaf, per framework: the
fastest configuration that finished, stayed numerically stable and fits the memory budget (peak, max
over ranks); the leaf names the fastest framework, or says why the data cannot decide. Speed is samples/s
at one update pass per rollout (equal work: trlx's 4 PPO epochs count as one). Cells only this harness
can run (`harness_extension`: DS-Chat or coati in fp32, coati's PPO on ddp/zero1, trlx with gradient
checkpointing, ...) are left out unless asked for: no user of the framework could deploy them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bench.report.aggregate import group, stat

MIB = 1024.0 * 1024.0
STABLE = ("stable", "recovered")
CLOSE_CALL = 1.10  # a lead under 10 % (or overlapping spreads) is within run-to-run noise on shared machines
STAGE_PREFERENCE = ("ppo", "rm", "sft")


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
    samples_per_s: Any  # Stat
    peak_bytes: float


def _config_text(runs: list[dict[str, Any]]) -> str:
    r = runs[0]
    extra = "".join(f" {k}={r[k]}" for k in ("tp", "pp") if r.get(k, 1) != 1)
    if r.get("offload"):
        extra += " offload"
    if r.get("reference"):
        extra += f" ref={r['reference']}"
    return f"zero={r['zero']} lora={r['lora']} batch={r['batch']} x{r['nproc']} ranks{extra}"


def speed(row: dict[str, Any]) -> float | None:
    """samples/s at one update pass per rollout where the row has it (PPO), else per step."""
    one_pass = row.get("samples_per_s_one_pass")
    return one_pass if one_pass is not None else row.get("samples_per_s_step")


def _why_not(runs: list[dict[str, Any]], budget: float | None) -> str:
    statuses = sorted({r["status"] for r in runs})
    if "ok" not in statuses:
        return "no run finished (" + ", ".join(statuses) + ")"
    ok = [r for r in runs if r["status"] == "ok"]
    if not any(r.get("stability") in STABLE for r in ok):
        return "every finished run was numerically unstable (" + ", ".join(sorted({r["stability"] for r in ok})) + ")"
    peaks = [r["peak_bytes"] for r in ok if r.get("peak_bytes") is not None]
    return f"over the budget of {budget / MIB:,.0f} MiB (smallest peak {min(peaks) / MIB:,.0f} MiB)" if budget else "?"


def leaf(rows: list[dict[str, Any]], budget: float | None, frameworks: list[str]) -> Leaf:
    if not rows:
        return Leaf("not measured: no run in this branch, cannot decide", False)
    evidence, candidates = [], []
    unmeasured = [f for f in frameworks if not any(r["framework"] == f for r in rows)]
    if unmeasured:
        evidence.append(f"not measured in this branch: {', '.join(unmeasured)}")
    for framework in sorted({r["framework"] for r in rows}):
        runs = [r for r in rows if r["framework"] == framework]
        fitting = [r for r in runs if r["status"] == "ok" and r.get("stability") in STABLE
                   and speed(r) is not None
                   and (budget is None or (r.get("peak_bytes") is not None and r["peak_bytes"] <= budget))]
        if not fitting:
            evidence.append(f"{framework}: ruled out -- {_why_not(runs, budget)} ({len(runs)} runs)")
            continue
        best = max(group(fitting).values(), key=lambda cell: stat([speed(r) for r in cell]).median)
        candidate = Candidate(framework, _config_text(best), stat([speed(r) for r in best]),
                              stat([r["peak_bytes"] for r in best]).median)
        candidates.append(candidate)
        evidence.append(f"{framework}: fastest fitting config {candidate.config}: "
                        f"{candidate.samples_per_s.fmt(digits=2)} samples/s, "
                        f"peak {candidate.peak_bytes / MIB:,.0f} MiB "
                        f"({len(fitting)} of {len(runs)} runs fit and stayed stable)")
    if not candidates:
        return Leaf("no measured framework finishes, stays stable and fits", True, evidence)
    candidates.sort(key=lambda c: c.samples_per_s.median, reverse=True)
    first = candidates[0]
    if len(candidates) == 1:
        alone = "measured framework" if unmeasured else "framework"
        return Leaf(f"{first.framework} (the only {alone} that fits and stays stable)", True, evidence)
    second = candidates[1]
    lead = first.samples_per_s.median / second.samples_per_s.median
    overlap = (first.samples_per_s.median - first.samples_per_s.spread / 2
               <= second.samples_per_s.median + second.samples_per_s.spread / 2)
    if lead < CLOSE_CALL or overlap:
        return Leaf(f"too close to call: {first.framework} and {second.framework} within noise "
                    f"(lead {100 * (lead - 1):.0f} %, needs >= {100 * (CLOSE_CALL - 1):.0f} % and no overlap)",
                    False, evidence)
    return Leaf(f"{first.framework} (fastest that fits; {100 * (lead - 1):.0f} % ahead of {second.framework})",
                True, evidence)


def decision_stage(rows: list[dict[str, Any]]) -> str | None:
    return next((s for s in STAGE_PREFERENCE if any(r["stage"] == s for r in rows)), None)


def build(rows: list[dict[str, Any]], budget_bytes: float | None = None, stage: str | None = None,
          include_extensions: bool = False) -> Node:
    stage = stage or decision_stage(rows)
    frameworks = sorted({r["framework"] for r in rows})
    rows = [r for r in rows if r["stage"] == stage]
    extensions = [r for r in rows if r.get("harness_extension")]
    if not include_extensions:
        rows = [r for r in rows if not r.get("harness_extension")]
    budget = f"{budget_bytes / MIB:,.0f} MiB per rank" if budget_bytes else "no budget given (finishing = fits)"
    left_out = ("harness-extension cells counted (--include-harness-extensions)" if include_extensions else
                f"{len(extensions)} harness-extension run(s) left out: knobs the frameworks' own scripts cannot run; "
                "--include-harness-extensions counts them")
    root = Node(f"Which model? (decided on the {stage} stage; memory budget: {budget}; {left_out})")
    for model in sorted({r["model"] for r in rows}):
        by_model = [r for r in rows if r["model"] == model]
        precision_node = Node("Which precision?")
        for precision in ("bf16", "fp16", "fp32"):
            by_precision = [r for r in by_model if r["precision"] == precision]
            lora_node = Node("LoRA or full fine-tuning?")
            for answer, wants_lora in (("full fine-tuning", False), ("LoRA", True)):
                chosen = [r for r in by_precision if bool(r["lora"]) == wants_lora]
                lora_node.branches.append((answer, leaf(chosen, budget_bytes, frameworks)))
            precision_node.branches.append((precision, lora_node))
        root.branches.append((model, precision_node))
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
