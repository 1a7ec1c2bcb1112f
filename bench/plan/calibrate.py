"""`python -m bench.plan.calibrate ROOT [--select KEY=VALUE ...] [--dry-run]`: fit each framework's memory
calibration (bench.plan.calibration) on the selected runs under ROOT and write it next to the framework's
memory model, in place of its fit of the same measurement setting (mmap threshold and precisions; the fits of
other settings stay); print the error before and after, on the fitted runs and on the others.

Example (what the stored calibrations are: the GPT-2-shaped and the Llama-shaped CPU rungs, seed 1; glm-large
stays a model the fit never saw):
  python -m bench.plan.calibrate results/examples/glm-base results/examples/glm-base-amx \
    results/examples/llama-base --select 'model.name=[glm-base,llama-base]' --select seed=1
and the fp32 fit at 128 KiB, beside it:
  python -m bench.plan.calibrate results/examples/llama-base-fp32 --select model.name=llama-base --select seed=1 \
    --select precision=fp32 --select memory_mmap_threshold=131072
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from adapters import registry
from bench.plan import calibration
from bench.plan.accuracy import (
    LEAVE_ONE_OUT,
    SPLITS,
    Accuracy,
    Comparison,
    comparisons,
    in_selection,
    split_of,
)
from bench.results.collect import collect
from bench.run.spec import ROLLOUT_STAGES

TOLERANCE = 0.15


def _selection(pairs: list[str]) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--select {pair!r} must be KEY=VALUE, e.g. seed=1, model.name=glm-base or "
                             "model.name=[glm-base,llama-base] (any of)")
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError as error:
            raise ValueError(f"--select {pair!r}: the value {value!r} is not a YAML scalar or list ({error.problem}); "
                             "allowed: seed=1, model.name=glm-base, model.name=[glm-base,llama-base]") from None
    return out


def _residuals(rows: list[Comparison]) -> list[calibration.Residual]:
    return [calibration.Residual(r.key, r.measured, r.physics, r.value_bytes, r.model, r.tokens, r.batch_pair)
            for r in rows]


def _apply(rows: list[Comparison], cal: calibration.Calibration, device: str) -> list[Comparison]:
    return [replace(r, predicted=r.physics + cal.offset(r.key, device, r.value_bytes, r.model, r.tokens))
            for r in rows]


def _leave_one_out(rows: list[Comparison], chosen: set[str], framework: str, device: str) -> list[Comparison]:
    """Every configuration predicted by a calibration fitted without it: how the offsets carry over to a
    configuration they never saw (the fitted selection's runs of the other configurations)."""
    out = []
    for cell in sorted({r.cell for r in rows}):
        others = [r for r in rows if r.cell != cell and r.run in chosen]
        cal = calibration.fit(framework, device, _residuals(others), {})
        out += _apply([r for r in rows if r.cell == cell], cal, device)
    return out


def splits(mine: list[Comparison], cal: calibration.Calibration, chosen: set[str], framework: str, device: str
           ) -> dict[str, list[Comparison]]:
    """A framework's figures by split (bench.plan.accuracy.SPLITS, most out-of-sample first), each predicted by
    `cal` except leave-one-configuration-out, whose every fitted configuration is predicted by a fit without it."""
    fitted_rows = [r for r in mine if r.run in chosen]
    cells, models = {r.cell for r in fitted_rows}, {r.model for r in fitted_rows}
    out: dict[str, list[Comparison]] = {name: [] for name in SPLITS}
    out[LEAVE_ONE_OUT] = _leave_one_out([r for r in mine if r.cell in cells], chosen, framework, device)
    for row in _apply(mine, cal, device):
        out[split_of(row, chosen, cells, models)].append(row)
    return {name: rows for name, rows in out.items() if rows}


def refit(records: dict[str, dict[str, Any]], rows: list[Comparison], selection: dict[str, Any], root: str,
          framework: str) -> tuple[calibration.Calibration, list[Comparison], set[str], str] | None:
    """The calibration of `framework` fitted on the selected runs, with the framework's comparisons, the chosen
    runs and the device; None when no run of it matches the selection."""
    chosen = {run for run, record in records.items() if in_selection(record.get("config") or {}, selection)}
    mine = [r for r in rows if r.framework == framework]
    fitted = [r for r in mine if r.run in chosen]
    if not fitted:
        return None
    device = (records[mine[0].run].get("environment") or {}).get("device") or "cpu"
    if device == "cpu":
        _one_measurement(records, fitted, framework)
    cal = calibration.fit(framework, device, _residuals(fitted), {
        "source": os.path.normpath(root), "selection": selection, "runs": len({r.run for r in fitted})},
        runtime_samples(records, sorted({r.run for r in fitted})), setting_of(records, fitted))
    # the runs of other settings take none of this fit (bench.plan.calibration.for_run): left out of its splits
    return cal, [r for r in mine if cal.setting.matches(r.precision, r.mmap_threshold)], chosen, device


def setting_of(records: dict[str, dict[str, Any]], fitted: list[Comparison]) -> calibration.MeasurementSetting:
    """The measurement setting of the fitted runs (one mmap threshold: `_one_measurement` refuses more)."""
    configs = [records[r.run].get("config") or {} for r in fitted]
    return calibration.MeasurementSetting(mmap_threshold(records[fitted[0].run]),
                                          tuple(sorted({str(c.get("precision")) for c in configs})))


def floor_rule(record: dict[str, Any], stage: str) -> int:
    """The host floor rule a stage's peaks were measured under (bench.measure.memory.FLOOR_RULE; 1 before the
    records carried it)."""
    memory = ((record.get("stages") or {}).get(stage) or {}).get("memory") or {}
    return int(memory.get("floor_rule") or 1)


def mmap_threshold(record: dict[str, Any]) -> int | None:
    """The glibc mmap threshold a run fixed for its ranks (memory_mmap_threshold; None: glibc's own, as every
    record before the key ran)."""
    return (record.get("config") or {}).get("memory_mmap_threshold")


def _one_measurement(records: dict[str, dict[str, Any]], fitted: list[Comparison], framework: str) -> None:
    """Host peaks measured under different floor rules or allocator settings are not alike: a fit pooling them is
    refused. The floor rule counts for the rollout stages only: the rules differ on runs of a phase after another
    one beyond its first two, which SFT (init, then training after training) and RM (evaluation before and after
    its training) never have. The mmap threshold counts for every stage (it sets what every freed tensor leaves)."""
    rules: dict[int, set[str]] = {}
    thresholds: dict[str, set[str]] = {}
    for row in fitted:
        record = records[row.run]
        thresholds.setdefault(str(mmap_threshold(record)), set()).add(row.run)
        if row.stage in ROLLOUT_STAGES:
            rules.setdefault(floor_rule(record, row.stage), set()).add(row.run)
    if len(rules) > 1:
        counts = ", ".join(f"rule {rule}: {len(names)} run(s), e.g. {sorted(names)[0]}"
                           for rule, names in sorted(rules.items()))
        raise ValueError(f"{framework}: the selected runs' host peaks were measured under different floor rules "
                         f"(memory.floor_rule; bench.measure.memory.FLOOR_RULE) -- {counts}; re-measure the older "
                         "runs or select one rule's runs")
    if len(thresholds) > 1:
        counts = ", ".join(f"memory_mmap_threshold={value}: {len(names)} run(s), e.g. {sorted(names)[0]}"
                           for value, names in sorted(thresholds.items()))
        raise ValueError(f"{framework}: the selected runs' host peaks were measured under different allocator "
                         f"settings -- {counts}; select one setting's runs (--select memory_mmap_threshold=...)")


def runtime_samples(records: dict[str, dict[str, Any]], runs: list[str]) -> list[float]:
    """Rank 0's post-import baseline (bytes) of every stage of `runs` that measured one."""
    out = []
    for run in runs:
        for stage in (records[run].get("stages") or {}).values():
            baseline = ((stage or {}).get("memory") or {}).get("baseline_bytes_per_rank") or []
            if baseline and isinstance(baseline[0], (int, float)):
                out.append(float(baseline[0]))
    return out


def _records(roots: list[str]) -> dict[str, dict[str, Any]]:
    """Every record under the roots; with several, each run named under its root's folder name."""
    if len(roots) == 1:
        return collect(roots[0]).records
    return {f"{os.path.basename(os.path.normpath(root))}/{run}": record
            for root in roots for run, record in collect(root).records.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plan.calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="+", help="directories of records (several: one model's rung beside another)")
    parser.add_argument("--select", action="append", default=[], help="KEY=VALUE a fitted run's config matches")
    parser.add_argument("--dry-run", action="store_true", help="print the fit, write nothing")
    args = parser.parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=160)
    missing = [root for root in args.root if not os.path.isdir(root)]
    if missing:
        console.print(f"[red]{', '.join(missing)}: not a directory[/red]")
        return 2
    try:
        selection = _selection(args.select)
    except ValueError as error:
        console.print(str(error), style="red", markup=False)  # the value's brackets are text, not markup
        return 2
    records = _records(args.root)
    unreadable: dict[str, str] = {}
    rows = comparisons(records, unreadable)  # with the calibration now in place; physics is what the fit reads
    source = " + ".join(args.root)
    if unreadable:
        console.print(f"{len(unreadable)} successful run(s) left out: their configuration no longer reads as a "
                      f"run specification (first: {min(unreadable)}, {unreadable[min(unreadable)]})", markup=False)
    if not rows:
        console.print(f"[red]no successful run of a framework with a memory model under {source}[/red]")
        return 2
    table = Table(title=f"memory model vs measured growth, |error| (tolerance {TOLERANCE:.0%})")
    for column in ("framework", "runs", "split", "MAE physics", "MAE calibrated", "worst", "within"):
        table.add_column(column)
    fits = {}
    # only the frameworks that keep a calibration are refitted: the others' models are physics alone (TRL's is
    # checked against its records as it stands), and the CPU calibration gets no new framework
    kept = {f for f in {r.framework for r in rows} if calibration.load_all(registry.package(f))}
    for framework in sorted({r.framework for r in rows} - kept):
        console.print(f"{framework}: physics alone, no calibration kept (adapters/{registry.package(framework)}/"
                      "memory_calibration.json); not refitted")
    rows = [r for r in rows if r.framework in kept]
    for framework in sorted(kept):  # every fit first: a refused one writes nothing
        try:
            fits[framework] = refit(records, rows, selection, source, framework)
        except ValueError as error:
            console.print(str(error), style="red", markup=False)
            return 2
    for framework, fit in fits.items():
        if fit is None:
            console.print(f"[yellow]{framework}: no run matches the selection; its calibration is unchanged[/yellow]")
            continue
        cal, mine, chosen, device = fit
        for split, subset in splits(mine, cal, chosen, framework, device).items():
            models = sorted({r.model for r in subset})
            for model in models:  # a split by model where it holds several: each model's accuracy on its own
                acc = Accuracy.of([r for r in subset if r.model == model], TOLERANCE)
                worst = acc.worst
                table.add_row(framework, str(acc.runs), split if len(models) == 1 else f"{split} · {model}",
                              f"{acc.mae_physics:.1%}", f"{acc.mae:.1%}",
                              f"{worst.error:+.1%} ({worst.stage} {worst.phase}, {worst.model} seed {worst.seed})",
                              f"{acc.within}/{acc.runs}")
        if not args.dry_run:
            console.print(f"wrote {calibration.save(cal, registry.package(framework))} "
                          f"(the fit for {cal.setting.describe()})")
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
