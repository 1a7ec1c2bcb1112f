"""Where a run's time goes outside its steps, per framework: the records' `fixed_cost`, as medians over runs.

A benchmark that takes minutes to start is judged by that first; this table says how much of each run was
the harness (launch, process start), the engines' imports and JIT ops, building models and wrapping them in
engines, and the closing save, against the steps themselves.
"""

from __future__ import annotations

from typing import Any

from bench.report.aggregate import stat
from bench.report.tables import Table

# (column in the row, header): parts of a stage's wall time; "of which" parts are inside the one before them
PARTS = (("fixed_launch_s", "launch"), ("fixed_process_start_s", "process start"), ("fixed_imports_s", "imports"),
         ("fixed_jit_ops_s", "of which JIT ops"), ("fixed_init_s", "init"),
         ("fixed_init_model_build_s", "of which model build"), ("fixed_init_engines_s", "of which engines"),
         ("fixed_checkpoints_s", "checkpoints"), ("fixed_evaluation_s", "evaluation"),
         ("fixed_save_s", "closing save"), ("fixed_close_s", "teardown"), ("fixed_other_s", "other"),
         ("fixed_fixed_s", "fixed total"), ("fixed_steps_s", "steps"))


def _seconds(values: list[Any]) -> str:
    s = stat(values)
    if s.median is None:
        return "-"
    return f"{s.median:.1f}" if s.n == 1 else f"{s.median:.1f} [{s.low:.1f}, {s.high:.1f}]"


def fixed_cost_table(rows: list[dict[str, Any]]) -> list[Table]:
    """One line per (stage, framework, ranks, device) over the runs whose records split their fixed cost."""
    groups: dict[tuple[str, str, int, str], list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("status") == "ok" and row.get("fixed_fixed_s") is not None:
            key = (row["stage"], row["framework"], row.get("nproc") or 1, row.get("device") or "?")
            groups.setdefault(key, []).append(row)
    if not groups:
        return []
    body = [[stage, framework, str(nproc), device, str(len(runs)),
             *(_seconds([r.get(column) for r in runs]) for column, _ in PARTS)]
            for (stage, framework, nproc, device), runs in sorted(groups.items())]
    return [Table("fixed-cost", "Fixed cost of a run, per framework",
                  "Seconds of a stage's wall time outside its steps, on rank 0, median over the runs [min, max] "
                  "(the records' `fixed_cost`; its method string says how each part is timed). launch: torchrun, "
                  "spawning and merging the ranks' results; process start: the interpreter, torch, transformers "
                  "and the harness imported; imports: the engine libraries and process groups, with the JIT ops "
                  "built or loaded (a rebuild after a change of environment shows here); init: models built (of "
                  "which model build) and wrapped in engines; fixed total: wall time minus steps. Runs of any "
                  "configuration pool here: ZeRO-3 and offload lengthen init.",
                  ["stage", "framework", "ranks", "device", "runs", *(header for _, header in PARTS)], body)]
