"""Runs made from an execution plan (`bench.run plan=FILE`): per role and phase, what the plan predicted beside
what ran, read from each record's `plan` (bench.run.plan_record says how each side is measured)."""

from __future__ import annotations

from typing import Any

from bench.report.tables import Table

MIB = 2**20


def _mib(value: Any) -> str:
    return "-" if value is None else f"{value / MIB:,.1f}"


def _error(value: Any) -> str:
    return "-" if value is None else f"{value:+.1%}"


def plan_table(records: dict[str, dict[str, Any]]) -> list[Table]:
    """One line per role and per phase of every run that carries a plan."""
    body = []
    method = None
    for run, record in sorted(records.items()):
        plan = record.get("plan")
        if not plan:
            continue
        method = plan.get("method")
        framework = (record.get("config") or {}).get("framework", {}).get("name", "?")
        for entry in plan.get("roles") or []:
            knobs = "; ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                              for k, v in (entry.get("knobs") or {}).items())
            body.append([run, framework, f"role {entry['role']}", entry.get("layout", "-"), knobs or "-",
                         _mib(entry.get("planned_state_bytes")), _mib(entry.get("measured_state_bytes")),
                         _error(entry.get("error"))])
        for entry in plan.get("phases") or []:
            body.append([run, framework, f"phase {entry['phase']}", "-", "-", _mib(entry.get("planned_bytes")),
                         _mib(entry.get("measured_growth_bytes")), _error(entry.get("error"))])
    if not body:
        return []
    return [Table("plans", "Execution plans: planned against measured",
                  "Runs made with `python -m bench.run plan=FILE`: each role's layout in the plan's notation, the "
                  "framework knobs that expressed it, and MiB (2^20 bytes) per GPU (per rank on a CPU host). "
                  f"Per role: model state; per phase: the whole rank. {method}",
                  ["run", "framework", "what", "plan layout", "knobs", "planned MiB", "measured MiB", "error"],
                  body)]
