"""The record page's schema, generated from the dataclasses: their fields, types, defaults and line comments."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from bench.results.record import ResultRecord, StageRecord
from bench.results.schema import field_rows, schema_markdown


@dataclass
class _Sample:
    name: str  # who it is
    size: int | None = None  # bytes | or none
    tags: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # more: see # the notes


def test_rows_read_types_defaults_and_the_comment_at_the_end_of_each_field_s_line():
    assert field_rows(_Sample) == [
        ("name", "str", "required", "who it is"),
        ("size", "int | None", "None", "bytes | or none"),
        ("tags", "list[str]", "[]", ""),
        ("extra", "dict[str, Any]", "{}", "more: see # the notes"),
    ]


def test_every_record_key_is_described_and_its_pipes_do_not_break_the_table():
    for cls in (ResultRecord, StageRecord):
        undescribed = [name for name, _, _, comment in field_rows(cls) if not comment]
        assert undescribed == [], f"{cls.__name__}: give these fields a line comment: {undescribed}"
    text = schema_markdown()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) == len(dataclasses.fields(ResultRecord)) + len(dataclasses.fields(StageRecord))
    # a row has 4 cells: 5 unescaped pipes
    assert all(line.replace("\\|", "").count("|") == 5 for line in rows)
    assert "| `finished_utc` | `str \\| None` | `None` | set by the last write: a record without it is a run cut " \
           "short |" in rows
