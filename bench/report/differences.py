"""Where two frameworks differ in memory: for matched cells (same configuration but the framework) whose
growth intervals over repeats do not overlap, the phase with the largest peak difference and the breakdown
term (parameters, optimizer state, reward function, rest) that makes most of it."""

from __future__ import annotations

from itertools import combinations
from typing import Any

from bench.report.aggregate import stat
from bench.report.pairs import matched_sets, tied
from bench.report.tables import Table
from bench.results.collect import BASELINE_TERMS, BREAKDOWN_TERMS
from bench.results.record import PHASE_ORDER, SETUP_PHASES

MIB = 1024.0 * 1024.0
Rows = list[dict[str, Any]]


def _median(runs: Rows, column: str) -> float | None:
    return stat([r.get(column) for r in runs]).median


def explain(a: str, runs_a: Rows, b: str, runs_b: Rows) -> tuple[str, str, float, str, float] | None:
    """(bigger framework, phase, its peak difference, term, the term's difference) or None without phases."""
    phases = [p for p in PHASE_ORDER if p not in SETUP_PHASES and _median(runs_a, f"growth_{p}_bytes") is not None
              and _median(runs_b, f"growth_{p}_bytes") is not None]
    if not phases:
        return None
    diffs = {p: _median(runs_a, f"growth_{p}_bytes") - _median(runs_b, f"growth_{p}_bytes") for p in phases}
    phase = max(phases, key=lambda p: abs(diffs[p]))
    # growth is measured from the baseline, so the baseline term is no part of a growth difference
    terms = {t: (_median(runs_a, f"{t}_{phase}_bytes") or 0.0) - (_median(runs_b, f"{t}_{phase}_bytes") or 0.0)
             for t in BREAKDOWN_TERMS if t not in BASELINE_TERMS}
    term = max(terms, key=lambda t: abs(terms[t]) if (terms[t] > 0) == (diffs[phase] > 0) else 0.0)
    bigger = a if diffs[phase] > 0 else b
    return bigger, phase, abs(diffs[phase]), term, abs(terms[term])


def differences_table(rows: Rows, cells: dict[str, dict[str, Any]]) -> Table:
    body = []
    for stage in ("sft", "rm", "ppo"):
        for matched in matched_sets(rows, cells, "framework", stage):
            growth = matched.stats("growth_bytes")
            for a, b in combinations(sorted(matched.by_value), 2):
                modes = {f: matched.by_value[f][0].get("finetune") for f in (a, b)}
                pair = f"{a} ({modes[a]}) vs {b} ({modes[b]})"
                if tied(growth[a], growth[b]):
                    body.append([stage, matched.fixed, pair, f"{growth[a].fmt(MIB, 0)} vs "
                                 f"{growth[b].fmt(MIB, 0)}", "within the repeat spread", "-", "-"])
                    continue
                found = explain(a, matched.by_value[a], b, matched.by_value[b])
                if found is None:
                    continue
                bigger, phase, diff, term, term_diff = found
                single = " (a single run: no spread to judge by)" if min(growth[a].n, growth[b].n) < 2 else ""
                body.append([stage, matched.fixed, pair, f"{growth[a].fmt(MIB, 0)} vs {growth[b].fmt(MIB, 0)}",
                             f"{bigger} +{diff / MIB:,.0f} MiB in {phase}{single}", term,
                             f"+{term_diff / MIB:,.0f} MiB"])
    return Table("differences", "Where frameworks differ in memory",
                 "Pairs of frameworks at one configuration (cells that differ only in the framework and its "
                 "options; ok runs not tagged forced-failure). Growth: MiB over the post-import baseline, max over "
                 "ranks and the phases after imports, median [range] CI (n). Where the growth ranges over repeats "
                 "do not "
                 "overlap: the phase whose growth (max over ranks) differs most, and the breakdown term of that "
                 "phase (on the rank that peaks: params, optimizer, reward_fn, rest) that carries most of the "
                 "difference, with its size. In brackets: full, lora or partial (only some "
                 "blocks train) fine-tuning.", ["stage", "configuration", "pair", "growth MiB", "largest difference",
                                                "term", "term difference"], body)
