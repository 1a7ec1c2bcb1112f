"""The report's fixed-cost table, from hand-made rows."""

from __future__ import annotations

from bench.report.fixed_cost import PARTS, fixed_cost_table


def _row(framework: str, status: str = "ok", **seconds: float) -> dict:
    row = {"stage": "sft", "framework": framework, "nproc": 2, "device": "cpu", "status": status}
    return {**row, **{f"fixed_{k}_s": v for k, v in seconds.items()}}


def test_medians_and_ranges_per_framework_over_ok_runs_only():
    rows = [_row("dschat", launch=4.0, init=30.0, fixed=50.0), _row("dschat", launch=5.0, init=36.0, fixed=60.0),
            _row("dschat", launch=6.0, init=33.0, fixed=55.0),
            _row("dschat", "error", launch=99.0, init=99.0, fixed=99.0),  # a failed run is no fixed cost
            _row("trlx", launch=3.0, init=10.0, fixed=20.0), {"stage": "sft", "framework": "torch", "status": "ok"}]
    (table,) = fixed_cost_table(rows)
    assert [line[:5] for line in table.rows] == [["sft", "dschat", "2", "cpu", "3"], ["sft", "trlx", "2", "cpu", "1"]]
    column = {header: i + 5 for i, (_, header) in enumerate(PARTS)}
    dschat, trlx = table.rows
    assert dschat[column["launch"]] == "5.0 [4.0, 6.0]" and dschat[column["init"]] == "33.0 [30.0, 36.0]"
    assert dschat[column["fixed total"]] == "55.0 [50.0, 60.0]" and dschat[column["teardown"]] == "-"
    assert trlx[column["init"]] == "10.0"  # one run: no range


def test_no_table_without_a_split_fixed_cost():
    assert fixed_cost_table([{"stage": "sft", "framework": "dschat", "status": "ok"}]) == []
