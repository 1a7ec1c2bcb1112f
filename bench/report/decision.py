"""The decision tree for choosing a framework, built from the measured rows.

The root states the hardware the evidence came from (host types and device); the questions follow it: which
model, how many ranks (GPUs on a GPU host, processes on a CPU host), which precision, full fine-tuning, LoRA
or partial freezing (a framework that trains only some blocks is not doing full fine-tuning). At each leaf,
per framework: the fastest configuration that finished, stayed numerically stable and fits the memory budget
(peak, max over ranks), among its configurations with 3 repeats where it has any (a faster one with fewer runs
is named beside it, unconfirmed). Speed is the measured step rate: samples per second per rank over whole steps, with
each framework's own update passes; the derived figure at one update pass per rollout (trlx's 4 PPO epochs
counted as one) stands beside it. A leaf names a framework only when both leaders have 3 repeats and the
leader is >= 10 % ahead with ranges that do not overlap, their cells were measured alike (lengths, warm-up,
heap release, commit, host type) and, for LoRA, they train a like number of parameters. A framework whose
runs are all `unsupported` cannot run the mode: that is its own outcome, never "does not fit"; a leaf that
only one framework can run (or the sweep measured only one) says so and names no winner. Forced-failure runs
and cells of mixed provenance never count. Cells only this harness can run (`harness_extension`: DS-Chat or
coati in fp32, coati's PPO on ddp/zero1, trlx with gradient checkpointing, ...) are left out unless asked for: no
user of the framework could deploy them. The plain-PyTorch reference (`framework=torch`) appears in a leaf's
evidence as the yardstick, never as its verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bench.report.aggregate import MIN_REPEATS, Stat, group, overlap, per_gpu, stat
from bench.results.collect import YARDSTICK, is_forced_failure

MIB = 1024.0 * 1024.0
STABLE = ("stable", "recovered")
CLOSE_CALL = 1.10  # a lead under 10 % (or overlapping spreads) is within run-to-run noise on shared machines
STAGE_PREFERENCE = ("ppo", "rm", "sft", "grpo")  # grpo (TRL only) is decided on its own, never pooled with ppo
LIKE_WORK = 1.5  # LoRA leaves: trainable parameters within this ratio count as like work
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
    ranks: str = "rank(s)"  # at the root: what a rank is on the evidence's hardware ("GPU(s)", "CPU processes")


@dataclass
class Candidate:
    framework: str
    config: str
    speed: Stat            # measured samples/s per rank over the cell's repeats
    one_pass: Stat         # derived: samples/s per rank at one update pass
    peak_bytes: float
    runs: int
    timed_steps: int
    trainable: float | None  # parameters that train in the trained models (LoRA: its factors and what else)
    alike: tuple[str, ...]   # what must agree across the leaf's candidates: measurement settings, commit, host


def _config_text(runs: list[dict[str, Any]]) -> str:
    r = runs[0]
    extra = "".join(f" {k}={r[k]}" for k in ("tp", "pp") if r.get(k, 1) != 1)
    if r.get("offload"):
        extra += " offload"
    if r.get("reference"):
        extra += f" ref={r['reference']}"
    return f"zero={r['zero']} lora={r['lora']} batch={r['batch']} x{r['nproc']} ranks{extra}"


def speed(row: dict[str, Any]) -> float | None:
    """The measured step rate: samples/s per rank over whole steps (each framework's own update passes)."""
    rate = row.get("samples_per_s_step")
    return rate / (row.get("nproc") or 1) if rate else None


def cell_speed(runs: list[dict[str, Any]]) -> tuple[Stat, bool]:
    """The cell's measured speed over its repeats, and whether it has the MIN_REPEATS runs a lead is judged by."""
    measured = stat([speed(r) for r in runs])
    return measured, measured.n >= MIN_REPEATS


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
            f"samples/s per rank; peak {stat([r['peak_bytes'] for r in best]).median / MIB:,.0f} MiB "
            f"({len(best)} run(s))")


def _alike(run: dict[str, Any]) -> tuple[str, ...]:
    return (run.get("measurement") or "", run.get("git_commit") or "", run.get("host_type") or "")


def _unlike(candidates: list[Candidate]) -> str | None:
    """Why the leaders' cells were not measured alike (settings, commit, host type), or None."""
    names = ("measurement settings", "commit", "host type")
    differ = [f"{name} ({' vs '.join(sorted({c.alike[i] or '?' for c in candidates}))})"
              for i, name in enumerate(names) if len({c.alike[i] for c in candidates}) > 1]
    return "; ".join(differ) or None


def leaf(rows: list[dict[str, Any]], budget: float | None, frameworks: list[str], mode: str = "full",
         elsewhere: frozenset[str] = frozenset()) -> Leaf:
    """One leaf from its rows; `elsewhere`: frameworks measured at the leaf's model, ranks and precision in
    another fine-tuning mode (so they ran, but not this mode)."""
    yardstick = _yardstick(rows, budget)
    rows = [r for r in rows if r["framework"] != YARDSTICK]
    frameworks = [f for f in frameworks if f != YARDSTICK]
    if not rows:
        return Leaf("not measured: no run in this branch, cannot decide", False, [yardstick] if yardstick else [])
    evidence, candidates = ([yardstick] if yardstick else []), []
    unmeasured = [f for f in frameworks if not any(r["framework"] == f for r in rows)]
    if unmeasured:
        evidence.append(f"not measured in this branch: {', '.join(unmeasured)}")
    refused = [r for r in rows if r.get("refused")]
    if refused:
        evidence.append(f"{len(refused)} run(s) left out: their cells mix provenance ("
                        + "; ".join(sorted({r['mixed'] for r in refused})) + "); --allow-mixed-provenance counts them")
        rows = [r for r in rows if not r.get("refused")]
        if not rows:
            return Leaf("no admissible evidence: every run in this branch is in a cell of mixed provenance", False,
                        evidence)
    set_aside = sorted({r["framework"] for r in refused} - {r["framework"] for r in rows})
    unsupported = []
    for framework in sorted({r["framework"] for r in rows}):
        runs = [r for r in rows if r["framework"] == framework]
        if all(r["status"] == "unsupported" for r in runs):
            unsupported.append(framework)
            reason = next((r["error"] for r in runs if r.get("error")), "no reason recorded").splitlines()[0][:160]
            evidence.append(f"{framework}: cannot run this mode (unsupported: {reason}; {len(runs)} runs)")
            continue
        candidate, said = _candidate(framework, runs, budget)
        evidence += said
        if candidate is not None:
            candidates.append(candidate)
    runnable = [f for f in sorted({r["framework"] for r in rows}) if f not in unsupported]
    if not runnable:
        return Leaf(f"unsupported: no measured framework can run this mode ({', '.join(unsupported)})", True,
                    evidence)
    if not candidates:
        return Leaf("no measured framework finishes, stays stable and fits", True, evidence)
    candidates.sort(key=lambda c: c.speed.median, reverse=True)
    if len(runnable) == 1:
        return _alone(candidates[0], [f for f in unmeasured if f not in elsewhere], set_aside, unsupported, evidence)
    return _compared(candidates, runnable, mode, evidence)


def _candidate(framework: str, runs: list[dict[str, Any]], budget: float | None) -> tuple[Candidate | None, list[str]]:
    """A framework's candidate in a leaf (its fastest fitting cell with MIN_REPEATS runs where it has one) and what
    the leaf says of it; None where none of its runs fits."""
    fitting = [r for r in runs if _fits(r, budget)]
    # runs the framework refused (a knob it cannot run) neither fit nor failed to: counted apart
    refused_here = sum(r["status"] == "unsupported" for r in runs)
    tried = len(runs) - refused_here
    if not fitting:
        return None, [f"{framework}: ruled out -- {_why_not(runs, budget)} ({len(runs)} runs)"]
    # The framework's fastest cell among those with MIN_REPEATS runs: a faster cell with fewer runs has no
    # range to show its lead is more than noise, so it is named beside the candidate, never in its place.
    cells = sorted(group(fitting).values(), key=lambda cell: stat([speed(r) for r in cell]).median, reverse=True)
    best = next((cell for cell in cells if len(cell) >= MIN_REPEATS), cells[0])
    faster = cells[:cells.index(best)]
    measured, repeated = cell_speed(best)
    steps = sum(r.get("timed_steps") or 0 for r in best)
    one_pass = stat([per_gpu(r) for r in best])
    trainable = stat([r.get("trainable_params") for r in best]).median
    candidate = Candidate(framework, _config_text(best), measured, one_pass,
                          stat([r["peak_bytes"] for r in best]).median, len(best), steps, trainable,
                          _alike(best[0]))
    interval = (f"range [{measured.low:.3f}, {measured.high:.3f}] over {measured.n} repeats" if repeated
                else f"no interval: n={measured.n} < {MIN_REPEATS} repeats")
    derived = (f"; derived at one update pass: {one_pass.median:.3f}" if one_pass.median
               and abs(one_pass.median - measured.median) > 1e-9 else "")
    trained = f"; {trainable / 1e6:,.2f} M parameters train" if trainable else ""
    said = [f"{framework}: fastest fitting config {candidate.config}: measured {measured.median:.3f} "
            f"samples/s per rank, {interval}{derived}{trained}; peak {candidate.peak_bytes / MIB:,.0f} "
            f"MiB; {steps} timed steps ({len(fitting)} of {tried} runs fit and stayed stable"
            + (f"; {refused_here} more refused as unsupported" if refused_here else "") + ")"]
    said += [f"{framework}: faster but unrepeated, not a candidate: {_config_text(cell)}: measured "
             f"{cell_speed(cell)[0].median:.3f} samples/s per rank (n={len(cell)} < {MIN_REPEATS})"
             for cell in faster]
    return candidate, said


def _alone(first: Candidate, absent: list[str], set_aside: list[str], unsupported: list[str],
           evidence: list[str]) -> Leaf:
    """A leaf one framework alone runs: never a winner, and why it stands alone."""
    if absent:  # the sweep did not run them here: nothing says they cannot
        return Leaf(f"only {first.framework} measured in this branch ({', '.join(absent)}: not measured): "
                    "nothing to compare it with, no winner", False, evidence)
    if set_aside:  # the others ran but their cells mix provenance: they may well run the mode
        return Leaf(f"only {first.framework}'s evidence is admissible ({', '.join(set_aside)}: mixed "
                    "provenance, left out): nothing to compare it with, no winner", False, evidence)
    cannot = f" ({', '.join(unsupported)}: unsupported)" if unsupported else ""
    return Leaf(f"only {first.framework} runs this mode{cannot}: nothing to compare it with, no winner", False,
                evidence)


def _compared(candidates: list[Candidate], runnable: list[str], mode: str, evidence: list[str]) -> Leaf:
    """The leaf's call between its two fastest candidates: a framework only with repeats, like measurement, like
    work (LoRA) and a lead beyond the noise."""
    first = candidates[0]
    if len(candidates) == 1:
        return Leaf(f"{first.framework} (the only one of {', '.join(runnable)} that finishes, stays stable and fits)",
                    True, evidence)
    second = candidates[1]
    if min(first.speed.n, second.speed.n) < MIN_REPEATS:
        return Leaf(f"cannot call: {first.framework} leads {second.framework} but without {MIN_REPEATS} repeats "
                    "a side there is no range to judge the lead by", False, evidence)
    unlike = _unlike([first, second])
    if unlike:
        return Leaf(f"cannot call: {first.framework} and {second.framework} were measured unlike: {unlike}", False,
                    evidence)
    if mode == "lora" and first.trainable and second.trainable and \
            max(first.trainable, second.trainable) / min(first.trainable, second.trainable) > LIKE_WORK:
        return Leaf(f"cannot call: not like work: {first.framework}'s LoRA trains {first.trainable / 1e6:,.2f} M "
                    f"parameters, {second.framework}'s {second.trainable / 1e6:,.2f} M (more than "
                    f"{LIKE_WORK:g}x apart)", False, evidence)
    lead = first.speed.median / second.speed.median
    if lead < CLOSE_CALL or overlap(first.speed, second.speed):
        return Leaf(f"too close to call: {first.framework} and {second.framework} within noise "
                    f"(lead {100 * (lead - 1):.0f} %, needs >= {100 * (CLOSE_CALL - 1):.0f} % and ranges that do "
                    "not overlap)", False, evidence)
    return Leaf(f"{first.framework} (fastest measured step rate per rank that fits; {100 * (lead - 1):.0f} % ahead of "
                f"{second.framework}, ranges apart over {MIN_REPEATS}+ repeats)", True, evidence)


def hardware(rows: list[dict[str, Any]]) -> tuple[str, str]:
    """(the evidence's hardware in words, what a rank is on it)."""
    devices = sorted({r.get("device") or "?" for r in rows})
    hosts = sorted({r.get("host_type") or "unknown host" for r in rows})
    ranks = ("GPUs" if devices == ["cuda"] else "ranks on this CPU host (processes, not GPUs)" if devices == ["cpu"]
             else "ranks (GPUs or CPU processes)")
    memory = next((r.get("memory_method") for r in rows if r.get("memory_method")), "not recorded")
    return f"device {', '.join(devices)} on {'; '.join(hosts)}; memory: {memory}", ranks


def rests_on(rows: list[dict[str, Any]]) -> str:
    """What a measured leaf rests on: its runs, their host types and commits."""
    hosts = sorted({r.get("host_type") or "unknown host" for r in rows})
    commits = sorted({(r.get("git_commit") or "unknown")[:10] for r in rows})
    return f"rests on: measured: {len(rows)} run(s) on {'; '.join(hosts)}, commit(s) {', '.join(commits)}"


def decision_stage(rows: list[dict[str, Any]]) -> str | None:
    return next((s for s in STAGE_PREFERENCE if any(r["stage"] == s for r in rows)), None)


def build(rows: list[dict[str, Any]], budget_bytes: float | None = None, stage: str | None = None,
          include_extensions: bool = False, predicted: tuple[str, Node] | None = None) -> Node:
    """The measured tree; `predicted`: a branch for the user's target (bench.report.target), put beside the
    measured models."""
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
    where, ranks = hardware(rows)
    root = Node(f"Evidence from {where}. Which model? (decided on the {stage} stage; memory budget: {budget}; "
                f"{left_out}; speed: measured samples/s per rank over whole steps; forced-failure runs never count)",
                ranks="GPU(s)" if ranks == "GPUs" else "rank(s)")
    for model in sorted({r["model"] for r in rows}):
        by_model = [r for r in rows if r["model"] == model]
        ranks_node = Node(f"How many {ranks}?")
        for nproc in sorted({r["nproc"] for r in by_model}):
            by_ranks = [r for r in by_model if r["nproc"] == nproc]
            precision_node = Node("Which precision?")
            for precision in ("bf16", "fp16", "fp32"):
                by_precision = [r for r in by_ranks if r["precision"] == precision]
                tune_node = Node("Full fine-tuning, LoRA, or partial freezing?")
                measured_here = frozenset(r["framework"] for r in by_precision)
                for answer, mode in FINETUNE:
                    chosen = [r for r in by_precision if r.get("finetune", "lora" if r["lora"] else "full") == mode]
                    if mode == "partial" and not chosen:
                        continue  # only shown where a framework trains part of the model
                    elsewhere = measured_here - {r["framework"] for r in chosen}
                    found = leaf(chosen, budget_bytes, frameworks, mode, elsewhere)
                    if chosen:
                        found.evidence.append(rests_on(chosen))
                    tune_node.branches.append((answer, found))
                precision_node.branches.append((precision, tune_node))
            ranks_node.branches.append((str(nproc), precision_node))
        root.branches.append((model, ranks_node))
    if predicted is not None:
        root.branches.append(predicted)
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
