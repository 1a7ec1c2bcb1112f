"""`python -m bench.report DIR [--out OUT] [--budget-gib G] [--stage S]`: the report of every record under DIR.

Writes OUT/report.md, OUT/report.html (self-contained), OUT/table.csv, OUT/table.parquet and OUT/plots/
(OUT defaults to DIR/report). Unreadable record files are listed in the report and skipped. Exit status
2 when DIR holds no readable record.
"""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console

from bench.report import (
    cells,
    checkpoints,
    claims,
    decision,
    differences,
    environment,
    fixed_cost,
    plans,
    plots,
    prediction,
    render,
    soak,
    tables,
    target,
    trl_vs_trlx,
    yardstick,
)
from bench.results.collect import collect
from bench.results.record import utc_now

GIB = 1024.0**3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.splitlines()[0])
    parser.add_argument("root", help="a sweep directory (results/sweeps/NAME), results/runs, or any folder of runs")
    parser.add_argument("--out", help="output folder (default: ROOT/report)")
    parser.add_argument("--budget-gib", type=float, help="per-rank memory budget for the decision tree, GiB")
    parser.add_argument("--stage", choices=decision.STAGE_PREFERENCE,
                        help="stage the decision tree decides on (default: ppo if measured, else rm, else sft)")
    parser.add_argument("--include-harness-extensions", action="store_true",
                        help="let the decision tree count cells only this harness can run (tagged harness_extension)")
    parser.add_argument("--allow-mixed-provenance", action="store_true",
                        help="let verdicts and leaves count cells whose runs differ in commit, dirty state, host "
                             "type, library versions or measurement settings (flagged either way)")
    parser.add_argument("--target", help="planner keys of your model and GPUs (e.g. \"model=glm-10b "
                        "cluster.gpus_per_node=8 cluster.gpu=A100-80GB\"): the decision tree gets a branch per "
                        "framework predicted there, beside the measured ones")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    if not os.path.isdir(args.root):
        console.print(f"[red]{args.root} is not a directory[/red]")
        return 2
    if args.budget_gib is not None and args.budget_gib <= 0:
        console.print(f"[red]--budget-gib={args.budget_gib} must be > 0[/red]")
        return 2
    predicted = None
    if args.target is not None:
        try:
            predicted = target.branch(target.plan_target(args.target), target.fact_accuracy())
        except target.TargetError as err:
            console.print(f"[red]{err}[/red]")
            return 2
    collection = collect(args.root, allow_mixed=args.allow_mixed_provenance)
    for problem in collection.problems:
        console.print(f"[yellow]skipped {problem.path}: {problem.reason}[/yellow]")
    if not collection.records:
        console.print(f"[red]no readable record.json under {args.root}[/red]")
        return 2
    out = args.out or os.path.join(args.root, "report")
    os.makedirs(out, exist_ok=True)
    budget = args.budget_gib * GIB if args.budget_gib else None
    report = render.Report(
        collection=collection,
        tables=tables.all_tables(collection.rows, collection.cells)
        + [differences.differences_table(collection.rows, collection.cells)]
        + yardstick.yardstick_tables(collection.rows, collection.cells)
        + trl_vs_trlx.trl_vs_trlx_table(collection.rows, collection.cells)
        + soak.soak_table(collection.rows, collection.records)
        + checkpoints.checkpoint_table(collection.rows, collection.cells)
        + fixed_cost.fixed_cost_table(collection.rows)
        + prediction.prediction_table(collection.records)
        + plans.plan_table(collection.records)
        + [cells.cells_table(collection, out)],
        plots=plots.all_plots(collection.rows, collection.records, collection.cells, os.path.join(out, "plots"))
        + soak.soak_figure(collection.rows, collection.records, os.path.join(out, "plots")),
        tree=decision.build(collection.rows, budget, args.stage, args.include_harness_extensions, predicted),
        claims=claims.check_all(collection.rows, collection.records, collection.cells),
        caveat=claims.caveat(collection.rows, collection.records),
        generated_utc=utc_now(),
        environment=environment.environment_tables(collection),
    )
    written = render.write_flat(collection.rows, out)
    for name, text in (("report.md", render.markdown(report)), ("report.html", render.html_page(report))):
        path = os.path.join(out, name)
        with open(path, "w") as f:
            f.write(text)
        written.append(path)
    console.print(f"report of {len(collection.records)} runs ({len(collection.rows)} stage rows, "
                  f"{len(collection.problems)} skipped files):")
    for path in written + [f.path for f in report.plots]:
        console.print(f"  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
