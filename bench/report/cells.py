"""The cells table: for every cell, its runs' records (links), seeds, code and host, and the command that
re-runs it (the sweep's own overrides, read back from the run id Hydra gave each run)."""

from __future__ import annotations

import os
import shlex
from typing import Any

from bench.report.aggregate import group
from bench.report.tables import Table, cell_flag
from bench.results.collect import RECORD_NAME, Collection

# overrides that only file a run; the command re-runs the cell wherever its user wants it
FILING_KEYS = ("sweep_name", "run_name", "output_root", "seed")


def split_overrides(run_id: str) -> list[str] | None:
    """Hydra's override dirname ("a=1,b=[x,y],c=2") back into overrides; None where the id is no such list."""
    parts, depth, current = [], 0, ""
    for char in run_id:
        depth += char in "[{("
        depth -= char in "]})"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return parts if all("=" in p for p in parts) else None


def rerun_command(record: dict[str, Any], seeds: list[Any]) -> str:
    """`python -m bench.run -m <overrides> seed=<the cell's seeds>`; from the configuration's main keys where
    the run id is not a list of overrides (a run started by hand)."""
    config = record["config"]
    overrides = split_overrides(str(record.get("run_id") or ""))
    if overrides is None:
        overrides = [f"framework={config['framework']['name']}", f"stage={config['stage']['name']}",
                     f"model={config['model']['name']}", f"precision={config['precision']}",
                     f"zero={config['zero']}", f"lora={config['lora']}", f"batch={config['batch']}",
                     f"launcher.nproc={config['launcher']['nproc']}"]
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in FILING_KEYS]
    seed_text = ",".join(str(s) for s in sorted(seeds, key=str))
    multi = "-m " if len(seeds) > 1 else ""
    return f"python -m bench.run {multi}" + " ".join(shlex.quote(o) for o in kept + [f"seed={seed_text}"])


def cells_table(collection: Collection, out: str) -> Table:
    """One line per cell: id, stage, framework, runs, seeds, code, host, provenance flag, records, command."""
    body = []
    for cell, runs in group(collection.rows).items():
        first = runs[0]
        record = collection.records[first["run"]]
        seeds = sorted({r.get("seed") for r in runs}, key=str)
        paths = " ".join(os.path.relpath(os.path.join(collection.root, r["run"], RECORD_NAME), out) for r in runs)
        body.append([cell, first["stage"], first["framework"], str(len(runs)), ", ".join(map(str, seeds)),
                     ", ".join(sorted({r.get("code") or "?" for r in runs})),
                     "; ".join(sorted({r.get("host_type") or "?" for r in runs})), cell_flag(runs), paths,
                     rerun_command(record, seeds)])
    return Table("cells", "Cells: their records and the command that re-runs each",
                 "A cell is one resolved configuration (minus the seed and bookkeeping); its runs are the repeats "
                 "(seeds). records: each run's record.json, relative to this report; command: re-runs the cell "
                 "(a sweep's own overrides, filing keys dropped, its seeds as a Hydra multirun). provenance: "
                 "mixed where the runs differ in commit, dirty state, host type, library versions or measurement "
                 "settings (refused as evidence unless --allow-mixed-provenance), dirty tree where they ran "
                 "uncommitted code.",
                 ["cell", "stage", "framework", "runs", "seeds", "code", "host", "provenance", "records", "command"],
                 body, links=("records",))
