"""mkdocs hooks: the record page's schema tables come from bench/results/schema.py (the dataclasses), so the
schema is never written by hand twice."""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.results.schema import schema_markdown  # noqa: E402

MARKER = "<!-- record-schema -->"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return markdown.replace(MARKER, schema_markdown()) if MARKER in markdown else markdown
