"""The report's Environment section: which hosts, devices, library versions and code the runs came from, each
with the number of runs, so a reader sees at the top whether the evidence is one machine at one commit."""

from __future__ import annotations

from collections import Counter
from typing import Any

from bench.report.aggregate import group
from bench.report.tables import Table, cell_flag
from bench.results.collect import Collection


def _counted(values: list[str]) -> list[list[str]]:
    return [[value, str(n)] for value, n in sorted(Counter(values).items(), key=lambda kv: (-kv[1], kv[0]))]


def environment_tables(collection: Collection) -> list[Table]:
    """Hosts (type and device), library version sets, and code (commit, dirty), each as value -> runs; then a
    one-line verdict of whether the cells are clean repeats."""
    records = collection.records.values()
    rows = collection.rows
    one_per_run = {r["run"]: r for r in rows}.values()
    hosts = _counted([f"{r.get('host_type') or 'unknown host'}; device {r.get('device') or '?'}" for r in one_per_run])
    versions = _counted([r.get("versions") or "not recorded" for r in one_per_run])
    code = _counted([r.get("code") or "unknown commit" for r in one_per_run])
    python = _counted([(rec.get("environment") or {}).get("python") or "?" for rec in records])
    cells = group(rows)
    flags = Counter(cell_flag(runs) for runs in cells.values())
    mixed = sum(n for flag, n in flags.items() if flag.startswith("mixed"))
    dirty = sum(1 for r in one_per_run if r.get("git_dirty"))
    summary = (f"{len(one_per_run)} runs in {len(cells)} cells: {len(hosts)} host type(s), {len(code)} code "
               f"version(s) ({dirty} run(s) from a dirty tree), {len(versions)} library version set(s); "
               f"{mixed} cell(s) mix provenance" + (" and are refused by verdicts and leaves"
                                                    if mixed and not collection.allow_mixed else
                                                    " (counted: --allow-mixed-provenance)" if mixed else ""))
    caption = ("Where the evidence came from, read from each record's environment: the host type (CPU model x "
               "cores, memory; GPUs where any), the code (commit, +dirty with the hash of the uncommitted diff "
               "where the tree differed from it), and the versions of every library the run could import. "
               + summary + ".")
    tables = [Table("environment", "Hosts, code and libraries", caption, ["what", "value", "runs"],
                    [["host", v, n] for v, n in hosts] + [["code", v, n] for v, n in code]
                    + [["python", v, n] for v, n in python] + [["libraries", v, n] for v, n in versions])]
    node_rows = nodes_rows(collection.records)
    if node_rows:
        tables.append(Table("nodes", "Runs over several nodes, by node", NODES_CAPTION,
                            ["run", "stage", "node", "host", "ranks", "host peak MiB (phase)", "fate"], node_rows))
    return tables


NODES_CAPTION = ("Each node of a run over several nodes (launcher.nnodes > 1), from the stage record's node list: "
                 "its host, the global ranks torchrun's rendezvous gave it, its host memory (per phase the sum over "
                 "its ranks of each rank's peak, an upper bound of the node's process tree; the largest phase shown, "
                 "MiB = 2^20 bytes) and, for a node whose ranks did not finish, which and why.")


def nodes_rows(records: dict[str, dict[str, Any]]) -> list[list[str]]:
    """One row per node of every stage that ran over several nodes, in run, stage and node order."""
    rows = []
    for run, record in sorted(records.items()):
        for stage, result in (record.get("stages") or {}).items():
            for node in result.get("nodes") or []:
                peaks = node.get("host_peak_bytes") or {}
                phase = max(peaks, key=peaks.get) if peaks else None
                peak = f"{peaks[phase] / 2**20:,.0f} ({phase})" if phase else "-"
                rows.append([run, stage, str(node["node"]), node["host"], " ".join(map(str, node["ranks"])), peak,
                             node.get("why") or "finished"])
    return rows

