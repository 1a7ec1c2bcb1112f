"""The record's schema as a Markdown table, read from the dataclasses themselves (the documentation's record
page is built from it, so the schema is written once: in bench/results/record.py)."""

from __future__ import annotations

import dataclasses
import inspect
import io
import tokenize
from typing import Any

from bench.results.record import ResultRecord, StageRecord


def _trailing_comments(cls: type) -> dict[str, str]:
    """The comment at the end of each field's line in the class body, by field name."""
    lines, _ = inspect.getsourcelines(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    comments: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
        row = token.start[0]
        if token.type == tokenize.NAME and row not in first_name:
            first_name[row] = token.string
        elif token.type == tokenize.COMMENT and first_name.get(row) in names:
            comments[first_name[row]] = token.string.lstrip("#").strip()
    return comments


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    if field.default_factory is not dataclasses.MISSING:
        made = field.default_factory()
        return repr(made) if made in ({}, []) else f"{field.default_factory.__name__}()"
    return "required"


def field_rows(cls: type) -> list[tuple[str, str, str, str]]:
    """(name, type, default, comment) of each field of a record dataclass, in declaration order."""
    comments = _trailing_comments(cls)
    return [(f.name, str(f.type), _default(f), comments.get(f.name, "")) for f in dataclasses.fields(cls)]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a bare pipe would end the table cell


def schema_markdown() -> str:
    """A table per record class: the run's `record.json` and each entry of its `stages`."""
    parts = []
    for cls, title in ((ResultRecord, "`record.json` (ResultRecord)"),
                       (StageRecord, "each entry of `stages` (StageRecord)")):
        rows = ["| key | type | default | what it holds |", "|---|---|---|---|"]
        rows += [f"| `{name}` | `{_cell(kind)}` | `{_cell(default)}` | {_cell(comment)} |"
                 for name, kind, default, comment in field_rows(cls)]
        parts.append(f"### {title}\n\n" + "\n".join(rows))
    return "\n\n".join(parts) + "\n"
